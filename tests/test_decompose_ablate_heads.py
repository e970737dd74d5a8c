"""Analysis: decomposition invariants, ablations through the one forward, head statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.analysis.ablate import ablation_edits, ablation_table, parse_ablation
from jaxmech.analysis.decompose import decompose as _decompose
from jaxmech.analysis.decompose import part_terms, row_variance_shares
from jaxmech.analysis.heads import cls_row_profiles, gradient_stats, head_roles
from jaxmech.config import Config
from jaxmech.families.dual_encoder.checks import with_static
from jaxmech.families.dual_encoder.evaluate import evaluate
from jaxmech.families.dual_encoder.model import forward, init_params
from jaxmech.models.edits import TERMS, Edits, term_mask
from jaxmech.train import build_data, stack_settings

_init = jax.jit(init_params, static_argnums=0)
# jitted: op-by-op dispatch of the many small term contractions is slow on CPU. tower
# and layer choose params and a block: static; the causal mask comes with the params.
decompose = jax.jit(_decompose, static_argnames=("tower", "layer"))

# a small task shared by every shape, and four model shapes on it
_TASK = dict(
    d_embed=16, image_len=8, n_labels=8, n_val_labels=3, n_pair_labels=5, layouts_per_pair=5
)
SHAPES = {
    "small": dict(_TASK, d_model=32, d_head=8, n_heads=4),
    "wide": dict(
        _TASK, d_model=48, d_head=6, n_heads=6, image_len=12, n_labels=10, n_pair_labels=7
    ),
    "ln_2layer": dict(
        _TASK, d_model=32, d_head=8, n_heads=2, layernorm=True, mlp=True, d_mlp=64, n_layers=2
    ),
    "cls_position": dict(_TASK, d_model=32, d_head=8, n_heads=4, cls_position=True),
}


def _noisy_params(config, seed=0, scale=0.3):
    """Init params plus noise: every bias and the CLS position row non-zero (the
    switches of `params["static"]` stay as the config sets them)."""
    params = _init(config, jax.random.key(seed))
    trained = {k: v for k, v in params.items() if k != "static"}
    leaves, tree = jax.tree_util.tree_flatten(trained)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    noisy = jax.tree_util.tree_unflatten(
        tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )
    return {**noisy, "static": params["static"]}


def _inputs(config):
    data = build_data(config)
    return jnp.asarray(data.evals.unseen_images[:6]), jnp.asarray(
        data.tables.captions[[0, 5, -1, -3]]
    )


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tower", ["vision", "text"])
def test_terms_sum_to_the_logits(shape, tower):
    config = Config().replace(**SHAPES[shape])
    params = _noisy_params(config)
    images, captions = _inputs(config)
    x = images if tower == "vision" else captions
    for layer in range(config.model.n_layers):
        t = decompose(params, x, tower=tower, layer=layer)
        total = sum(t[k] for k in part_terms(t))
        scale = float(jnp.abs(t["logits"]).max())
        np.testing.assert_allclose(total, t["logits"], atol=2e-5 * max(scale, 1.0))
        np.testing.assert_allclose(
            t["XX"] + t["XB"] + t["BX"] + t["BB"], t["logits"], atol=2e-5 * max(scale, 1.0)
        )
        assert ("RR" in t) == (layer > 0)
        # the terms are not trivially zero: the biases and positions matter
        assert float(jnp.abs(t["BP"]).max()) > 1e-3 and float(jnp.abs(t["EP"]).max()) > 1e-3
    if tower == "text":
        vis = t["visible"][0, 0]
        assert bool(vis[0, 0]) and not bool(vis[0, 1]) and bool(vis[-1, 0])


def test_row_constant_terms_and_shares():
    config = Config().replace(**SHAPES["small"])
    t = decompose(_noisy_params(config), _inputs(config)[0])
    for name in ("EB", "PB", "BB"):  # constant along each row
        np.testing.assert_allclose(t[name] - t[name][..., :1], 0.0, atol=1e-5)
    shares = row_variance_shares(t, part_terms(t))
    np.testing.assert_allclose(sum(shares.values()), 1.0, atol=1e-4)
    for name in ("EB", "PB", "BB"):
        np.testing.assert_allclose(shares[name], 0.0, atol=1e-5)


def test_decompose_vmaps_over_stacked_seeds_and_over_heads():
    config = Config().replace(**SHAPES["small"])
    images = _inputs(config)[0]
    stacked = jax.tree_util.tree_map(
        lambda *x: jnp.stack(x), *[_noisy_params(config, s) for s in range(3)]
    )
    vm = jax.jit(jax.vmap(lambda p: decompose(p, images)["EP"]))(stacked)
    for s in range(3):
        one = decompose(jax.tree_util.tree_map(lambda x: x[s], stacked), images)["EP"]
        np.testing.assert_allclose(vm[s], one, rtol=1e-5, atol=1e-6)

    params = _noisy_params(config)
    heads_keys = ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O")

    def one_head(h):
        block = dict(params["vision"]["block_0"])
        for k in heads_keys:
            block[k] = jax.lax.dynamic_slice_in_dim(block[k], h, 1, axis=0)
        p = {**params, "vision": {**params["vision"], "block_0": block}}
        return decompose(p, images)["EP"][:, 0]

    # the text tower too: its causal mask is a traced flag of each model's params
    captions = _inputs(config)[1]
    vis = jax.jit(jax.vmap(lambda p: decompose(p, captions, tower="text")["visible"]))(stacked)
    assert vis.shape == (3, captions.shape[0], 1, 9, 9)
    lower = np.tril(np.ones((9, 9), bool))
    np.testing.assert_array_equal(vis[:, :, 0], np.broadcast_to(lower, vis[:, :, 0].shape))
    bidir = with_static(stacked, causal_text=0.0)
    vis0 = jax.jit(jax.vmap(lambda p: decompose(p, captions, tower="text")["visible"]))(bidir)
    assert bool(vis0.all())

    per_head = jax.vmap(one_head)(jnp.arange(config.model.n_heads))  # [H, B, S, S]
    np.testing.assert_allclose(
        jnp.moveaxis(per_head, 0, 1), decompose(params, images)["EP"], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("term", TERMS)
def test_removing_a_term_changes_exactly_that_term(term):
    config = Config().replace(**SHAPES["small"])
    params = _noisy_params(config)
    images, captions = _inputs(config)
    t = decompose(params, images)
    _, aux = forward(
        params,
        images,
        captions,
        edits=Edits(term_keep={"vision": term_mask(4, [term], heads=[1, 3])}),
    )
    diff = t["logits"] - aux["vision/attn_scores.0"]
    np.testing.assert_allclose(diff[:, [1, 3]], t[term][:, [1, 3]], atol=3e-5)
    np.testing.assert_allclose(diff[:, [0, 2]], 0.0, atol=0)


def test_qp_is_independent_of_how_cls_splits_between_E_and_P():
    """With cls_position, E_CLS and P_0 are identified only as a sum (SPEC): moving
    mass between them leaves the model unchanged, changes EP and PP, and not QP."""
    config = Config().replace(**SHAPES["cls_position"])
    params = _noisy_params(config)
    images, captions = _inputs(config)
    delta = jax.random.normal(jax.random.key(7), (config.model.d_model,))
    v = params["vision"]
    moved = {
        **params,
        "vision": {**v, "E": v["E"].at[-1].add(delta), "P": v["P"].at[0].add(-delta)},
    }
    s0, _ = forward(params, images, captions)
    s1, _ = forward(moved, images, captions)
    np.testing.assert_allclose(s0, s1, rtol=1e-4, atol=1e-5)
    t0, t1 = decompose(params, images), decompose(moved, images)
    cls0, cls1 = t0["EP"][:, :, 0], t1["EP"][:, :, 0]
    assert float(jnp.abs(cls0 - cls1).max()) > 1e-2
    # CLS query against the pixel keys' positions (key 0 is CLS itself, whose P row moved)
    np.testing.assert_allclose(t0["QP"][:, :, 0, 1:], t1["QP"][:, :, 0, 1:], atol=1e-4)


def test_ablation_table_none_equals_plain_evaluation_and_edits_stack():
    """The table's "none" row (its edits a no-op) equals the plain evaluation's metrics
    exactly, for the second model (the stack's index read right; vmapped == looped is
    `test_vmapped_equals_each_model_alone`); the plain evaluation jitted (eagerly, op by
    op, it took ~13 s)."""
    config = Config().replace(**SHAPES["small"])
    data = build_data(config)
    settings = stack_settings([config.replace(seed=s).settings() for s in range(2)])
    stacked = jax.tree_util.tree_map(
        lambda *x: jnp.stack(x), *[_noisy_params(config, s) for s in range(2)]
    )
    names = ("none", "ep", "ep+bp", "vp", "ep+pp+bp+vp")
    table = ablation_table(stacked, settings, data, names)
    p = jax.tree_util.tree_map(lambda x: x[1], stacked)
    s = jax.tree_util.tree_map(lambda x: x[1], settings)
    plain = jax.jit(lambda p, s: evaluate(p, data.evals, data.tables.captions, s))(p, s)
    for m, v in plain.items():
        assert float(table[m][1, 0]) == float(v)
    e = ablation_edits(names, 4)
    assert e.term_keep["vision"].shape == (5, 4, 9) and e.vp_keep["vision"].shape == (5, 4)
    assert (
        float(e.term_keep["vision"][0].min()) == 1.0 and float(e.vp_keep["vision"][3].max()) == 0.0
    )
    assert parse_ablation("ep+bp+vp") == (("EP", "BP"), True)
    with pytest.raises(ValueError, match="unknown term 'xy'"):
        parse_ablation("ep+xy")


def test_gradient_stats_and_profiles():
    prof = jnp.asarray([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.0, 5.0, -1.0, 2.0]])
    st = gradient_stats(prof)
    np.testing.assert_allclose(st["slope"], [1.0, -1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(st["spearman"][:2], [1.0, -1.0], atol=1e-6)
    assert abs(float(st["spearman"][2])) < 1.0
    config = Config().replace(**SHAPES["small"])
    params = _noisy_params(config)
    prof = cls_row_profiles(params, config.task.image_len)
    # the CLS row does not depend on the image: same EP on a blank and a full image
    t = decompose(params, _inputs(config)[0])
    np.testing.assert_allclose(prof["EP"], t["EP"][0, :, 0, 1:], rtol=1e-5, atol=1e-6)
    roles = head_roles(params, config.task.n_labels, config.task.image_len)
    assert roles["delta_label"].shape == (4,) and bool(jnp.all(roles["delta_label"] > 0))
