"""The attention core one key / value head at a time on a CPU (`models.attention_core`):
its values and staged arrays equal the batched core's, grouped-query heads, several
sequences, masked keys and one query row included, and the staged core (an edit or a
capture at its scores or pattern) the one-map core's bit for bit; a whole forward's
logits and sites as the batched core's on every family's fixture, a capture of every
site changing no value; an edit at a scanned core point acts there."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmech
from jaxmech.models import attention_core, decoder, scan
from jaxmech.models.decoder import Sites
from jaxmech.models.edits import NO_EDITS, Edits

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
FOLDERS = {
    "qwen2_vl": os.path.join(FIX, "qwen2_vl", "qwen2_vl"),
    "qwen3_vl": os.path.join(FIX, "qwen3_vl", "qwen3_vl"),
    "llava": os.path.join(FIX, "llava", "llava"),
    "internvl": os.path.join(FIX, "internvl", "internvl"),
    "gemma3": os.path.join(FIX, "gemma3", "gemma3"),
    "mllama": os.path.join(FIX, "mllama", "mllama"),
}
IMAGE = {"internvl": "batch0.png"}
TOL = 1e-5  # float32: XLA's kernels for the two product shapes round apart (seen ~1e-6)


def _batched(q, k, v, mask, scale):
    """The batched core as `models.decoder.attention` computes it (float32 here)."""
    B, N, C, G, E = q.shape
    K = k.shape[1]
    scores = jnp.einsum("bqcge,bkce->bcgqk", q, k).reshape(B, C * G, N, K) * scale
    pattern = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), -1)
    z = jnp.einsum("bcgqk,bkce->bqcge", pattern.reshape(B, C, G, N, K), v)
    return z.reshape(B, N, C * G, E), scores, pattern


@pytest.mark.parametrize("shape", [(2, 7, 7, 2, 3, 8), (1, 1, 9, 2, 2, 8), (3, 16, 16, 4, 1, 4)])
def test_core_by_head_equals_the_batched_core(shape):
    """Grouped-query heads (G = 3), several sequences, keys masked per row, one query
    row against more keys (a decode step): z and the captured scores / pattern."""
    B, N, K, C, G, E = shape
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, N, C, G, E)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, K, C, E)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(r.random((B, N, K)) > 0.3).at[:, :, 0].set(True)
    core = attention_core.core_by_head

    def staged(*a):
        seen = {}
        return core(*a, 0.3, lambda point, x: seen.setdefault(point, x)), seen

    z, seen = jax.jit(staged)(q, k, v, mask)
    want_z, scores, pattern = jax.jit(lambda *a: _batched(*a, 0.3))(q, k, v, mask)
    np.testing.assert_allclose(z, want_z, atol=1e-6)
    np.testing.assert_allclose(seen["attn_scores"], scores, atol=1e-6)
    np.testing.assert_allclose(seen["pattern"], pattern, atol=1e-6)
    assert np.array_equal(jax.jit(lambda *a: core(*a, 0.3))(q, k, v, mask), z)


def _forward(name, by_head: bool, monkeypatch, capture=True, edits=NO_EDITS):
    m = jaxmech.load(FOLDERS[name])
    image = os.path.join(os.path.dirname(FOLDERS[name]), IMAGE.get(name, "single0.png"))
    enc = m.encode([image], ["Is the red circle left of the blue square?"])
    if by_head:  # every block, however small its heads' scores
        monkeypatch.setattr(attention_core, "MIN_SCORES", 0)
    else:
        monkeypatch.setattr(decoder, "by_head", lambda n: False)
    f = jax.jit(lambda p, x, e: m.family.forward(p, x, edits=e, config=m.config, capture=capture))
    out = f(m.params, enc.inputs, edits)
    monkeypatch.undo()
    return out


# in the suite: a rotary ViT and a grouped-query LM (Qwen2-VL); the others slow (~5 s
# each: three compiles of a whole forward)
IN_SUITE = ("qwen2_vl",)


@pytest.mark.parametrize("name", [n if n in IN_SUITE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(FOLDERS)])  # fmt: skip
def test_a_forward_by_head_equals_the_batched_one(name, monkeypatch):
    """Every family's logits and every site (the ViT's and the LM's scores and
    patterns too) as with the batched core; capturing every site leaves the logits bit
    for bit as capturing none."""
    got, aux = _forward(name, True, monkeypatch)
    want, want_aux = _forward(name, False, monkeypatch)
    np.testing.assert_allclose(got, want, atol=TOL)
    assert set(aux) == set(want_aux)
    for site, value in want_aux.items():
        np.testing.assert_allclose(aux[site], value, atol=TOL, err_msg=site)
    plain, _ = _forward(name, True, monkeypatch, capture=False)
    assert np.array_equal(plain, got)


def test_edits_or_captures_at_the_scores_or_pattern_stage_the_core(monkeypatch):
    """`staged` at a block whose scores or pattern an edit or a capture names (also
    under a scan, and for a recorder that cannot say), not for its q or z; the core
    runs by head on a CPU only."""
    x = jnp.zeros(())
    site = Sites(Edits(add={"lm/pattern.1": x}, replace={"vit/z.0": (True, x)}), False)
    assert attention_core.staged(site, "lm", 1) and not attention_core.staged(site, "vit", 0)
    assert attention_core.staged(Sites(NO_EDITS, ["vit/attn_scores"]), "vit", 3)
    assert not attention_core.staged(Sites(Edits(add={"lm/q.1": x}), ["lm/z"]), "lm", 1)
    assert attention_core.staged(object(), "lm", 0)
    edits = Edits(add={"lm/attn_scores.2": x})
    layer = scan.LayerSites(Sites(edits, False), 0, scan.edited_layers(edits, range(4)),
                            frozenset(), {}, None)  # fmt: skip
    assert attention_core.staged(layer, "lm", scan.LAYER)
    big = attention_core.MIN_SCORES
    assert attention_core.by_head(big) and not attention_core.by_head(big - 1)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not attention_core.by_head(big)


@pytest.mark.slow  # ~5 s; in the suite the staged core's exactness is the no-op test's
def test_an_edit_at_a_scanned_core_point_edits_the_batched_core(monkeypatch):
    """Under the LM's scan an add at one layer's `attn_scores` acts there (the scan
    runs the batched core, whose arrays the edit names), as with every core batched."""
    _, aux = _forward("qwen2_vl", True, monkeypatch, capture=["lm/attn_scores"])
    delta = jnp.zeros_like(aux["lm/attn_scores.1"]).at[..., 0].set(3.0)
    edits = Edits(add={"lm/attn_scores.1": delta})
    got, got_aux = _forward("qwen2_vl", True, monkeypatch, edits=edits)
    want, want_aux = _forward("qwen2_vl", False, monkeypatch, edits=edits)
    np.testing.assert_allclose(got, want, atol=TOL)
    np.testing.assert_allclose(got_aux["lm/attn_scores.1"], aux["lm/attn_scores.1"] + delta,
                               atol=TOL)  # fmt: skip


def test_no_op_edits_at_the_staged_core_change_nothing(monkeypatch):
    """Zeros added at every block's scores and pattern (the core then staged), by
    head: the plain run's logits and every site bit for bit."""
    plain, plain_aux = _forward("qwen2_vl", True, monkeypatch)
    zeros = {k: jnp.zeros_like(v) for k, v in plain_aux.items()
             if k.split("/")[1].split(".")[0] in attention_core.STAGED_POINTS}  # fmt: skip
    assert any(k.startswith("vit/") for k in zeros) and any(k.startswith("lm/") for k in zeros)
    got, aux = _forward("qwen2_vl", True, monkeypatch, edits=Edits(add=zeros))
    assert np.array_equal(got, plain)
    for site, value in plain_aux.items():
        assert np.array_equal(aux[site], value), site
