"""The dual encoder: parameters, the fast paths, the term decomposition, edits."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.config import Config
from jaxmech.data.vocab import Vocab
from jaxmech.models.attention import block_forward
from jaxmech.models.dual_encoder import (
    encode_images,
    encode_texts,
    forward,
    init_params,
    vision_inputs,
)
from jaxmech.models.edits import NO_EDITS, TERMS, Edits, term_mask

# Small model: most tests compare two computations of the same thing, so size does not
# matter, but compile and run time do (XLA compiles every new shape).
SMALL = Config().replace(d_model=32, d_head=8, n_heads=4, d_embed=16, d_mlp=64)
H, D, DH = 4, 32, 8
V = Vocab(20)
ATOL = 1e-5

_NOISE_SIZE = 1 << 17


@functools.lru_cache(maxsize=None)
def _shapes(cfg):
    """The params structure `init_params` builds for `cfg`, without running it."""
    return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.PRNGKey(0))


@functools.lru_cache(maxsize=None)
def _noise(seed):
    # One fixed-size draw per seed (one compile), sliced into the leaves below.
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (_NOISE_SIZE,)))


def random_params(cfg=SMALL, seed=0):
    """Params with `init_params`' names and shapes and random, non-zero values everywhere
    (biases, LayerNorm offsets and the logit scale included), at scales that keep the
    attention patterns far from uniform."""
    noise = _noise(seed)
    offset = 0

    def leaf(path, s):
        nonlocal offset
        name = path[-1].key
        size = math.prod(s.shape)
        z = noise[offset : offset + size].reshape(s.shape)
        offset += size
        assert offset <= _NOISE_SIZE
        if name in ("E", "P"):
            std = 0.7
        elif name.startswith("W_"):
            std = 1.0 / math.sqrt(s.shape[-2])
        elif name.startswith("ln") and name.endswith("_w"):
            return jnp.asarray(1.0 + 0.2 * z, jnp.float32)
        elif name == "logit_scale":
            return jnp.asarray(2.0 + 0.1 * z, jnp.float32)
        else:  # biases
            std = 0.3
        return jnp.asarray(std * z, jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf, _shapes(cfg))


def _images():
    img = np.zeros((5, 10), np.int32)
    img[0, [1, 6]] = [3, 17]
    img[1, [6, 1]] = [3, 17]
    img[2, 4] = 20
    img[3, [0, 9]] = [5, 2]
    img[4, [2, 3]] = [11, 12]
    return jnp.asarray(img)


def _captions():
    return jnp.asarray(
        [
            V.encode([3, "is", "on", "the", "left", "of", 17]),
            V.encode([17, "is", "on", "the", "left", "of", 3]),
            V.encode([20, "is", "on", "the", "right"]),
            V.encode([5]),
        ],
        jnp.int32,
    )


IMAGES, CAPTIONS = _images(), _captions()


def _tree_allclose(a, b, atol=ATOL):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


# ---------------------------------------------------------------------------
# parameters


def _shape_tree(cfg):
    return jax.tree_util.tree_map(lambda s: tuple(s.shape), _shapes(cfg))


BLOCK_SHAPES = {
    "W_Q": (4, 128, 32),
    "W_K": (4, 128, 32),
    "W_V": (4, 128, 32),
    "b_Q": (4, 32),
    "b_K": (4, 32),
    "b_V": (4, 32),
    "W_O": (4, 32, 128),
    "b_O": (128,),
}


def test_default_param_names_and_shapes():
    p = _shape_tree(Config())
    assert set(p) == {"vision", "text", "logit_scale"}
    assert p["logit_scale"] == ()
    assert p["vision"] == {
        "E": (22, 128),
        "P": (10, 128),
        "block_0": BLOCK_SHAPES,
        "W_proj": (128, 128),
    }
    assert p["text"] == {
        "E": (29, 128),
        "P": (9, 128),
        "block_0": BLOCK_SHAPES,
        "W_proj": (128, 128),
    }


def test_param_shapes_follow_the_config():
    p = _shape_tree(Config().replace(cls_position=True))
    assert p["vision"]["P"] == (11, 128) and p["text"]["P"] == (9, 128)

    p = _shape_tree(Config().replace(layernorm=True, mlp=True, d_mlp=256, d_embed=64))
    for tower in ("vision", "text"):
        t = p[tower]
        assert t["lnf_w"] == t["lnf_b"] == (128,)
        assert t["W_proj"] == (128, 64)
        b = t["block_0"]
        for k in ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "b_out"):
            assert b[k] == (128,)
        assert b["W_in"] == (128, 256) and b["b_in"] == (256,) and b["W_out"] == (256, 128)

    p = _shape_tree(Config().replace(mlp=True))
    assert "W_in" in p["vision"]["block_0"] and "ln1_w" not in p["vision"]["block_0"]
    assert "lnf_w" not in p["vision"]

    p = _shape_tree(Config().replace(n_layers=2))
    for tower in ("vision", "text"):
        blocks = sorted(k for k in p[tower] if k.startswith("block_"))
        assert blocks == ["block_0", "block_1"]
        assert p[tower]["block_1"] == BLOCK_SHAPES

    p = _shape_tree(Config().replace(n_layers=2, text_n_layers=1))
    assert "block_1" in p["vision"] and "block_1" not in p["text"]

    p = _shape_tree(Config().replace(n_labels=10, n_val_labels=3, n_pair_labels=7, image_len=6))
    assert p["vision"]["E"] == (12, 128) and p["vision"]["P"] == (6, 128)
    assert p["text"]["E"] == (19, 128)


def test_init_scales():
    cfg = Config().replace(init_E=0.1, init_P=0.01)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))

    def close(x, std, rel=0.15):
        assert abs(float(jnp.std(x)) - std) < rel * std, (float(jnp.std(x)), std)
        assert abs(float(jnp.mean(x))) < 0.2 * std

    for tower in ("vision", "text"):
        t = params[tower]
        close(t["E"], 0.1)
        close(t["P"], 0.01)
        close(t["W_proj"], 128**-0.5)
        b = t["block_0"]
        for w in ("W_Q", "W_K", "W_V"):
            close(b[w], 128**-0.5)
        close(b["W_O"], (4 * 32) ** -0.5)
        for bias in ("b_Q", "b_K", "b_V", "b_O"):
            assert not np.asarray(b[bias]).any()
        # heads are initialised independently
        assert not np.allclose(b["W_Q"][0], b["W_Q"][1])
        assert not np.allclose(b["W_Q"], b["W_K"])
    assert not np.allclose(params["vision"]["E"][:22], params["text"]["E"][:22])
    np.testing.assert_allclose(float(params["logit_scale"]), math.log(1 / 0.07), rtol=1e-6)


# ---------------------------------------------------------------------------
# the text tower is causal


def test_text_encoder_is_causal():
    cfg = SMALL.replace(n_layers=2)
    params = random_params(cfg)
    a = CAPTIONS[:1]
    b = a.at[0, 7].set(12)  # change Y, the token before EOT
    _, aux_a = encode_texts(params, a)
    _, aux_b = encode_texts(params, b)
    for layer in (0, 1):
        ra, rb = aux_a[f"text/resid_post.{layer}"], aux_b[f"text/resid_post.{layer}"]
        np.testing.assert_allclose(ra[:, :7], rb[:, :7], atol=1e-6, rtol=0)
        assert np.abs(ra[:, 7:] - rb[:, 7:]).max(axis=-1).min() > 1e-2
    # without the causal mask, the change reaches earlier positions too
    _, aux_a = encode_texts(params, a, causal=False)
    _, aux_b = encode_texts(params, b, causal=False)
    assert np.abs(aux_a["text/resid_post.0"][:, 0] - aux_b["text/resid_post.0"][:, 0]).max() > 1e-2


def test_text_encoder_causal_gradients():
    cfg = SMALL.replace(n_layers=2)
    params = random_params(cfg)
    T = CAPTIONS.shape[1]

    def out_at(delta, i):
        edits = Edits(add={"text/resid_pre.0": delta})
        _, aux = encode_texts(params, CAPTIONS, edits=edits)
        return aux["text/resid_post.1"][:, i].sum()

    delta = jnp.zeros((CAPTIONS.shape[0], T, D))
    for i in (2, 5):
        g = np.abs(np.asarray(jax.grad(out_at)(delta, i))).max(axis=(0, 2))
        assert (g[i + 1 :] == 0).all()
        assert (g[: i + 1] > 0).all()


# ---------------------------------------------------------------------------
# fast paths are exact


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("ln_mlp", [False, True], ids=["plain", "ln_mlp"])
def test_readout_only_is_exact(n_layers, ln_mlp):
    cfg = SMALL.replace(n_layers=n_layers, layernorm=ln_mlp, mlp=ln_mlp)
    params = random_params(cfg, seed=n_layers)
    sims_f, aux_f = forward(params, IMAGES, CAPTIONS)
    sims_r, aux_r = forward(params, IMAGES, CAPTIONS, readout_only=True)
    for k in ("vision/embed", "text/embed", "vision/readout", "text/readout"):
        np.testing.assert_allclose(aux_f[k], aux_r[k], atol=ATOL, rtol=0)
    np.testing.assert_allclose(sims_f, sims_r, atol=ATOL, rtol=0)
    # the readout-only path really computes one query row in its last layer
    last = n_layers - 1
    assert aux_r[f"vision/pattern.{last}"].shape[2] == 1
    assert aux_f[f"vision/pattern.{last}"].shape[2] == 11
    # and the full path reads the readout at the EOT position
    eot = np.argmax(np.asarray(CAPTIONS) == V.eot, axis=1)
    resid = aux_f[f"text/resid_post.{last}"]
    np.testing.assert_array_equal(aux_f["text/readout"], resid[np.arange(len(eot)), eot])
    np.testing.assert_array_equal(aux_f["vision/readout"], aux_f[f"vision/resid_post.{last}"][:, 0])


@pytest.mark.parametrize(
    "causal,readout_rows,batched_p",
    [(False, False, False), (True, False, False), (False, True, False), (True, True, True)],
)
def test_factored_first_layer_equals_dense(causal, readout_rows, batched_p):
    params = random_params(SMALL)
    tower = params["vision"]
    block = tower["block_0"]
    key = jax.random.PRNGKey(3)
    B, S = 3, 11
    tokens = jax.random.randint(key, (B, S), 0, tower["E"].shape[0])
    p_rows = tower["E"][:S] * 0.5 + 0.1  # any [S, D] rows
    if batched_p:
        p_rows = jnp.stack([p_rows, -p_rows, 2 * p_rows])
    x = tower["E"][tokens] + jnp.broadcast_to(p_rows, (B, S, D))
    q_rows = jnp.asarray([[0], [4], [10]]) if readout_rows else None
    kw = dict(causal=causal, q_rows_BxQ=q_rows, edits=NO_EDITS, prefix="v/", suffix=".0")
    out_d, aux_d = block_forward(block, x, factored=None, **kw)
    out_f, aux_f = block_forward(block, x, factored=(tokens, tower["E"], p_rows), **kw)
    np.testing.assert_allclose(out_d, out_f, atol=ATOL, rtol=0)
    assert set(aux_d) == set(aux_f)
    for name in ("q", "k", "v", "attn_scores", "pattern", "z", "attn_out", "resid_post"):
        np.testing.assert_allclose(aux_d[f"v/{name}.0"], aux_f[f"v/{name}.0"], atol=ATOL, rtol=0)
    # the dense path is what the docstring says: softmax(q k^T / sqrt(Dh)) per head
    q = jnp.einsum("bsd,hde->bshe", x, block["W_Q"]) + block["b_Q"]
    k = jnp.einsum("bsd,hde->bshe", x, block["W_K"]) + block["b_K"]
    scores = jnp.einsum("bqhe,bshe->bhqs", q, k) / math.sqrt(DH)
    if readout_rows:
        scores = jnp.take_along_axis(scores, q_rows[:, None, :, None], axis=2)
    np.testing.assert_allclose(aux_d["v/attn_scores.0"], scores, atol=ATOL, rtol=0)
    q_rows_full = q_rows if readout_rows else jnp.broadcast_to(jnp.arange(S), (B, S))
    if causal:
        visible = jnp.arange(S)[None, None, None, :] <= q_rows_full[:, None, :, None]
        assert (np.asarray(aux_d["v/pattern.0"])[~np.asarray(jnp.broadcast_to(visible, scores.shape))] == 0).all()
    np.testing.assert_allclose(aux_d["v/pattern.0"].sum(-1), 1.0, atol=ATOL)


def test_factored_path_refuses_layernorm():
    params = random_params(SMALL.replace(layernorm=True))
    tower = params["vision"]
    tokens = jnp.zeros((1, 11), jnp.int32)
    x = tower["E"][tokens]
    with pytest.raises(ValueError):
        block_forward(
            tower["block_0"],
            x,
            causal=False,
            edits=NO_EDITS,
            prefix="v/",
            factored=(tokens, tower["E"], jnp.zeros((11, D))),
        )


# ---------------------------------------------------------------------------
# attention-logit terms


def _vision_terms(params, images):
    """The nine first-layer logit terms [9, B, H, S, S] of SPEC.md, from the params."""
    tower = params["vision"]
    block = tower["block_0"]
    tokens, p_rows = vision_inputs(tower, images)
    E = tower["E"][tokens]
    P = jnp.broadcast_to(p_rows, E.shape)
    qs = {
        "E": jnp.einsum("bsd,hde->bhse", E, block["W_Q"]),
        "P": jnp.einsum("bsd,hde->bhse", P, block["W_Q"]),
        "B": jnp.broadcast_to(block["b_Q"][None, :, None], (E.shape[0], H, E.shape[1], DH)),
    }
    ks = {
        "E": jnp.einsum("bsd,hde->bhse", E, block["W_K"]),
        "P": jnp.einsum("bsd,hde->bhse", P, block["W_K"]),
        "B": jnp.broadcast_to(block["b_K"][None, :, None], (E.shape[0], H, E.shape[1], DH)),
    }
    return {
        t: jnp.einsum("bhqe,bhse->bhqs", qs[t[0]], ks[t[1]]) / math.sqrt(DH) for t in TERMS
    }


def test_terms_sum_to_the_logits():
    params = random_params(SMALL)
    terms = _vision_terms(params, IMAGES)
    _, aux = encode_images(params, IMAGES)
    np.testing.assert_allclose(
        aux["vision/attn_scores.0"], sum(terms.values()), atol=ATOL, rtol=0
    )
    # every term matters at these params
    for t in TERMS:
        assert float(jnp.abs(terms[t]).max()) > 1e-2, t
    # default: the CLS token has no position row, so the P-terms vanish on its row / column
    np.testing.assert_array_equal(terms["PE"][:, :, 0], 0)
    np.testing.assert_array_equal(terms["EP"][:, :, :, 0], 0)


@pytest.mark.parametrize("ln_mlp", [False, True], ids=["plain", "ln_mlp"])
def test_all_ones_mask_is_exactly_the_plain_forward(ln_mlp):
    params = random_params(SMALL.replace(layernorm=ln_mlp, mlp=ln_mlp))
    edits = Edits(
        term_keep={"vision": term_mask(H), "text": term_mask(H)},
        vp_keep={"vision": jnp.ones(H), "text": jnp.ones(H)},
    )
    sims, aux = forward(params, IMAGES, CAPTIONS)
    sims_e, aux_e = forward(params, IMAGES, CAPTIONS, edits=edits)
    assert (np.asarray(sims) == np.asarray(sims_e)).all()
    for k in ("vision/attn_scores.0", "text/attn_scores.0", "vision/v.0"):
        assert (np.asarray(aux[k]) == np.asarray(aux_e[k])).all()
    # removing every term leaves nothing: the terms sum to the logits (LayerNorm too)
    _, aux_0 = forward(
        params, IMAGES, CAPTIONS, edits=Edits(term_keep={"vision": term_mask(H, TERMS)})
    )
    np.testing.assert_allclose(aux_0["vision/attn_scores.0"], 0.0, atol=ATOL)
    np.testing.assert_allclose(aux_0["vision/pattern.0"], 1 / 11, atol=1e-6)
    assert float(jnp.abs(aux["vision/attn_scores.0"]).max()) > 0.1


@pytest.mark.parametrize("term", ["EP", "PE", "BP", "EE"])
def test_removing_a_term_subtracts_exactly_that_term(term):
    params = random_params(SMALL)
    expected = _vision_terms(params, IMAGES)[term]
    edits = Edits(term_keep={"vision": term_mask(H, [term])})
    _, aux = encode_images(params, IMAGES)
    _, aux_a = encode_images(params, IMAGES, edits=edits)
    diff = aux["vision/attn_scores.0"] - aux_a["vision/attn_scores.0"]
    np.testing.assert_allclose(diff, expected, atol=ATOL, rtol=0)
    assert float(jnp.abs(expected).max()) > 1e-2
    assert not np.allclose(aux["vision/embed"], aux_a["vision/embed"], atol=1e-4)


def test_removing_a_term_in_chosen_heads_only():
    params = random_params(SMALL)
    ep = _vision_terms(params, IMAGES)["EP"]
    edits = Edits(term_keep={"vision": term_mask(H, ["EP"], heads=[1, 3])})
    _, aux = encode_images(params, IMAGES)
    _, aux_a = encode_images(params, IMAGES, edits=edits)
    diff = aux["vision/attn_scores.0"] - aux_a["vision/attn_scores.0"]
    np.testing.assert_allclose(diff[:, [1, 3]], ep[:, [1, 3]], atol=ATOL, rtol=0)
    np.testing.assert_allclose(diff[:, [0, 2]], 0.0, atol=1e-6)


def test_term_mask():
    m = np.asarray(term_mask(3, ["EP", "BB"], heads=[2]))
    assert m.shape == (3, 9)
    expected = np.ones((3, 9))
    expected[2, TERMS.index("EP")] = expected[2, TERMS.index("BB")] = 0
    np.testing.assert_array_equal(m, expected)
    assert (np.asarray(term_mask(2)) == 1).all()
    with pytest.raises(ValueError, match="XY"):
        term_mask(2, ["XY"])


def test_removing_bb_shifts_each_row_and_keeps_the_pattern():
    params = random_params(SMALL)
    block = params["vision"]["block_0"]
    edits = Edits(term_keep={"vision": term_mask(H, ["BB"])})
    _, aux = encode_images(params, IMAGES)
    _, aux_a = encode_images(params, IMAGES, edits=edits)
    diff = aux["vision/attn_scores.0"] - aux_a["vision/attn_scores.0"]
    bb = jnp.einsum("he,he->h", block["b_Q"], block["b_K"]) / math.sqrt(DH)
    assert float(jnp.abs(bb).min()) > 1e-3
    np.testing.assert_allclose(diff, jnp.broadcast_to(bb[None, :, None, None], diff.shape), atol=ATOL)
    np.testing.assert_allclose(aux["vision/pattern.0"], aux_a["vision/pattern.0"], atol=1e-6)
    np.testing.assert_allclose(aux["vision/embed"], aux_a["vision/embed"], atol=ATOL)


def test_vp_ablation_removes_position_values():
    params = random_params(SMALL)
    tower = params["vision"]
    _, p_rows = vision_inputs(tower, IMAGES)
    keep = jnp.asarray([1.0, 0.0, 1.0, 0.5])
    _, aux = encode_images(params, IMAGES)
    _, aux_a = encode_images(params, IMAGES, edits=Edits(vp_keep={"vision": keep}))
    pv = jnp.einsum("sd,hde->she", p_rows, tower["block_0"]["W_V"])  # [S, H, Dh]
    expected = (1 - keep)[None, None, :, None] * pv[None]
    diff = aux["vision/v.0"] - aux_a["vision/v.0"]
    np.testing.assert_allclose(diff, jnp.broadcast_to(expected, diff.shape), atol=ATOL, rtol=0)
    # the logits do not change, only the values
    np.testing.assert_array_equal(aux["vision/attn_scores.0"], aux_a["vision/attn_scores.0"])


# ---------------------------------------------------------------------------
# position inputs


def test_positions_input():
    params = random_params(SMALL)
    emb, _ = encode_images(params, IMAGES)
    emb_ar, _ = encode_images(params, IMAGES, positions=jnp.arange(10))
    np.testing.assert_array_equal(emb, emb_ar)
    emb_f, _ = encode_images(params, IMAGES, positions=jnp.arange(10, dtype=jnp.float32))
    np.testing.assert_allclose(emb, emb_f, atol=1e-6, rtol=0)
    # the vision tower is permutation-equivariant except for the positions and reads CLS:
    # a mirrored image with mirrored position codes is the same set of (token, position)
    mirrored = IMAGES[:, ::-1]
    mirror_pos = 9 - jnp.arange(10)
    emb_m, _ = encode_images(params, mirrored, positions=mirror_pos)
    np.testing.assert_allclose(emb, emb_m, atol=ATOL, rtol=0)
    # while the mirrored image at natural positions is a different input
    emb_mn, _ = encode_images(params, mirrored)
    assert np.abs(np.asarray(emb_mn - emb)).max() > 1e-3
    # batched positions: one per image
    pos_b = jnp.stack([jnp.arange(10), mirror_pos, jnp.arange(10), mirror_pos, mirror_pos])
    emb_b, _ = encode_images(params, IMAGES, positions=pos_b)
    for i in range(5):
        emb_i, _ = encode_images(params, IMAGES[i : i + 1], positions=pos_b[i])
        np.testing.assert_allclose(emb_b[i], emb_i[0], atol=ATOL, rtol=0)


def test_position_rows():
    params = random_params(SMALL)
    tower = params["vision"]
    P = tower["P"]
    tokens, rows = vision_inputs(tower, IMAGES)
    assert (np.asarray(tokens[:, 0]) == V.cls).all()
    np.testing.assert_array_equal(tokens[:, 1:], IMAGES)
    np.testing.assert_array_equal(rows[0], 0)  # CLS carries no position by default
    np.testing.assert_array_equal(rows[1:], P)
    _, rows_h = vision_inputs(tower, IMAGES, positions=jnp.arange(10) + 0.5)
    np.testing.assert_allclose(rows_h[1:-1], (P[:-1] + P[1:]) / 2, atol=1e-6)
    # with cls_position the CLS row is P[0] and pixel i gets P[i + 1]
    tower_c = random_params(SMALL.replace(cls_position=True))["vision"]
    _, rows_c = vision_inputs(tower_c, IMAGES)
    np.testing.assert_array_equal(rows_c, tower_c["P"])
    with pytest.raises(ValueError):
        vision_inputs(tower, IMAGES[:, :8])


# ---------------------------------------------------------------------------
# named edits


def test_add_and_replace_edits_on_the_readout():
    params = random_params(SMALL)
    tower = params["vision"]
    emb, aux = encode_images(params, IMAGES)
    zero = Edits(add={"vision/readout": jnp.zeros(D)})
    emb_0, _ = encode_images(params, IMAGES, edits=zero)
    np.testing.assert_array_equal(emb, emb_0)

    vec = jnp.linspace(-1.0, 1.0, D)
    emb_a, aux_a = encode_images(params, IMAGES, edits=Edits(add={"vision/readout": vec}))
    proj = (aux["vision/readout"] + vec) @ tower["W_proj"]
    expected = proj / jnp.linalg.norm(proj, axis=-1, keepdims=True)
    np.testing.assert_allclose(emb_a, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(aux_a["vision/readout"], aux["vision/readout"] + vec, atol=1e-6)
    assert np.abs(np.asarray(emb_a - emb)).max() > 1e-2

    where = jnp.asarray([True, False, True, False, False])[:, None]
    edits = Edits(replace={"vision/readout": (where, vec)})
    emb_r, _ = encode_images(params, IMAGES, edits=edits)
    target = vec @ tower["W_proj"]
    target = target / jnp.linalg.norm(target)
    np.testing.assert_allclose(emb_r[0], target, atol=ATOL)
    np.testing.assert_allclose(emb_r[2], target, atol=ATOL)
    np.testing.assert_allclose(emb_r[[1, 3, 4]], emb[[1, 3, 4]], atol=1e-6, rtol=0)


def test_patching_an_intermediate_changes_downstream():
    params = random_params(SMALL)
    # patch image 1's layer-0 output into image 0: image 0 then embeds like image 1
    _, aux = encode_images(params, IMAGES)
    patched = aux["vision/resid_post.0"][1]
    where = jnp.asarray([True, False, False, False, False])[:, None, None]
    emb_p, _ = encode_images(
        params, IMAGES, edits=Edits(replace={"vision/resid_post.0": (where, patched)})
    )
    np.testing.assert_allclose(emb_p[0], aux["vision/embed"][1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(emb_p[1:], aux["vision/embed"][1:], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------
# jit and vmap


def test_forward_outputs():
    params = random_params(SMALL)
    sims, aux = forward(params, IMAGES, CAPTIONS)
    assert sims.shape == (5, 4)
    img, txt = aux["vision/embed"], aux["text/embed"]
    np.testing.assert_allclose(jnp.linalg.norm(img, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(txt, axis=-1), 1.0, atol=1e-5)
    scale = math.exp(min(float(params["logit_scale"]), math.log(100.0)))
    np.testing.assert_allclose(sims, scale * img @ txt.T, rtol=1e-5, atol=ATOL)
    # the logit scale is clipped
    big = {**params, "logit_scale": jnp.asarray(10.0)}
    sims_big, aux_big = forward(params=big, images_BxL=IMAGES, captions_CxT=CAPTIONS)
    np.testing.assert_allclose(float(aux_big["logit_scale"]), 100.0, rtol=1e-5)
    np.testing.assert_allclose(sims_big, 100.0 * img @ txt.T, rtol=1e-4, atol=1e-4)


def test_jit_equals_eager():
    params = random_params(SMALL)
    edits = Edits(term_keep={"vision": term_mask(H, ["EP"])})
    sims, _ = forward(params, IMAGES, CAPTIONS, edits=edits)
    sims_j, _ = jax.jit(forward)(params, IMAGES, CAPTIONS, edits=edits)
    np.testing.assert_allclose(sims, sims_j, atol=ATOL, rtol=0)


def test_vmap_over_params_and_edits():
    cfg = SMALL
    seeds = [random_params(cfg, seed=s) for s in (0, 1, 2)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *seeds)
    masks = jnp.stack([term_mask(H), term_mask(H, ["EP"]), term_mask(H, ["PP", "BP"])])

    def run(p, m):
        return forward(p, IMAGES, CAPTIONS, edits=Edits(term_keep={"vision": m}))[0]

    out = jax.jit(jax.vmap(jax.vmap(run, in_axes=(None, 0)), in_axes=(0, None)))(stacked, masks)
    assert out.shape == (3, 3, 5, 4)
    for i, p in enumerate(seeds):
        for j in range(3):
            np.testing.assert_allclose(out[i, j], run(p, masks[j]), atol=ATOL, rtol=0)
    assert not np.allclose(out[0, 0], out[1, 0], atol=1e-3)
    assert not np.allclose(out[0, 0], out[0, 1], atol=1e-3)
