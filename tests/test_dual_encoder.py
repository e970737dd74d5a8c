"""The dual encoder: parameters, the fast paths, the term decomposition, edits.

Runtime note: on CPU every new op shape costs an XLA compile, so these tests share one
small config and one batch of images and captions, and compute their references in
NumPy (float64) rather than with new jnp ops.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.config import Config
from jaxmech.data.tasks.vocab import Vocab
from jaxmech.families.dual_encoder.checks import with_static
from jaxmech.families.dual_encoder.model import (
    encode,
    encode_images,
    encode_texts,
    eot_index,
    forward,
    init_params,
    static_params,
    text_inputs,
    vision_inputs,
)
from jaxmech.models.attention import FirstBlock, block_forward, layer_norm, rows_matmul
from jaxmech.models.edits import NO_EDITS, TERMS, Edits, term_mask

# image_len 8: the vision sequence (CLS + 8 pixels) is as long as a caption, and with as
# many images as captions the two towers share most compiled ops.
SMALL = Config().replace(image_len=8, d_model=32, d_head=8, n_heads=4, d_embed=16, d_mlp=64)
H, D, DH = 4, 32, 8
L, S = 8, 9  # image length, vision sequence length
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
    """Params with `init_params`' names and shapes and random values everywhere (biases,
    LayerNorm offsets and the logit scale included, all non-zero), at scales that keep
    the attention patterns far from uniform; `params["static"]` as `init_params` sets it."""
    noise = _noise(seed)
    offset = 0
    trained = {k: v for k, v in _shapes(cfg).items() if k != "static"}

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

    params = jax.tree_util.tree_map_with_path(leaf, trained)
    return {**params, "static": static_params(cfg)}


def _np(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _f64(x):
    return np.asarray(x, np.float64)


def _images():
    img = np.zeros((4, L), np.int32)
    img[0, [1, 6]] = [3, 17]
    img[1, [6, 1]] = [3, 17]
    img[2, 4] = 20
    img[3, [0, 7]] = [5, 2]
    return img


def _captions():
    return np.asarray(
        [
            V.encode([3, "is", "on", "the", "left", "of", 17]),
            V.encode([17, "is", "on", "the", "left", "of", 3]),
            V.encode([20, "is", "on", "the", "right"]),
            V.encode([5]),
        ],
        np.int32,
    )


IMAGES_NP, CAPTIONS_NP = _images(), _captions()
IMAGES, CAPTIONS = jnp.asarray(IMAGES_NP), jnp.asarray(CAPTIONS_NP)


def run_forward(params, images=IMAGES, captions=CAPTIONS, **kw):
    sims, aux = forward(params, images, captions, **kw)
    return np.asarray(sims), _np(aux)


def run_images(params, images=IMAGES, **kw):
    emb, aux = encode_images(params, images, **kw)
    return np.asarray(emb), _np(aux)


def run_texts(params, captions=CAPTIONS, **kw):
    emb, aux = encode_texts(params, captions, **kw)
    return np.asarray(emb), _np(aux)


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
    assert set(p) == {"vision", "text", "logit_scale", "static"}
    assert p["logit_scale"] == ()
    assert p["static"] == {"causal_text": (), "logit_scale_max": (), "cls_position": ()}
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


INIT_CFG = SMALL.replace(init_E=0.1, init_P=0.01)


def test_init_scales():
    init = jax.jit(init_params, static_argnums=0)
    # An RBG key: init_params takes any key, and it compiles much faster than threefry.
    seeds = [_np(init(INIT_CFG, jax.random.key(s, impl="rbg"))) for s in (0, 1)]
    shapes = jax.tree_util.tree_map(np.shape, seeds[0])
    assert shapes == _shape_tree(INIT_CFG)

    def close(x, std, rel=0.15):
        assert abs(np.std(x) - std) < rel * std, (np.std(x), std)
        assert abs(np.mean(x)) < 0.2 * std

    for params in seeds:
        for tower in ("vision", "text"):
            t = params[tower]
            close(t["E"], 0.1)
            close(t["P"], 0.01)
            close(t["W_proj"], D**-0.5)
            b = t["block_0"]
            for w in ("W_Q", "W_K", "W_V"):
                close(b[w], D**-0.5)
            close(b["W_O"], (H * DH) ** -0.5)
            for bias in ("b_Q", "b_K", "b_V", "b_O"):
                assert not b[bias].any()
            # heads and matrices are initialised independently
            assert not np.allclose(b["W_Q"][0], b["W_Q"][1])
            assert not np.allclose(b["W_Q"], b["W_K"])
        assert not np.allclose(params["vision"]["E"], params["text"]["E"][:22])
        np.testing.assert_allclose(params["logit_scale"], math.log(1 / 0.07), rtol=1e-6)
    assert not np.allclose(seeds[0]["vision"]["E"], seeds[1]["vision"]["E"])


# ---------------------------------------------------------------------------
# the text tower is causal


def test_text_encoder_is_causal():
    cfg = SMALL.replace(n_layers=2)
    params = random_params(cfg)
    a = CAPTIONS_NP
    b = a.copy()
    b[:, 7] = 12  # position 7: Y, the token before EOT, or a PAD after EOT
    assert (a != b).any(axis=1).all()
    emb_a, aux_a = run_texts(params, jnp.asarray(a))
    emb_b, aux_b = run_texts(params, jnp.asarray(b))
    for layer in (0, 1):
        ra, rb = aux_a[f"text/resid_post.{layer}"], aux_b[f"text/resid_post.{layer}"]
        np.testing.assert_allclose(ra[:, :7], rb[:, :7], atol=1e-6, rtol=0)
        assert np.abs(ra[:, 7] - rb[:, 7]).max(axis=-1).min() > 1e-2
    # a change after EOT does not reach the text embedding (read at EOT)
    np.testing.assert_allclose(emb_a[2:], emb_b[2:], atol=1e-6, rtol=0)
    assert np.abs(emb_a[:2] - emb_b[:2]).max() > 1e-3
    # without the causal mask (read from params["static"]), the change reaches earlier
    # positions too, exactly as the tower run with a static (Python bool) no-mask
    bidir = with_static(params, causal_text=0.0)
    _, aux_a = run_texts(bidir, jnp.asarray(a))
    _, aux_b = run_texts(bidir, jnp.asarray(b))
    assert np.abs(aux_a["text/resid_post.0"][:, 0] - aux_b["text/resid_post.0"][:, 0]).max() > 1e-2
    tower, caps = params["text"], jnp.asarray(a)
    tokens, p_rows = text_inputs(tower, caps)
    _, aux_k = encode(tower, tokens, p_rows, eot_index(tower, caps), name="text", causal=False)
    np.testing.assert_array_equal(aux_k["text/resid_post.1"], aux_a["text/resid_post.1"])
    # the flag also works traced: a jitted forward, vmapped over both flags
    flags = jnp.asarray([1.0, 0.0])
    run = jax.jit(jax.vmap(lambda f: encode_texts(with_static(params, causal_text=f), CAPTIONS)[0]))
    both = np.asarray(run(flags))
    np.testing.assert_allclose(both[0], emb_a, atol=1e-6, rtol=0)
    np.testing.assert_allclose(both[1], run_texts(bidir, jnp.asarray(a))[0], atol=1e-6, rtol=0)


def test_static_params_come_from_the_config_and_get_no_gradient():
    cfg = SMALL.replace(causal_text=False, cls_position=True, logit_scale_max=3.0)
    static = _np(init_params(cfg, jax.random.key(0, impl="rbg"))["static"])
    assert static == {"causal_text": 0.0, "logit_scale_max": np.float32(3.0), "cls_position": 1.0}
    params = random_params(SMALL)

    def loss(p):
        return forward(p, IMAGES, CAPTIONS, readout_only=True)[0].sum()

    # a logit scale above the cap: the cap is the active branch of the minimum, so only
    # the stopped gradient keeps logit_scale_max from being trained
    capped = {**params, "logit_scale": jnp.float32(10.0)}
    grads = jax.jit(jax.grad(loss))(capped)
    assert set(grads["static"]) == {"causal_text", "logit_scale_max", "cls_position"}
    for k, g in grads["static"].items():
        assert float(g) == 0.0, k
    assert np.abs(np.asarray(grads["vision"]["E"])).max() > 0


def test_with_static_edits_only_the_named_switches():
    params = random_params(SMALL)
    bidir = with_static(params, causal_text=False, logit_scale_max=2.0)
    assert _np(bidir["static"]) == {
        "causal_text": 0.0,
        "logit_scale_max": np.float32(2.0),
        "cls_position": 0.0,
    }
    assert bidir["text"] is params["text"] and float(params["static"]["causal_text"]) == 1.0
    # stacked params [K]: a scalar is broadcast, a [K] value sets each model's own
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x, x]), params)
    one = with_static(stacked, causal_text=0.0)["static"]
    np.testing.assert_array_equal(one["causal_text"], np.zeros(3, np.float32))
    assert one["causal_text"].dtype == jnp.float32
    each = with_static(stacked, causal_text=jnp.asarray([1.0, 0.0, 1.0]))["static"]
    np.testing.assert_array_equal(each["causal_text"], [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="unknown keys \\['causal'\\]"):
        with_static(params, causal=0.0)


def test_text_encoder_causal_gradients():
    params = random_params(SMALL.replace(n_layers=2))
    T = CAPTIONS.shape[1]

    def out_at(delta, i):
        edits = Edits(add={"text/resid_pre.0": delta})
        _, aux = encode_texts(params, CAPTIONS, edits=edits)
        return aux["text/resid_post.1"][:, i].sum()

    grad = jax.jit(jax.grad(out_at), static_argnums=1)
    delta = jnp.zeros((CAPTIONS.shape[0], T, D))
    for i in (2, 5):
        g = np.abs(np.asarray(grad(delta, i))).max(axis=(0, 2))
        assert (g[i + 1 :] == 0).all()
        assert (g[: i + 1] > 0).all()


# ---------------------------------------------------------------------------
# fast paths are exact


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("ln_mlp", [False, True], ids=["plain", "ln_mlp"])
def test_readout_only_is_exact(n_layers, ln_mlp):
    cfg = SMALL.replace(n_layers=n_layers, layernorm=ln_mlp, mlp=ln_mlp)
    params = random_params(cfg, seed=n_layers)
    sims_f, aux_f = run_forward(params)
    sims_r, aux_r = run_forward(params, readout_only=True)
    for k in ("vision/embed", "text/embed", "vision/readout", "text/readout"):
        np.testing.assert_allclose(aux_f[k], aux_r[k], atol=ATOL, rtol=0)
    np.testing.assert_allclose(sims_f, sims_r, atol=ATOL, rtol=1e-6)
    # the readout-only path really computes one query row in its last layer
    last = n_layers - 1
    assert aux_r[f"vision/pattern.{last}"].shape == (4, H, 1, S)
    assert aux_f[f"vision/pattern.{last}"].shape == (4, H, S, S)
    # the full path reads the text at the EOT position, the image at CLS (row 0)
    eot = np.argmax(CAPTIONS_NP == V.eot, axis=1)
    assert eot.tolist() == [8, 8, 6, 2]
    resid = aux_f[f"text/resid_post.{last}"]
    np.testing.assert_array_equal(aux_f["text/readout"], resid[np.arange(4), eot])
    np.testing.assert_array_equal(aux_f["vision/readout"], aux_f[f"vision/resid_post.{last}"][:, 0])


def _block_reference(block, x, causal, q_rows):
    """SPEC attention in float64: scores and pattern [B, H, Q, S], block output."""
    b = _np(block)
    x = _f64(x)
    q = np.einsum("bsd,hde->bshe", x, b["W_Q"]) + b["b_Q"]
    k = np.einsum("bsd,hde->bshe", x, b["W_K"]) + b["b_K"]
    v = np.einsum("bsd,hde->bshe", x, b["W_V"]) + b["b_V"]
    scores = np.einsum("bqhe,bshe->bhqs", q, k) / math.sqrt(DH)
    S = x.shape[1]
    rows = np.broadcast_to(np.arange(S), x.shape[:2]) if q_rows is None else q_rows
    scores = np.take_along_axis(scores, rows[:, None, :, None], axis=2)
    masked = scores
    if causal:
        visible = np.arange(S)[None, None, None, :] <= rows[:, None, :, None]
        masked = np.where(visible, scores, -np.inf)
    pattern = np.exp(masked - masked.max(-1, keepdims=True))
    pattern /= pattern.sum(-1, keepdims=True)
    z = np.einsum("bhqs,bshe->bqhe", pattern, v)
    out = np.einsum("bqhe,hed->bqd", z, b["W_O"]) + b["b_O"]
    x_rows = np.take_along_axis(x, rows[:, :, None], axis=1)
    return scores, pattern, x_rows + out


@pytest.mark.parametrize(
    "causal,readout_rows,batched_p",
    [(False, False, False), (True, False, False), (False, True, False), (True, True, True)],
)
def test_factored_first_layer_equals_dense(causal, readout_rows, batched_p):
    params = random_params(SMALL)
    tower = params["vision"]
    block = tower["block_0"]
    rng = np.random.default_rng(3)
    B = 4
    tokens = rng.integers(0, tower["E"].shape[0], (B, S)).astype(np.int32)
    p_rows = rng.normal(0, 0.7, (B, S, D) if batched_p else (S, D)).astype(np.float32)
    x = (np.asarray(tower["E"])[tokens] + p_rows).astype(np.float32)
    q_rows = np.asarray([[0], [4], [8], [3]], np.int32) if readout_rows else None
    kw = dict(
        causal=causal,
        q_rows_BxQ=None if q_rows is None else jnp.asarray(q_rows),
        edits=NO_EDITS,
        prefix="v/",
        suffix=".0",
    )
    e_part = tower["E"][jnp.asarray(tokens)]
    parts = (jnp.asarray(tokens), tower["E"], jnp.asarray(p_rows), e_part, e_part * 0)
    out_d, aux_d = block_forward(block, jnp.asarray(x), first=FirstBlock(*parts), **kw)
    first = FirstBlock(*parts, factored=True)
    out_f, aux_f = block_forward(block, jnp.asarray(x), first=first, **kw)
    aux_d, aux_f = _np(aux_d), _np(aux_f)
    assert set(aux_d) == set(aux_f)
    Q = 1 if readout_rows else S
    assert out_d.shape == out_f.shape == (B, Q, D)
    for name in ("q", "k", "v", "attn_scores", "pattern", "z", "attn_out", "resid_post"):
        np.testing.assert_allclose(aux_d[f"v/{name}.0"], aux_f[f"v/{name}.0"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out_d, out_f, atol=ATOL, rtol=0)
    # and both are the attention of SPEC
    scores, pattern, out = _block_reference(block, x, causal, q_rows)
    np.testing.assert_allclose(aux_d["v/attn_scores.0"], scores, atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(aux_f["v/pattern.0"], pattern, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out_f, out, atol=1e-4, rtol=1e-5)


def test_factored_path_refuses_layernorm():
    params = random_params(SMALL.replace(layernorm=True))
    tower = params["vision"]
    tokens = jnp.zeros((4, S), jnp.int32)
    zeros = jnp.zeros((4, S, D))
    first = FirstBlock(tokens, tower["E"], jnp.zeros((S, D)), zeros, zeros, factored=True)
    with pytest.raises(ValueError, match="LayerNorm"):
        block_forward(tower["block_0"], zeros, causal=False, prefix="v/", first=first)


# ---------------------------------------------------------------------------
# attention-logit terms


def _vision_terms(params, images=IMAGES):
    """The nine first-layer logit terms {name: [B, H, S, S]} of SPEC, in float64."""
    tower = _np(params["vision"])
    block = tower["block_0"]
    tokens, p_rows = _np(vision_inputs(params["vision"], images))
    E = _f64(tower["E"])[tokens]
    P = np.broadcast_to(_f64(p_rows), E.shape)
    B, S = tokens.shape
    qs = {
        "E": np.einsum("bsd,hde->bhse", E, block["W_Q"]),
        "P": np.einsum("bsd,hde->bhse", P, block["W_Q"]),
        "B": np.broadcast_to(_f64(block["b_Q"])[None, :, None], (B, H, S, DH)),
    }
    ks = {
        "E": np.einsum("bsd,hde->bhse", E, block["W_K"]),
        "P": np.einsum("bsd,hde->bhse", P, block["W_K"]),
        "B": np.broadcast_to(_f64(block["b_K"])[None, :, None], (B, H, S, DH)),
    }
    return {t: np.einsum("bhqe,bhse->bhqs", qs[t[0]], ks[t[1]]) / math.sqrt(DH) for t in TERMS}


@pytest.mark.parametrize("cls_position", [False, True], ids=["cls_no_pos", "cls_pos"])
def test_terms_sum_to_the_logits(cls_position):
    params = random_params(SMALL.replace(cls_position=cls_position))
    terms = _vision_terms(params)
    _, aux = run_images(params)
    np.testing.assert_allclose(aux["vision/attn_scores.0"], sum(terms.values()), atol=ATOL)
    # every term is present at these params
    for t in TERMS:
        assert np.abs(terms[t]).max() > 1e-2, t
    tokens, p_rows = _np(vision_inputs(params["vision"], IMAGES))
    assert (tokens[:, 0] == V.cls).all()
    if cls_position:
        # the CLS row carries P[0]
        np.testing.assert_array_equal(p_rows[0], np.asarray(params["vision"]["P"])[0])
        assert np.abs(terms["PE"][:, :, 0]).max() > 1e-2
    else:
        # SPEC default: no position row on CLS, so P-terms vanish on its row and column
        assert (p_rows[0] == 0).all()
        assert (terms["PE"][:, :, 0] == 0).all() and (terms["EP"][:, :, :, 0] == 0).all()


@pytest.mark.parametrize("ln_mlp", [False, True], ids=["plain", "ln_mlp"])
def test_all_ones_mask_is_exactly_the_plain_forward(ln_mlp):
    params = random_params(SMALL.replace(layernorm=ln_mlp, mlp=ln_mlp))
    edits = Edits(term_keep={"vision": term_mask(H)}, vp_keep={"vision": jnp.ones(H)})
    sims, aux = run_forward(params)
    sims_e, aux_e = run_forward(params, edits=edits)
    assert (sims == sims_e).all()
    for k in ("vision/attn_scores.0", "vision/v.0", "vision/embed", "text/embed"):
        assert (aux[k] == aux_e[k]).all(), k
    # removing every term leaves nothing: the terms sum to the logits (LayerNorm too)
    _, aux_0 = run_forward(params, edits=Edits(term_keep={"vision": term_mask(H, TERMS)}))
    assert np.abs(aux["vision/attn_scores.0"]).max() > 0.1
    np.testing.assert_allclose(aux_0["vision/attn_scores.0"], 0.0, atol=ATOL)
    np.testing.assert_allclose(aux_0["vision/pattern.0"], 1 / S, atol=1e-6)
    # the text tower was not edited
    np.testing.assert_array_equal(aux_0["text/embed"], aux["text/embed"])


@pytest.mark.parametrize("term", ["EP", "PE", "BP", "EE"])
def test_removing_a_term_subtracts_exactly_that_term(term):
    params = random_params(SMALL)
    expected = _vision_terms(params)[term]
    assert np.abs(expected).max() > 1e-2
    _, aux = run_images(params)
    _, aux_a = run_images(params, edits=Edits(term_keep={"vision": term_mask(H, [term])}))
    diff = aux["vision/attn_scores.0"] - aux_a["vision/attn_scores.0"]
    np.testing.assert_allclose(diff, expected, atol=ATOL, rtol=0)
    if term[0] == "P":
        # the readout is the CLS row, whose query has no position part: P-query terms
        # cannot change a one-layer vision embedding
        np.testing.assert_allclose(aux["vision/embed"], aux_a["vision/embed"], atol=1e-6)
    else:
        assert not np.allclose(aux["vision/embed"], aux_a["vision/embed"], atol=1e-4)


def test_removing_a_term_in_chosen_heads_only():
    params = random_params(SMALL)
    ep = _vision_terms(params)["EP"]
    edits = Edits(term_keep={"vision": term_mask(H, ["EP"], heads=[1, 3])})
    _, aux = run_images(params)
    _, aux_a = run_images(params, edits=edits)
    diff = aux["vision/attn_scores.0"] - aux_a["vision/attn_scores.0"]
    np.testing.assert_allclose(diff[:, [1, 3]], ep[:, [1, 3]], atol=ATOL, rtol=0)
    np.testing.assert_allclose(diff[:, [0, 2]], 0.0, atol=1e-6)


@pytest.mark.parametrize("ln_mlp", [False, True], ids=["plain", "ln_mlp"])
def test_ablations_are_the_same_on_the_readout_only_path(ln_mlp):
    params = random_params(SMALL.replace(layernorm=ln_mlp, mlp=ln_mlp), seed=1)
    edits = Edits(
        term_keep={"vision": term_mask(H, ["EP", "BP"]), "text": term_mask(H, ["EP", "BP"])},
        vp_keep={"vision": jnp.zeros(H)},
    )
    sims_plain, _ = run_forward(params)
    sims_f, _ = run_forward(params, edits=edits)
    sims_r, _ = run_forward(params, edits=edits, readout_only=True)
    np.testing.assert_allclose(sims_f, sims_r, atol=ATOL, rtol=1e-6)
    assert np.abs(sims_f - sims_plain).max() > 1e-2


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
    block = _np(params["vision"]["block_0"])
    _, aux = run_images(params)
    _, aux_a = run_images(params, edits=Edits(term_keep={"vision": term_mask(H, ["BB"])}))
    diff = aux["vision/attn_scores.0"] - aux_a["vision/attn_scores.0"]
    bb = np.einsum("he,he->h", _f64(block["b_Q"]), block["b_K"]) / math.sqrt(DH)
    assert np.abs(bb).min() > 1e-3
    np.testing.assert_allclose(
        diff, np.broadcast_to(bb[None, :, None, None], diff.shape), atol=ATOL
    )
    np.testing.assert_allclose(aux["vision/pattern.0"], aux_a["vision/pattern.0"], atol=1e-6)
    np.testing.assert_allclose(aux["vision/embed"], aux_a["vision/embed"], atol=ATOL)


def test_vp_ablation_removes_position_values():
    params = random_params(SMALL)
    _, p_rows = _np(vision_inputs(params["vision"], IMAGES))
    keep = np.asarray([1.0, 0.0, 1.0, 0.5], np.float32)
    _, aux = run_images(params)
    _, aux_a = run_images(params, edits=Edits(vp_keep={"vision": jnp.asarray(keep)}))
    W_V = _f64(params["vision"]["block_0"]["W_V"])
    pv = np.einsum("sd,hde->she", _f64(p_rows), W_V)  # [S, H, Dh]
    expected = (1 - keep)[None, None, :, None] * pv[None]
    diff = aux["vision/v.0"] - aux_a["vision/v.0"]
    np.testing.assert_allclose(diff, np.broadcast_to(expected, diff.shape), atol=ATOL, rtol=0)
    assert np.abs(expected).max() > 1e-2
    # the logits do not change, only the values
    np.testing.assert_array_equal(aux["vision/attn_scores.0"], aux_a["vision/attn_scores.0"])
    assert not np.allclose(aux["vision/embed"], aux_a["vision/embed"], atol=1e-4)


# ---------------------------------------------------------------------------
# position inputs


def test_positions_input():
    params = random_params(SMALL)
    emb, _ = run_images(params)
    emb_ar, _ = run_images(params, positions=jnp.arange(L))
    np.testing.assert_array_equal(emb, emb_ar)
    emb_f, _ = run_images(params, positions=jnp.arange(L, dtype=jnp.float32))
    np.testing.assert_allclose(emb, emb_f, atol=1e-6, rtol=0)
    # The vision tower is permutation-equivariant up to the position rows and reads CLS:
    # a mirrored image with mirrored position codes is the same set of (token, position).
    mirrored = jnp.asarray(IMAGES_NP[:, ::-1])
    mirror_pos = jnp.asarray(L - 1 - np.arange(L))
    emb_m, _ = run_images(params, mirrored, positions=mirror_pos)
    np.testing.assert_allclose(emb, emb_m, atol=ATOL, rtol=0)
    # while the mirrored image at natural positions is a different input
    emb_mn, _ = run_images(params, mirrored)
    assert np.abs(emb_mn - emb).max() > 1e-3
    # batched positions: one row of position ids per image
    emb_p, _ = run_images(params, positions=mirror_pos)
    use_mirror = np.asarray([False, True, False, True])
    pos_b = np.where(use_mirror[:, None], L - 1 - np.arange(L), np.arange(L)).astype(np.int32)
    emb_b, _ = run_images(params, positions=jnp.asarray(pos_b))
    np.testing.assert_allclose(emb_b, np.where(use_mirror[:, None], emb_p, emb), atol=ATOL)


def test_position_rows():
    params = random_params(SMALL)
    tower = params["vision"]
    P = np.asarray(tower["P"])
    tokens, rows = _np(vision_inputs(tower, IMAGES))
    assert (tokens[:, 0] == V.cls).all()
    np.testing.assert_array_equal(tokens[:, 1:], IMAGES_NP)
    np.testing.assert_array_equal(rows[0], 0)  # CLS carries no position by default
    np.testing.assert_array_equal(rows[1:], P)
    _, rows_h = _np(vision_inputs(tower, IMAGES, positions=jnp.arange(L) + 0.5))
    np.testing.assert_allclose(rows_h[1:-1], (P[:-1] + P[1:]) / 2, atol=1e-6)
    # with cls_position the CLS row is P[0] and pixel i gets P[i + 1]
    tower_c = random_params(SMALL.replace(cls_position=True))["vision"]
    _, rows_c = _np(vision_inputs(tower_c, IMAGES))
    np.testing.assert_array_equal(rows_c, np.asarray(tower_c["P"]))
    with pytest.raises(ValueError):
        vision_inputs(tower, IMAGES[:, :6])


# ---------------------------------------------------------------------------
# named edits


def test_add_and_replace_edits_on_the_readout():
    params = random_params(SMALL)
    W_proj = _f64(params["vision"]["W_proj"])
    emb, aux = run_images(params)
    emb_0, _ = run_images(params, edits=Edits(add={"vision/readout": jnp.zeros(D)}))
    np.testing.assert_array_equal(emb, emb_0)

    vec = np.linspace(-1.0, 1.0, D).astype(np.float32)
    emb_a, aux_a = run_images(params, edits=Edits(add={"vision/readout": jnp.asarray(vec)}))
    proj = (aux["vision/readout"] + vec) @ W_proj
    expected = proj / np.linalg.norm(proj, axis=-1, keepdims=True)
    np.testing.assert_allclose(emb_a, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(aux_a["vision/readout"], aux["vision/readout"] + vec, atol=1e-6)
    assert np.abs(emb_a - emb).max() > 1e-2

    where = np.asarray([True, False, True, False])
    edits = Edits(replace={"vision/readout": (jnp.asarray(where[:, None]), jnp.asarray(vec))})
    emb_r, _ = run_images(params, edits=edits)
    target = vec @ W_proj
    target = target / np.linalg.norm(target)
    np.testing.assert_allclose(emb_r[where], np.stack([target, target]), atol=ATOL)
    assert np.abs(emb[where] - target).max() > 1e-2
    np.testing.assert_allclose(emb_r[~where], emb[~where], atol=1e-6, rtol=0)


def test_patching_an_intermediate_changes_downstream():
    params = random_params(SMALL)
    # patch image 1's layer-0 output into image 0: image 0 then embeds like image 1
    _, aux = run_images(params)
    patched = jnp.asarray(aux["vision/resid_post.0"][1])
    where = jnp.asarray(np.asarray([True, False, False, False])[:, None, None])
    edits = Edits(replace={"vision/resid_post.0": (where, patched)})
    emb_p, _ = run_images(params, edits=edits)
    np.testing.assert_allclose(emb_p[0], aux["vision/embed"][1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(emb_p[1:], aux["vision/embed"][1:], atol=1e-6, rtol=0)
    assert np.abs(aux["vision/embed"][0] - aux["vision/embed"][1]).max() > 1e-2


# ---------------------------------------------------------------------------
# outputs, jit and vmap


def test_forward_outputs():
    params = random_params(SMALL)
    sims, aux = run_forward(params)
    assert sims.shape == (4, 4)
    img, txt = _f64(aux["vision/embed"]), _f64(aux["text/embed"])
    np.testing.assert_allclose(np.linalg.norm(img, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(txt, axis=-1), 1.0, atol=1e-5)
    scale = math.exp(float(params["logit_scale"]))
    np.testing.assert_allclose(sims, scale * img @ txt.T, rtol=1e-5, atol=ATOL)
    # the logit scale is clipped at log(100), the cap of params["static"]
    big = {**params, "logit_scale": jnp.asarray(10.0)}
    sims_big, aux_big = run_forward(big)
    np.testing.assert_allclose(aux_big["logit_scale"], 100.0, rtol=1e-5)
    np.testing.assert_allclose(sims_big, 100.0 * img @ txt.T, rtol=1e-4, atol=1e-4)
    _, aux_cap = run_forward(with_static(big, logit_scale_max=math.log(20.0)))
    np.testing.assert_allclose(aux_cap["logit_scale"], 20.0, rtol=1e-5)


def test_jit_equals_eager():
    params = random_params(SMALL)
    sims, aux = run_forward(params)
    sims_j, aux_j = jax.jit(forward)(params, IMAGES, CAPTIONS)
    assert set(aux) == set(aux_j)
    np.testing.assert_allclose(sims, sims_j, atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(aux["vision/pattern.0"], aux_j["vision/pattern.0"], atol=ATOL)


def test_vmap_over_params_and_edits():
    seeds = [_np(random_params(SMALL, seed=s)) for s in (0, 1, 2)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.asarray(np.stack(xs)), *seeds)
    masks = np.stack([term_mask(H), term_mask(H, ["EP"]), term_mask(H, ["EE"])])

    def run(p, m):
        return forward(p, IMAGES, CAPTIONS, edits=Edits(term_keep={"vision": m}))[0]

    batched = jax.vmap(jax.vmap(run, in_axes=(None, 0)), in_axes=(0, None))
    out = np.asarray(jax.jit(batched)(stacked, jnp.asarray(masks)))
    assert out.shape == (3, 3, 4, 4)
    for i, p in enumerate(seeds):
        for j in range(3):
            want = run(jax.tree_util.tree_map(jnp.asarray, p), jnp.asarray(masks[j]))
            np.testing.assert_allclose(out[i, j], want, atol=ATOL, rtol=1e-5)
    assert not np.allclose(out[0, 0], out[1, 0], atol=1e-3)
    assert not np.allclose(out[0, 0], out[0, 1], atol=1e-3)


def _textbook_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


def test_layer_norm_and_its_written_backward_equal_autodiff_of_the_formula():
    """`layer_norm`'s hand-written backward gives autodiff's gradient of the
    textbook formula, for x, w and b, at an eps other than the default too."""
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = 3.0 * jax.random.normal(kx, (4, 5, D)) + 1.0
    w, b = jax.random.normal(kw, (D,)), jnp.linspace(-1.0, 1.0, D)
    g = jax.random.normal(kg, (4, 5, D))
    for eps in (1e-5, 1e-2):
        np.testing.assert_allclose(
            layer_norm(x, w, b, eps), _textbook_layer_norm(x, w, b, eps), atol=1e-6
        )
        ours = jax.vjp(lambda *a: layer_norm(*a, eps), x, w, b)[1](g)
        ref = jax.vjp(lambda *a: _textbook_layer_norm(*a, eps), x, w, b)[1](g)
        for a, r in zip(ours, ref):
            np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)


def test_rows_matmul_equals_the_plain_product_and_its_gradients():
    kx, kw = jax.random.split(jax.random.key(4))
    x, W = jax.random.normal(kx, (3, 5, 7, D)), jax.random.normal(kw, (D, 6))
    np.testing.assert_allclose(rows_matmul(x, W), x @ W, rtol=1e-6, atol=1e-6)
    loss = lambda f: lambda x, W: jnp.sum(jnp.tanh(f(x, W)))  # noqa: E731
    ours = jax.grad(loss(rows_matmul), argnums=(0, 1))(x, W)
    ref = jax.grad(loss(lambda x, W: x @ W), argnums=(0, 1))(x, W)
    for a, r in zip(ours, ref):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)
