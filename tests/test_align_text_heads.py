"""Text-side analyses: EOT patterns, first-mention preference, Procrustes label alignment."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.analysis.align import (
    align_labels,
    alignment_study,
    control_maps,
    haar_rotations,
    label_embeddings,
    procrustes,
)
from jaxmech.analysis.text_heads import (
    GROUPS,
    ROLES,
    caption_groups,
    eot_patterns,
    first_mention_preference,
    pair_captions,
    preference_stats,
    text_head_table,
)
from jaxmech.config import Config
from jaxmech.data.tasks.vocab import Vocab
from jaxmech.families.dual_encoder.model import forward, init_params

TINY = dict(
    d_model=16,
    d_head=4,
    n_heads=4,
    d_embed=16,
    n_labels=8,
    n_val_labels=3,
    n_pair_labels=5,
    image_len=6,
    layouts_per_pair=5,
)
CFG = Config().replace(**TINY)
N = CFG.task.n_labels
FIRST_VAL = N - CFG.task.n_val_labels + 1

_pref = jax.jit(first_mention_preference)
_patterns = jax.jit(eot_patterns)
_study = jax.jit(alignment_study, static_argnames=("n_labels", "image_len", "kind", "text_caption"))
_embed = jax.jit(label_embeddings, static_argnums=(1, 2), static_argnames=("kind", "text_caption"))
_forward = jax.jit(forward, static_argnames=("readout_only",))


@functools.partial(jax.jit, static_argnums=0)
def _noisy_params(config, seed, scale):
    params = init_params(config, jax.random.key(seed))
    trained = {k: v for k, v in params.items() if k != "static"}  # switches stay as set
    leaves, tree = jax.tree_util.tree_flatten(trained)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    noisy = jax.tree_util.tree_unflatten(
        tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )
    return {**noisy, "static": params["static"]}


def _noisy(config=CFG, seed=0, scale=0.3):
    """Init params plus noise, so attention is far from uniform (one compile per config)."""
    return _noisy_params(config, seed, scale)


def _mixed_captions():
    """Pair captions plus shorter single-object ones (EOT at positions 2, 6 and 8)."""
    v = Vocab(N)
    short = [v.encode([3]), v.encode([7, "is", "on", "the", "left"])]
    return jnp.asarray(np.concatenate([pair_captions(N).tokens[:6], np.asarray(short)]))


# ---------------------------------------------------------------- Procrustes


def test_procrustes_recovers_a_rotation():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    A = jax.random.normal(k1, (40, 16))
    R0 = haar_rotations(k2, 1, 16)[0]
    np.testing.assert_allclose(R0 @ R0.T, np.eye(16), atol=1e-5)
    np.testing.assert_allclose(procrustes(A, A @ R0), R0, atol=1e-4)
    np.testing.assert_allclose(procrustes(A, A), np.eye(16), atol=1e-4)
    # noisy targets: still close to the truth, and always orthogonal
    R = procrustes(A, A @ R0 + 0.01 * jax.random.normal(k3, (40, 16)))
    assert float(jnp.abs(R - R0).max()) < 0.02
    np.testing.assert_allclose(R @ R.T, np.eye(16), atol=1e-5)
    # fewer points than dimensions: exact on the fit rows, orthogonal everywhere
    R = procrustes(A[:5], A[:5] @ R0)
    np.testing.assert_allclose(A[:5] @ R, A[:5] @ R0, atol=1e-4)
    np.testing.assert_allclose(R @ R.T, np.eye(16), atol=1e-5)


def test_procrustes_rejects_bad_shapes():
    A = jnp.ones((5, 4))
    for B in (jnp.ones((5, 3)), jnp.ones((4, 4)), jnp.ones((5, 4, 1))):
        with pytest.raises(ValueError, match="same shape"):
            procrustes(A, B)
    with pytest.raises(ValueError, match="same shape"):
        procrustes(jnp.ones(4), jnp.ones(4))
    with pytest.raises(ValueError, match="rotations"):
        align_labels(A, A, jnp.arange(3), jnp.arange(3, 5), jnp.ones((2, 3, 3)), jnp.ones((2, 3)))


def test_alignment_finds_a_planted_rotation():
    """Vision label rows = text label rows rotated: the study maps held-out labels back."""
    params = _noisy()
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    # labels in a 4-dim subspace, so the fit labels (1..5) span the held-out ones
    txt = jax.random.normal(k1, (N, 4)) @ jax.random.normal(k2, (4, 16))
    R0 = haar_rotations(k3, 1, 16)[0]
    params["text"]["E"] = params["text"]["E"].at[1 : N + 1].set(txt)
    params["vision"]["E"] = params["vision"]["E"].at[1 : N + 1].set(txt @ R0.T)
    rot, perm = control_maps(jax.random.key(2), 50, 10, 16, FIRST_VAL - 1)
    fit, test = jnp.arange(1, FIRST_VAL), jnp.arange(FIRST_VAL, N + 1)
    r = _study(params, fit, test, rot, perm, n_labels=N, image_len=6, kind="token")
    assert float(r["cos_after"]) > 0.999 and float(r["cos_after_span"]) > 0.999
    assert float(r["retrieval_after"]) == 1.0
    assert float(r["span_img"]) > 0.999 and float(r["span_txt"]) > 0.999
    assert r["cos_random"].shape == (50,) and r["cos_shuffled"].shape == (10,)
    assert float(jnp.abs(r["cos_random"].mean())) < 0.2
    assert float(r["cos_shuffled"].mean()) < 0.9


def test_label_embeddings_shapes_and_errors():
    params = _noisy()
    img, txt = _embed(params, N, 6, kind="token")
    assert img.shape == txt.shape == (N, 16)
    np.testing.assert_array_equal(img, params["vision"]["E"][1 : N + 1])
    for cap in ("side", "label"):
        img, txt = _embed(params, N, 6, kind="output", text_caption=cap)
        assert img.shape == txt.shape == (N, 16)
        np.testing.assert_allclose(jnp.linalg.norm(img, axis=-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(jnp.linalg.norm(txt, axis=-1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="n_labels"):
        label_embeddings(params, N + 1, 6)
    with pytest.raises(ValueError, match="kind"):
        label_embeddings(params, N, 6, kind="raw")
    with pytest.raises(ValueError, match="text_caption"):
        label_embeddings(params, N, 6, kind="output", text_caption="both")


# ---------------------------------------------------------------- text heads


def test_pair_captions():
    pc = pair_captions(N)
    assert pc.tokens.shape == (N * (N - 1), 9)
    assert (pc.first_pos == 1).all() and (pc.second_pos == 7).all()
    assert (pc.tokens[np.arange(len(pc.first)), pc.first_pos] == pc.first).all()
    assert (pc.tokens[np.arange(len(pc.first)), pc.second_pos] == pc.second).all()
    lr = pair_captions(N, "left_right")
    assert len(lr.first) == 2 * N * (N - 1) and set(lr.form.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="caption_mode"):
        pair_captions(N, "right")


@pytest.mark.parametrize("text_layers", [1, 2])
def test_eot_patterns_are_the_forwards_probabilities(text_layers):
    cfg = CFG if text_layers == 1 else CFG.replace(text_n_layers=text_layers)
    params = _noisy(cfg)
    caps = _mixed_captions()
    pat = _patterns(params, caps)
    C, T = caps.shape
    assert pat.shape == (C, text_layers, 4, T)
    np.testing.assert_allclose(pat.sum(-1), 1.0, atol=1e-5)
    assert float(pat.min()) >= 0.0
    eot = np.asarray([list(r).index(Vocab(N).eot) for r in np.asarray(caps)])
    after = np.arange(T)[None, :] > eot[:, None]  # causal: nothing after EOT
    assert float(jnp.abs(jnp.where(after[:, None, None], pat, 0.0)).max()) == 0.0
    assert float(pat.std()) > 1e-2  # not uniform: the check is not vacuous
    images = jnp.zeros((1, 6), jnp.int32)
    _, aux = _forward(params, images, caps, readout_only=True)
    last = text_layers - 1
    np.testing.assert_allclose(pat[:, last], aux[f"text/pattern.{last}"][:, :, 0], atol=1e-6)
    _, aux = _forward(params, images, caps)
    for y in range(text_layers):
        full = aux[f"text/pattern.{y}"][np.arange(C), :, eot]
        np.testing.assert_allclose(pat[:, y], full, atol=1e-6)


def test_eot_patterns_reject_bad_shapes():
    params = _noisy()
    with pytest.raises(ValueError, match=r"\[C, T\]"):
        eot_patterns(params, jnp.asarray(pair_captions(N).tokens[0]))
    with pytest.raises(ValueError, match="integer"):
        eot_patterns(params, jnp.asarray(pair_captions(N).tokens, jnp.float32))
    pc = pair_captions(N)
    with pytest.raises(ValueError, match="first_pos"):
        first_mention_preference(params, pc.tokens, pc.first_pos[:3], pc.second_pos)


def test_preference_parts_and_antisymmetry_without_positions():
    """With no position rows, the EOT row cannot tell first from second: swapping the
    labels negates the preference exactly, and it averages to zero over all pairs."""
    pc = pair_captions(N)
    params = _noisy()
    p = _pref(params, pc.tokens, pc.first_pos, pc.second_pos)
    assert p["pref"].shape == (len(pc.first), 1, 4)
    np.testing.assert_allclose(p["key_E"] + p["key_P"] + p["key_R"], p["logit"], atol=1e-5)
    np.testing.assert_allclose(p["pref"], p["first"] - p["second"])
    # the key-position part is the same for every pair caption (same EOT query, positions)
    np.testing.assert_allclose(p["key_P"], jnp.broadcast_to(p["key_P"][:1], p["key_P"].shape),
                               atol=1e-5)  # fmt: skip
    params["text"]["P"] = jnp.zeros_like(params["text"]["P"])
    p = _pref(params, pc.tokens, pc.first_pos, pc.second_pos)
    index = {(a, b): i for i, (a, b) in enumerate(zip(pc.first, pc.second))}
    swap = np.asarray([index[(b, a)] for a, b in zip(pc.first, pc.second)])
    np.testing.assert_allclose(p["pref"], -p["pref"][swap], atol=1e-6)
    assert float(jnp.abs(p["key_P"]).max()) == 0.0
    masks = caption_groups(pc.first, pc.second, pc.form, 5, FIRST_VAL)
    s = preference_stats(p, masks)
    assert float(jnp.abs(s["mean_pref"][GROUPS.index("all")]).max()) < 1e-6
    assert np.isnan(np.asarray(s["mean_pref"][GROUPS.index("form_right")])).all()


def test_planted_first_mention_head_is_found():
    """Point position 1's key at head 2's EOT query: head 2 attends to the first label
    whatever it is; the table (vmapped over two models) calls it a first-mention head."""
    pc = pair_captions(N)
    base = _noisy(scale=0.05)
    params = jax.tree_util.tree_map(lambda x: x, base)
    t, blk, h = params["text"], params["text"]["block_0"], 2
    q = (t["E"][Vocab(N).eot] + t["P"][8]) @ blk["W_Q"][h] + blk["b_Q"][h]
    direction = blk["W_K"][h] @ q
    t["P"] = t["P"].at[1].add(30.0 * direction / jnp.linalg.norm(direction) ** 2 * 4.0)
    stacked = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), base, params)
    tab = jax.jit(lambda p: text_head_table(p, pc, jnp.asarray([5, 5]), FIRST_VAL))(stacked)
    assert tab["mean_pref"].shape == (2, len(GROUPS), 1, 4)
    assert tab["pref"].shape == (2, len(pc.first), 1, 4)
    assert ROLES[int(tab["role"][1, 0, h])] == "first"
    for g in ("seen", "unseen", "mixed"):
        assert float(tab["frac_first"][1, GROUPS.index(g), 0, h]) == 1.0
    assert float(tab["mean_pref"][1, 0, 0, h]) > 0.5
    # the stacked table equals the single-model computation
    one = _pref(params, pc.tokens, pc.first_pos, pc.second_pos)
    np.testing.assert_allclose(tab["pref"][1], one["pref"], atol=1e-6)


def test_cli_rejects_a_missing_folder(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "experiments.text_align", f"--run={tmp_path / 'nope'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    # the message names the folder (its wording belongs to the reports' loader)
    assert f"{tmp_path / 'nope'}" in r.stderr + r.stdout and "Traceback" not in r.stderr
