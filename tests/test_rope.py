"""Rotary vision towers (`vision_pos = "rope"`): config, params, the relative-position
property, rotation edits, the content / position decomposition, training.

Shares test_dual_encoder's small config and inputs (fewer XLA compiles on CPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dual_encoder import CAPTIONS, IMAGES, IMAGES_NP, SMALL, H, L, random_params

from jaxmech.analysis.decompose import decompose
from jaxmech.analysis.rope import (
    cls_profiles,
    rope_ablation_table,
    rope_keep_masks,
    rope_logit_parts,
)
from jaxmech.config import Config, ConfigError
from jaxmech.families.dual_encoder.evaluate import METRICS, evaluate
from jaxmech.families.dual_encoder.model import (
    encode,
    encode_images,
    forward,
    init_params,
    rope_frequencies,
    rope_positions,
    vision_inputs,
)
from jaxmech.models.edits import Edits, term_mask
from jaxmech.reports.mechanism import ep_report_refusal
from jaxmech.sweep import coerce, expand
from jaxmech.train import build_data, init_state, stack_settings, train_step

DH = 8
ROPE = SMALL.replace(vision_pos="rope", rope_base=10.0)  # freqs 1, 0.56, 0.32, 0.18
ATOL = 1e-5


def rope_params(cfg=ROPE, seed=0, freqs=None):
    """test_dual_encoder's random params for a rotary config, with real (or given) frequencies."""
    p = random_params(cfg, seed)
    f = rope_frequencies(cfg.model.d_head, cfg.model.rope_base) if freqs is None else freqs
    return {**p, "vision": {**p["vision"], "rope_freqs": jnp.asarray(f, jnp.float32)}}


def _np(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def run_images(params, images=IMAGES, **kw):
    emb, aux = encode_images(params, images, **kw)
    return np.asarray(emb), _np(aux)


# ---------------------------------------------------------------------------
# config and params


def test_config_validation_names_the_field():
    assert Config().model.vision_pos == "learned"
    assert Config().replace(vision_pos="rope").model.rope_base == 10000.0
    with pytest.raises(ConfigError, match="vision_pos = 'alibi'.*'learned', 'rope'"):
        Config().replace(vision_pos="alibi")
    with pytest.raises(ConfigError, match="rope_base"):
        Config().replace(vision_pos="rope", rope_base=0.5)
    with pytest.raises(ConfigError, match="d_head = 7.*even"):
        Config().replace(vision_pos="rope", d_head=7)
    Config().replace(d_head=7)  # odd d_head is fine without rope
    with pytest.raises(ConfigError, match="cls_position"):
        Config().replace(vision_pos="rope", cls_position=True)
    # the flag machinery: a str field is coerced as text and validated by the config
    assert coerce("vision_pos", " rope ") == "rope"
    assert expand(Config(), {"vision_pos": "rope"}, 2).config.model.vision_pos == "rope"
    with pytest.raises(ConfigError, match="vision_pos"):
        expand(Config(), {"vision_pos": "nope"}, 1)
    cfg = Config().replace(vision_pos="rope", rope_base=100.0)
    assert Config.from_json(cfg.to_json()) == cfg


def test_rope_params_have_frequencies_and_no_vision_P():
    p = jax.eval_shape(
        lambda k: init_params(Config().replace(vision_pos="rope"), k), jax.random.PRNGKey(0)
    )
    assert "P" not in p["vision"] and p["vision"]["rope_freqs"].shape == (16,)
    assert p["text"]["P"].shape == (9, 128)  # the text tower keeps its learned P
    f = np.asarray(rope_frequencies(32, 10000.0))
    np.testing.assert_allclose(f, 10000.0 ** (-np.arange(16) / 16), rtol=1e-6)
    params = init_params(ROPE, jax.random.key(0, impl="rbg"))
    np.testing.assert_allclose(params["vision"]["rope_freqs"], rope_frequencies(DH, 10.0))
    tokens, rows = vision_inputs(params["vision"], IMAGES)
    assert rows is None and tokens.shape == (4, L + 1)
    np.testing.assert_array_equal(rope_positions(L), np.arange(L + 1))


# ---------------------------------------------------------------------------
# the relative-position property


def test_shifting_positions_keeps_relative_logits():
    params = rope_params()
    _, aux = run_images(params)
    s = aux["vision/attn_scores.0"]
    assert np.abs(s).max() > 1.0
    for shift in (3, 2.5):
        _, aux_s = run_images(params, positions=jnp.arange(L) + shift)
        s2 = aux_s["vision/attn_scores.0"]
        # pixel-pixel logits depend on pixel position differences only
        np.testing.assert_allclose(s2[:, :, 1:, 1:], s[:, :, 1:, 1:], atol=1e-4, rtol=1e-5)
        # CLS stays at rotary position 0: its row and column see the shift (the absolute
        # anchor that lets the tower tell the left half of the image from the right)
        assert np.abs(s2[:, :, 0] - s[:, :, 0]).max() > 1e-2
    # shifting every rotary position (CLS included) changes nothing at all
    tokens, _ = vision_inputs(params["vision"], IMAGES)
    idx = jnp.zeros((4,), jnp.int32)
    kw = dict(name="vision", causal=False)
    emb, aux0 = encode(params["vision"], tokens, None, idx, rope_pos=rope_positions(L), **kw)
    emb3, aux3 = encode(params["vision"], tokens, None, idx, rope_pos=rope_positions(L) + 3, **kw)
    np.testing.assert_allclose(
        aux3["vision/attn_scores.0"], aux0["vision/attn_scores.0"], atol=1e-4
    )
    np.testing.assert_allclose(emb3, emb, atol=ATOL)
    # batched positions: a different shift per image
    shifts = np.asarray([0.0, 1.0, 4.0, 0.5], np.float32)
    _, aux_b = run_images(params, positions=jnp.asarray(np.arange(L)[None] + shifts[:, None]))
    sb = aux_b["vision/attn_scores.0"]
    np.testing.assert_allclose(sb[:, :, 1:, 1:], s[:, :, 1:, 1:], atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(sb[0], s[0], atol=1e-6)


def test_mirrored_image_with_mirrored_positions_is_the_same_input():
    params = rope_params()
    emb, _ = run_images(params)
    emb_m, _ = run_images(params, jnp.asarray(IMAGES_NP[:, ::-1]), positions=L - 1 - jnp.arange(L))
    np.testing.assert_allclose(emb_m, emb, atol=ATOL)
    emb_n, _ = run_images(params, jnp.asarray(IMAGES_NP[:, ::-1]))
    assert np.abs(emb_n - emb).max() > 1e-3


def test_zero_frequencies_equal_the_no_position_model():
    params = rope_params(freqs=np.zeros(DH // 2))
    # the same model with a learned P that is zero: no position information at all
    v = {k: x for k, x in params["vision"].items() if k != "rope_freqs"}
    nopos = {**params, "vision": {**v, "P": jnp.zeros((L, SMALL.model.d_model))}}
    for readout_only in (False, True):
        sims, aux = forward(params, IMAGES, CAPTIONS, readout_only=readout_only)
        sims0, aux0 = forward(nopos, IMAGES, CAPTIONS, readout_only=readout_only)
        np.testing.assert_allclose(sims, sims0, atol=1e-6, rtol=0)
        np.testing.assert_allclose(
            aux["vision/attn_scores.0"], aux0["vision/attn_scores.0"], atol=1e-6, rtol=0
        )
    # and real frequencies do make a difference
    sims_r, _ = forward(rope_params(), IMAGES, CAPTIONS)
    assert np.abs(np.asarray(sims_r) - np.asarray(sims)).max() > 1e-2


# ---------------------------------------------------------------------------
# fast paths and edits


def test_readout_only_and_factored_paths_are_exact():
    params = rope_params(ROPE.replace(n_layers=2), seed=1)
    sims, aux = forward(params, IMAGES, CAPTIONS)
    sims_r, aux_r = forward(params, IMAGES, CAPTIONS, readout_only=True)
    np.testing.assert_allclose(sims_r, sims, atol=ATOL, rtol=1e-6)
    np.testing.assert_allclose(aux_r["vision/embed"], aux["vision/embed"], atol=ATOL)
    # a zero edit of resid_pre.0 turns the factored first layer off: dense path
    dense = Edits(add={"vision/resid_pre.0": jnp.zeros(SMALL.model.d_model)})
    sims_d, aux_d = forward(params, IMAGES, CAPTIONS, edits=dense)
    np.testing.assert_allclose(sims_d, sims, atol=ATOL, rtol=1e-6)
    for name in ("q.0", "rot_q.0", "rot_k.0", "attn_scores.0", "attn_scores.1"):
        np.testing.assert_allclose(aux_d[f"vision/{name}"], aux[f"vision/{name}"], atol=ATOL)
    # rot_q is q rotated: same norm per pair, different vector
    q, rq = np.asarray(aux["vision/q.0"]), np.asarray(aux["vision/rot_q.0"])
    pair_norm = lambda x: x[..., : DH // 2] ** 2 + x[..., DH // 2 :] ** 2  # noqa: E731
    np.testing.assert_allclose(pair_norm(rq), pair_norm(q), atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(rq[:, 0], q[:, 0])  # CLS at rotary position 0
    assert np.abs(rq[:, 1:] - q[:, 1:]).max() > 1e-2


def test_rope_keep_switches_the_rotation_off_per_head():
    params = rope_params()
    sims, aux = forward(params, IMAGES, CAPTIONS)
    ones = Edits(rope_keep={"vision": jnp.ones(H)})
    sims_1, aux_1 = forward(params, IMAGES, CAPTIONS, edits=ones)
    assert (np.asarray(sims_1) == np.asarray(sims)).all()  # all-ones: bit-identical
    assert (
        np.asarray(aux_1["vision/attn_scores.0"]) == np.asarray(aux["vision/attn_scores.0"])
    ).all()
    # off in every head = the zero-frequency model
    off = Edits(rope_keep={"vision": jnp.zeros(H)})
    sims_0, _ = forward(params, IMAGES, CAPTIONS, edits=off)
    sims_z, _ = forward(rope_params(freqs=np.zeros(DH // 2)), IMAGES, CAPTIONS)
    np.testing.assert_allclose(sims_0, sims_z, atol=1e-6, rtol=0)
    # off in heads 1 and 3: their logits become the unrotated q . k, heads 0, 2 unchanged
    keep = jnp.asarray([1.0, 0.0, 1.0, 0.0])
    _, aux_h = forward(params, IMAGES, CAPTIONS, edits=Edits(rope_keep={"vision": keep}))
    s, sh = np.asarray(aux["vision/attn_scores.0"]), np.asarray(aux_h["vision/attn_scores.0"])
    q, k = np.asarray(aux["vision/q.0"], np.float64), np.asarray(aux["vision/k.0"], np.float64)
    unrot = np.einsum("bqhe,bshe->bhqs", q, k) / np.sqrt(DH)
    np.testing.assert_allclose(sh[:, [1, 3]], unrot[:, [1, 3]], atol=ATOL, rtol=1e-5)
    np.testing.assert_array_equal(sh[:, [0, 2]], s[:, [0, 2]])
    # per-layer masks [n_layers, H] work too
    _, aux_l = forward(params, IMAGES, CAPTIONS, edits=Edits(rope_keep={"vision": keep[None]}))
    np.testing.assert_array_equal(aux_l["vision/attn_scores.0"], sh)
    # rotation edits need a rotary tower; term edits need a learned P
    with pytest.raises(ValueError, match="rotary"):
        forward(params, IMAGES, CAPTIONS, edits=Edits(rope_keep={"text": jnp.ones(H)}))
    with pytest.raises(ValueError, match="rope_keep"):
        forward(params, IMAGES, CAPTIONS, edits=Edits(term_keep={"vision": term_mask(H, ["EP"])}))


# ---------------------------------------------------------------------------
# decomposition


@pytest.mark.parametrize("variant", ["one_layer", "two_layers_ln"])
def test_decomposition_parts_sum_to_the_logits(variant):
    if variant == "one_layer":
        cfg, layer = ROPE, 0
    else:
        cfg, layer = ROPE.replace(n_layers=2, layernorm=True), 1
    params = rope_params(cfg, seed=2)
    parts = _np(jax.jit(rope_logit_parts, static_argnames="layer")(params, IMAGES, layer=layer))
    logits = parts["logits"]
    assert logits.shape == (4, H, L + 1, L + 1) and np.abs(logits).max() > 1.0
    np.testing.assert_allclose(parts["content"] + parts["position"], logits, atol=ATOL, rtol=1e-5)
    keys = ("E", "B") if layer == 0 else ("E", "R", "B")
    for kind in ("content", "position"):
        total = sum(parts[f"{kind}_{x}"] for x in keys)
        np.testing.assert_allclose(total, parts[kind], atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(parts[f"pair_{kind}"].sum(-1), parts[kind], atol=ATOL)
        for x in keys:
            assert np.abs(parts[f"{kind}_{x}"]).max() > 1e-2, (kind, x)
    # position vanishes at relative position 0 (the diagonal); content_B is row-constant
    diag = parts["position"][:, :, np.arange(L + 1), np.arange(L + 1)]
    np.testing.assert_allclose(diag, 0.0, atol=1e-6)
    cb = parts["content_B"]
    np.testing.assert_allclose(cb, np.broadcast_to(cb[..., :1], cb.shape), atol=1e-5)
    np.testing.assert_array_equal(
        parts["rel_pos"], np.arange(L + 1)[None] - np.arange(L + 1)[:, None]
    )
    if layer == 0:
        # content = the logits with the rotation switched off
        off = Edits(rope_keep={"vision": jnp.zeros(H)})
        _, aux_off = run_images(params, edits=off)
        np.testing.assert_allclose(parts["content"], aux_off["vision/attn_scores.0"], atol=ATOL)
        # the E/P decomposition refuses a rotary tower, and says where to look instead
        with pytest.raises(ValueError, match="analysis.rope"):
            decompose(params, IMAGES)
        with pytest.raises(ValueError, match="rotary"):
            rope_logit_parts(random_params(SMALL), IMAGES)


def test_cls_profiles_read_a_planted_gradient():
    # a model whose CLS query meets the keys' bias only through the rotation: with b_K in
    # the plane of the lowest frequency, the CLS row is a sin/cos of the offset p + 1
    params = rope_params()
    v = params["vision"]
    block = dict(v["block_0"])
    block["W_K"] = jnp.zeros_like(block["W_K"])
    F = DH // 2
    bq = np.zeros((H, DH), np.float32)
    bk = np.zeros((H, DH), np.float32)
    bq[:, F - 1] = 4.0  # query pair F-1, first component
    bk[:, 2 * F - 1] = 4.0  # key pair F-1, second component: b = -16, a = 0
    block["b_Q"], block["b_K"] = jnp.asarray(bq), jnp.asarray(bk)
    block["W_Q"] = jnp.zeros_like(block["W_Q"])
    params = {**params, "vision": {**v, "block_0": block}}
    prof = _np(cls_profiles(params, n_labels=20, image_len=L))
    f = float(rope_frequencies(DH, 10.0)[F - 1])
    expected = -16.0 * np.sin(f * (np.arange(L) + 1)) / np.sqrt(DH)  # position_B only
    np.testing.assert_allclose(prof["background"], np.broadcast_to(expected, (H, L)), atol=1e-5)
    np.testing.assert_allclose(
        prof["profile"], np.broadcast_to(expected - expected.mean(), (H, L)), atol=1e-5
    )
    np.testing.assert_allclose(prof["spearman"], -1.0, atol=1e-6)
    assert (prof["slope"] < 0).all()
    assert (prof["sign_agree"] == 1.0).all()
    np.testing.assert_allclose(prof["delta_label"], 0.0, atol=1e-6)  # no content part
    assert prof["relational"].all()


# slow: the rope report's ablation table end to end (~15 s); the rotary forward's invariants stay in the suite
@pytest.mark.slow
def test_rope_ablation_table_and_permutation_invariance():
    cfg = ROPE.replace(n_labels=8, n_val_labels=3, n_pair_labels=5, layouts_per_pair=5)
    data = build_data(cfg)
    seeds = [_np(rope_params(cfg, seed=s)) for s in (0, 3)]
    params_K = jax.tree_util.tree_map(lambda *x: jnp.asarray(np.stack(x)), *seeds)
    settings_K = jax.tree_util.tree_map(jnp.asarray, stack_settings([cfg.settings()] * 2))
    names, masks = rope_keep_masks(H)
    assert names[:3] == ("none", "all heads", "head 0") and masks.shape == (2 + 2 * H, H)
    table = _np(rope_ablation_table(params_K, settings_K, data, masks))
    assert table["unseen_acc"].shape == (2, len(names))
    plain = _np(evaluate(seeds[0], data.evals, data.tables.captions, cfg.settings()))
    for m in METRICS:
        np.testing.assert_allclose(table[m][0, 0], plain[m], atol=1e-6)
    # no rotation anywhere: the tower sees a bag of pixels, so an image and its swapped
    # pair embed alike and exactly one of the two wins: unseen-pair accuracy is 1/2
    np.testing.assert_allclose(table["unseen_acc"][:, 1], 0.5, atol=0.01)


# ---------------------------------------------------------------------------
# training


def test_training_step_runs_and_keeps_the_frequencies():
    cfg = Config().replace(
        vision_pos="rope",
        d_model=32,
        d_head=8,
        d_embed=32,
        batch_size=32,
        steps=20,
        eval_every=10,
        n_labels=8,
        n_val_labels=3,
        n_pair_labels=5,
        layouts_per_pair=5,
        image_len=6,
    )
    data = jax.tree_util.tree_map(jnp.asarray, build_data(cfg))
    s = cfg.settings()
    state = init_state(cfg, s)
    step = jax.jit(train_step, static_argnames="config")
    new, metrics = step(state, s, data, config=cfg)
    newer, metrics2 = step(new, s, data, config=cfg)
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics2["loss"])
    assert int(newer.step) == 2 and int(newer.diverged_step) == -1
    assert not np.allclose(newer.params["vision"]["E"], state.params["vision"]["E"])
    assert not np.allclose(
        newer.params["vision"]["block_0"]["W_Q"], state.params["vision"]["block_0"]["W_Q"]
    )
    # the frequencies are constants: zero gradient, no weight decay, so no update
    np.testing.assert_array_equal(newer.params["vision"]["rope_freqs"], rope_frequencies(8, 1e4))
    # and so are the switches of params["static"] (0-d: no decay; gradient stopped)
    assert _np(newer.params["static"]) == _np(state.params["static"])


def test_mechanism_report_refuses_rope_runs():
    msg = ep_report_refusal(Config().replace(vision_pos="rope"), "runs/x")
    assert "no learned P" in msg and "experiments.rope --run=runs/x" in msg
    assert ep_report_refusal(Config(), "runs/x") is None
