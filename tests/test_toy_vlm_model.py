"""The autoregressive VLM (`families.toy_vlm.model`, `families.toy_vlm.vit`): causality, positions,
windows, edits as data, the first-block term split, vmap, input checks, a training step.

Small configs throughout (a 3 x 4 grid, so rows and columns cannot be confused);
init scales of 1 and a small rope base make every position code matter numerically.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.analysis.vit_terms import vit_logit_terms
from jaxmech.config import Config
from jaxmech.data.tasks.scenes import SCENE_WORDS, label_token
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.families.toy_vlm.checks import edit_names
from jaxmech.models.edits import VIT_TERMS, Edits, term_mask

GH, GW, Q, B = 3, 4, 8, 3
L = GH * GW
S = L + Q
SMALL = dict(
    task_kind="scenes", model_kind="toy_vlm", grid_h=GH, grid_w=GW, n_labels=6, n_val_labels=2,
    n_pair_labels=4,
    d_model=16, d_head=8, n_heads=2, d_mlp=16, n_layers=2, lm_n_layers=2,
    init_E=1.0, init_P=1.0, rope_base=10.0,
)  # fmt: skip


def config(**kw):
    return Config().replace(**{**SMALL, **kw})


@functools.lru_cache(maxsize=None)
def _params(items):
    return toy_vlm.init_params(config(**dict(items)), jax.random.PRNGKey(3))


def params(**kw):
    return _params(tuple(sorted(kw.items())))


def inputs(seed=0, batch=B):
    """Random cells (every cell an object, so no two cells look alike) and a question."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(1, 7, (batch, L))
    colours = rng.integers(0, 5, (batch, L))
    facings = rng.integers(0, 3, (batch, L))
    question = rng.integers(0, 15, (batch, Q))
    return tuple(jnp.asarray(a, jnp.int32) for a in (labels, colours, facings, question))


def run(p, x, **kw):
    """The forward's logits, or with `capture` (logits, intermediates)."""
    logits, aux = toy_vlm.forward(p, *x, **kw)
    return (logits, aux) if kw.get("capture") else logits


def cell_rows_cols():
    idx = np.arange(L)
    return idx // GW, idx % GW


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_layout_and_vocab():
    p = params(vit_pos="learned2d")
    assert p["vit"]["row_P"].shape == (GH, 16) and p["vit"]["col_P"].shape == (GW, 16)
    assert p["vit"]["label_E"].shape == (7, 16) and p["vit"]["facing_E"].shape == (3, 16)
    V = len(SCENE_WORDS) + 6
    assert p["lm"]["E"].shape == (V, 16) and p["lm"]["W_U"].shape == (16, V)
    assert set(p["proj"]) == {"W", "b"}
    q = params(vit_pos="rope2d", projector="mlp", vit_window=2, vit_global_blocks="1")
    assert "row_P" not in q["vit"] and set(q["proj"]) == {"W1", "b1", "W2", "b2"}
    assert q["static"]["vit_global"].tolist() == [0.0, 1.0]


def test_mrope_default_ids():
    p = params(lm_pos_ids="mrope")
    ids = np.asarray(toy_vlm.lm_position_ids(p, Q))
    rows, cols = cell_rows_cols()
    np.testing.assert_array_equal(ids[:, :L], np.stack([0 * rows, rows, cols]))
    text = max(GH, GW) + np.arange(Q)  # continues after the largest image id (3)
    np.testing.assert_array_equal(ids[:, L:], np.stack([text] * 3))
    seq = np.asarray(toy_vlm.lm_position_ids(params(), Q))
    np.testing.assert_array_equal(seq, np.stack([np.arange(S)] * 3))


@jax.jit
def _position_jacobian(p, x):
    """[s, t] summed |d logit(position s) / d LM input(position t)| over batch, vocab
    and width. Params are an argument, not a closure, so every config of one param
    layout (sequential and mrope ids differ only in `static` values) shares one program."""

    def per_position(delta):
        _, aux = run(p, x, edits=Edits(add={"lm/resid_pre.0": delta}), capture=True)
        logits = toy_vlm.unembed(p, aux["lm/resid_post.1"])  # [B, S, V]
        return logits.sum(axis=(0, 2))

    jac = jax.jacrev(per_position)(jnp.zeros((B, S, 16)))  # [S, B, S, D]
    return jnp.abs(jac).sum(axis=(1, 3))


@pytest.mark.parametrize("pos_ids", ["sequential", "mrope"])
def test_lm_is_causal(pos_ids):
    """d logit(position s) / d input(position t) is zero for every t > s, not for t = s."""
    mag = np.asarray(
        _position_jacobian(params(lm_pos_ids=pos_ids, layernorm=True, mlp=True), inputs())
    )
    assert np.all(mag[np.triu_indices(S, 1)] == 0.0)
    assert np.all(np.diag(mag) > 0)


@pytest.mark.parametrize("pos_ids", ["sequential", "mrope"])
def test_lm_rope_depends_on_offsets_only(pos_ids):
    p = params(lm_pos_ids=pos_ids)
    x = inputs()
    base = np.asarray(toy_vlm.lm_position_ids(p, Q))
    logits, aux = run(p, x, capture=True)
    shift = np.asarray([[5.0], [-2.0], [7.5]])  # each of (t, row, col) its own shift
    moved, aux_m = run(p, x, edits=Edits(lm_pos_ids=jnp.asarray(base + shift)), capture=True)
    close(aux_m["lm/attn_scores.0"], aux["lm/attn_scores.0"], 1e-4)
    close(moved, logits, 1e-4)
    swapped = base.copy()
    swapped[:, [0, S - 1]] = swapped[:, [S - 1, 0]]  # not a common shift: logits move
    other = run(p, x, edits=Edits(lm_pos_ids=jnp.asarray(swapped)))
    assert np.abs(np.asarray(other - logits)).max() > 1e-3


def test_rope2d_depends_on_row_and_col_offsets_only():
    p = params(vit_pos="rope2d")
    x = inputs()
    rows, cols = (jnp.asarray(a, jnp.float32) for a in cell_rows_cols())
    _, aux = run(p, x, capture=True)
    _, aux_m = run(p, x, edits=Edits(vit_rows=rows + 1.5, vit_cols=cols - 2.0), capture=True)
    for name in ("vit/attn_scores.0", "vit/attn_scores.1", "proj/out"):
        close(aux_m[name], aux[name], 1e-4)
    for edit in (Edits(vit_rows=GH - 1 - rows), Edits(vit_cols=GW - 1 - cols)):
        _, aux_e = run(p, x, edits=edit, capture=True)
        assert (
            np.abs(np.asarray(aux_e["vit/attn_scores.0"] - aux["vit/attn_scores.0"])).max() > 1e-3
        )


def test_window_blocks_see_only_their_window():
    p = params(vit_window=2, vit_global_blocks="1")
    _, aux = run(p, inputs(), capture=True)
    rows, cols = cell_rows_cols()
    win = (rows // 2) * 10 + cols // 2
    same = win[:, None] == win[None, :]
    pattern0 = np.asarray(aux["vit/pattern.0"])  # [B, H, L, L]
    assert np.all(pattern0[..., ~same] == 0.0) and np.all(pattern0[..., same] > 0)
    assert np.all(np.asarray(aux["vit/pattern.1"]) > 0)  # the global block sees all


@pytest.mark.parametrize("vit_pos", ["learned2d", "sincos2d", "rope2d"])
def test_mirrored_column_override_equals_physical_mirror(vit_pos):
    p = params(vit_pos=vit_pos, layernorm=True, mlp=True)
    x = inputs()
    rows, cols = cell_rows_cols()
    perm = rows * GW + (GW - 1 - cols)  # cell j shows the content of its mirror cell
    mirror_cols = jnp.asarray(GW - 1 - cols, jnp.float32)
    _, aux_o = run(p, x, edits=Edits(vit_cols=mirror_cols), capture=True)
    physical = tuple(a[:, perm] for a in x[:3]) + (x[3],)
    _, aux_p = run(p, physical, capture=True)
    close(aux_o["vit/resid_post.1"][:, perm], aux_p["vit/resid_post.1"], 1e-4)
    _, aux = run(p, x, capture=True)
    assert np.abs(np.asarray(aux_o["vit/resid_post.1"] - aux["vit/resid_post.1"])).max() > 1e-3


NOOP_CONFIGS = [
    dict(),
    dict(vit_pos="sincos2d", layernorm=True, mlp=True, lm_pos_ids="mrope", projector="mlp"),
    dict(vit_pos="rope2d", vit_window=2, vit_global_blocks="1", lm_pos_ids="mrope"),
]


@pytest.mark.parametrize("kw", NOOP_CONFIGS)
def test_noop_edits_are_bit_identical(kw):
    p = params(**kw)
    x = inputs()
    plain = np.asarray(run(p, x))
    rows, cols = (jnp.asarray(a, jnp.float32) for a in cell_rows_cols())
    ids = toy_vlm.lm_position_ids(p, Q)
    names = edit_names(p)
    noops = [
        Edits(vit_rows=rows, vit_cols=cols),
        Edits(lm_pos_ids=ids),
        Edits(image_order=jnp.arange(L)),
        Edits(add={n: jnp.zeros(()) for n in names}),
        Edits(replace={"proj/out": (False, 0.0), "vit/q.1": (False, 0.0)}),
    ]
    if kw.get("lm_pos_ids", "sequential") == "sequential":
        noops.append(Edits(lm_pos_ids=jnp.arange(S, dtype=jnp.float32)))
    if kw.get("vit_pos", "learned2d") != "rope2d":
        noops.append(Edits(term_keep={"vit": jnp.ones((2, 16))}))
    for edit in noops:
        np.testing.assert_array_equal(np.asarray(run(p, x, edits=edit)), plain)


def test_vmap_over_params_and_edits_equals_loop():
    """One jitted vmap over three models and three edits (image orders) at once equals
    the eager loop. The params are stacked from eager inits: a jitted vmap of
    `init_params` compiles slowly (one random draw per parameter) and adds nothing here
    (the sweep test runs one)."""
    c = config(lm_pos_ids="mrope", vit_window=2, vit_global_blocks="1")
    models = [toy_vlm.init_params(c, jax.random.PRNGKey(k)) for k in range(3)]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *models)
    orders = jnp.stack([jnp.arange(L), jnp.arange(L)[::-1], jnp.roll(jnp.arange(L), 3)])
    x = inputs()
    each = lambda p, o: run(p, x, edits=Edits(image_order=o))  # noqa: E731
    batched = jax.jit(jax.vmap(each))(stacked, orders)
    for k in range(3):
        close(batched[k], each(models[k], orders[k]), 2e-4)  # jit vs eager: float rounding
    assert np.abs(np.asarray(batched[0] - batched[1])).max() > 1e-3  # the models differ


@pytest.mark.parametrize("kw", [dict(), dict(vit_pos="sincos2d", layernorm=True)])
def test_vit_terms_sum_to_first_block_logits(kw):
    p = params(**kw)
    x = inputs()
    terms = vit_logit_terms(p, *x[:3])
    assert set(terms) == set(VIT_TERMS) | {"logits"}
    close(sum(terms[t] for t in VIT_TERMS), terms["logits"], 1e-4)
    rows = jnp.asarray(cell_rows_cols()[0], jnp.float32) + 0.5  # half-cell shift
    shifted = vit_logit_terms(p, *x[:3], vit_rows=rows)
    close(sum(shifted[t] for t in VIT_TERMS), shifted["logits"], 1e-4)
    assert np.abs(np.asarray(shifted["RR"] - terms["RR"])).max() > 1e-3


@pytest.mark.parametrize("kw", [dict(), dict(vit_pos="sincos2d", layernorm=True)])
def test_term_keep_removes_terms(kw):
    p = params(**kw)
    x = inputs()
    _, aux = run(p, x, edits=Edits(term_keep={"vit": jnp.zeros((2, 16))}), capture=True)
    close(aux["vit/attn_scores.0"], 0.0, 1e-4)
    gone = ["CK", "RK", "KK", "BK", "KC", "KR", "KB"]  # every column-position term
    _, aux = run(
        p, x, edits=Edits(term_keep={"vit": term_mask(2, gone, terms=VIT_TERMS)}), capture=True
    )
    terms = vit_logit_terms(p, *x[:3])
    left = sum(terms[t] for t in VIT_TERMS if t not in gone)
    close(aux["vit/attn_scores.0"], left, 1e-4)


def test_image_order_equals_permuting_projector_output():
    p = params()
    x = inputs()
    plain, aux = run(p, x, capture=True)
    order = jnp.asarray(cell_rows_cols()[0] * GW + (GW - 1 - cell_rows_cols()[1]))
    edited = run(p, x, edits=Edits(image_order=order))
    patched = run(p, x, edits=Edits(replace={"proj/out": (True, aux["proj/out"][:, order])}))
    close(edited, patched, 1e-6)
    assert np.abs(np.asarray(edited - plain)).max() > 1e-3


def projected_by_hand(proj, x):
    """The projector written out (linear: x W + b; mlp: GELU(x W1 + b1) W2 + b2)."""
    if "W" in proj:
        return x @ proj["W"] + proj["b"]
    return jax.nn.gelu(x @ proj["W1"] + proj["b1"]) @ proj["W2"] + proj["b2"]


@pytest.mark.parametrize("projector", ["linear", "mlp"])
def test_tied_label_words_are_the_projected_vit_labels(projector):
    """tie_labels: a label word's LM embedding is the projector applied to its
    `vit/label_E` row, the other words keep their `lm/E` row, and the forward reads
    those embeddings (a label word's `lm/E` row no longer matters). The static switch
    off again: every word is its `lm/E` row."""
    p = params(tie_labels=True, projector=projector)
    # nonzero biases (they start at 0), so the whole projector shows in the embedding
    p = {**p, "proj": {k: v + 0.3 if k[0] == "b" else v for k, v in p["proj"].items()}}
    x = inputs()
    q = np.asarray(x[3])
    is_label = q >= label_token(1)
    assert is_label.any() and (~is_label).any()
    tied = np.asarray(projected_by_hand(p["proj"], p["vit"]["label_E"]))
    words = np.asarray(p["lm"]["E"])
    label = np.where(is_label, q - label_token(1) + 1, 0)
    want = np.where(is_label[..., None], tied[label], words[q])
    close(toy_vlm.question_embedding(p, x[3]), want, 1e-5)
    moved = {**p, "lm": {**p["lm"], "E": p["lm"]["E"].at[label_token(1) :].add(1.0)}}
    close(run(moved, x), run(p, x), 1e-6)
    untied, moved_untied = (
        {**a, "static": {**a["static"], "tie_labels": jnp.float32(0.0)}} for a in (p, moved)
    )
    close(toy_vlm.question_embedding(untied, x[3]), words[q], 0.0)
    # untied, the same change of lm/E moves the logits: the invariance above is not vacuous
    assert np.abs(np.asarray(run(moved_untied, x) - run(untied, x))).max() > 1e-3


def test_errors_name_the_argument():
    p = params()
    x = inputs()
    bad = [
        ((x[0][:, :5],) + x[1:], {}, "labels_BxL"),
        ((x[0], x[1] + 9) + x[2:], {}, "colours_BxL"),
        (x[:2] + (x[2] + 3, x[3]), {}, "facings_BxL"),
        (x[:3] + (x[3][:2],), {}, "question_BxQ"),
        (x[:3] + (x[3] + 20,), {}, "question_BxQ"),
        (x, {"edits": Edits(add={"lm/resid_pre.9": 0.0})}, "edits.add"),
        (x, {"edits": Edits(vit_rows=jnp.zeros(5))}, "edits.vit_rows"),
        (x, {"edits": Edits(lm_pos_ids=jnp.zeros((2, S)))}, "edits.lm_pos_ids"),
        (x, {"edits": Edits(image_order=jnp.zeros(L, jnp.int32))}, "image_order"),
        (x, {"edits": Edits(term_keep={"vit": jnp.ones((2, 9))})}, "edits.term_keep\\['vit'\\]"),
    ]
    for args, kw, name in bad:
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            toy_vlm.forward(p, *args, **kw)
    with pytest.raises(ValueError, match="term_keep"):
        run(params(vit_pos="rope2d"), x, edits=Edits(term_keep={"vit": jnp.ones((2, 16))}))
    stacked = jax.tree_util.tree_map(lambda a: a[None], p)
    with pytest.raises(ValueError, match="stacked"):
        run(stacked, x)
    no_block = {**p, "lm": {k: v for k, v in p["lm"].items() if k != "W_U"}}
    with pytest.raises(ValueError, match=r"params\['lm'\].*W_U"):
        run(no_block, x)
    with pytest.raises(ValueError, match="d_head"):
        toy_vlm.init_params(config(vit_pos="rope2d", d_head=6), jax.random.PRNGKey(0))


def test_jitted_value_and_grad_trains():
    p = params(layernorm=True, mlp=True, lm_pos_ids="mrope", vit_window=2, vit_global_blocks="1")
    x = inputs()
    answer = jnp.asarray([2, 3, 2], jnp.int32)  # "left" / "right" word ids

    def loss(q):
        logp = jax.nn.log_softmax(run(q, x), axis=-1)
        return -jnp.take_along_axis(logp, answer[:, None], axis=1).mean()

    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(p)
    assert np.isfinite(float(value))
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert all(np.all(np.isfinite(np.asarray(g))) for _, g in flat)
    static = [g for path, g in flat if "static" in jax.tree_util.keystr(path)]
    assert static and all(np.all(np.asarray(g) == 0) for g in static)
    trained = [g for path, g in flat if "static" not in jax.tree_util.keystr(path)]
    assert all(np.abs(np.asarray(g)).max() > 0 for g in trained)
    for _ in range(3):  # a few SGD steps on this batch lower its loss
        _, grads = step(p)
        # in NumPy: eager jax ops would compile one small program per leaf shape
        p = jax.tree_util.tree_map(lambda a, g: np.asarray(a) - 0.05 * np.asarray(g), p, grads)
    assert float(step(p)[0]) < float(value)


def test_fractional_learned_positions_clamp_at_the_edges_and_refuse_beyond():
    """Column -0.5 reads the first column's code (it was read as +0.5's), 0.5 the mean of
    the first two, W - 0.5 the last; an edit more than half a cell outside is refused."""
    from jaxmech.families.toy_vlm.vit import position_parts

    p = params()
    col_P = np.asarray(p["vit"]["col_P"])
    cols = jnp.asarray([-0.5, 0.0, 0.5, GW - 1.0, GW - 0.5], jnp.float32)
    _, col = position_parts(p, jnp.zeros_like(cols), cols)
    want = [col_P[0], col_P[0], (col_P[0] + col_P[1]) / 2, col_P[-1], col_P[-1]]
    close(col, np.stack(want), 1e-6)
    for bad in (-0.6, GW - 0.4):
        with pytest.raises(ValueError, match=r"edits\.vit_cols: positions in"):
            run(p, inputs(), edits=Edits(vit_cols=jnp.full((L,), bad, jnp.float32)))


def test_the_planted_route_hides_the_image_from_all_but_the_object_words():
    """With `planted_route`, in every LM block a question token other than a label word
    puts exactly zero attention on the image tokens, the label words do attend to them;
    the default config has no route."""
    assert "lm_route" not in params()["static"]
    p = params(planted_route=True)
    x = inputs()
    _, aux = run(p, x, capture=True)
    labels = np.asarray(x[3]) > len(SCENE_WORDS) - 1  # [B, Q] the question's label words
    for i in range(2):
        to_image = np.asarray(aux[f"lm/pattern.{i}"])[:, :, L:, :L].sum(-1)  # [B, H, Q]
        assert (to_image.transpose(0, 2, 1)[~labels] == 0.0).all()
        assert (to_image.transpose(0, 2, 1)[labels] > 0.0).all()
