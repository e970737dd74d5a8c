"""Issue 60's scans beyond the forward's stacks: the greedy decode step's blocks under one
`lax.scan` over the stacked cache (`models.generate.cached_blocks`), and Llama-3.2-Vision's
LM, self- and cross-attention layers interleaved, under one scan with a switch on the
layer's kind (`families.mllama.layers`). Each equals an unrolled reference written here
(the loop each replaced): the step's logits and cache (float32, and bf16 rows / stacked
on a CPU), mllama's logits and every site, an edit at one layer, a capture of some
layers, the last-row path and gradients; neither program grows with its layers."""

from __future__ import annotations

import dataclasses
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import block_scan

import jaxmech
from jaxmech.families.mllama import model as mllama
from jaxmech.families.mllama import params as mparams
from jaxmech.families.qwen2_vl import model as qwen
from jaxmech.models import generate as gen
from jaxmech.models import layout, scan
from jaxmech.models.decoder import ACT, RESUME_SITES, Sites, block_forward, rms_norm, unembed
from jaxmech.models.edits import NO_EDITS, Edits

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
TOL = 1e-5  # float32, the same ops in one order
BF16_TOL = 0.05  # bf16 logits (~1-10): the same bf16 ops, fused apart (seen <= 0.016)


def _close(a, b, tol=TOL):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol,
                               rtol=0)  # fmt: skip


# ---- the decode step ---------------------------------------------------------------------


def _unrolled_step(params, inputs, token_B, cache, valid_BxL, step, d):
    """The decode step as it ran before the scan: block after block, block i's (keys,
    values) from index i of the stacked cache."""
    lm = params["lm"]
    slot = inputs.tokens_BxS.shape[1] + step
    x = lm["E"][token_B][:, None]
    angles = d.angles(inputs, step)
    mask = jnp.concatenate([valid_BxL, jnp.ones((x.shape[0], 1), bool)], 1)[:, None, :]
    site = Sites(NO_EDITS, RESUME_SITES)
    for i in range(d.n_layers):
        x = block_forward(layout.block(lm, i), x, angles, mask, site, "lm", i, d.eps,
                          ACT[d.act], cache=tuple(c[i] for c in cache))  # fmt: skip
    logits = unembed(lm, rms_norm(x, lm["lnf_w"], d.eps)[:, 0]).astype(jnp.float32)
    new = [jnp.stack([site.aux[f"{n}.{i}"] for i in range(d.n_layers)]) for n in RESUME_SITES]
    cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, v.astype(c.dtype), slot, 2)
                  for c, v in zip(cache, new))  # fmt: skip
    return logits, cache


@pytest.fixture(scope="module")
def qwen_prompt():
    m = jaxmech.load(os.path.join(FIX, "qwen2_vl", "qwen2_vl"))
    images = [os.path.join(FIX, "qwen2_vl", f"padded{i}.png") for i in range(2)]
    enc = m.encode(images, ["Is the red circle left of the blue square?", "Where is it?"])
    return m, jax.tree.map(jnp.asarray, enc.inputs)


def _two_steps(step, params, inputs, config):
    """(logits, cache) after the prefill and two steps of `step` (greedy tokens)."""
    d = qwen.decoding(config)
    logits, cache, valid = gen._prefill(params, inputs, NO_EDITS, qwen.decoding, config, 4)
    out = []
    for k in range(2):
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        logits, cache = step(params, inputs, token, cache, valid, jnp.int32(k), d)[:2]
        valid = valid.at[:, inputs.tokens_BxS.shape[1] + k].set(True)
        out.append((logits, cache))
    return out


# bf16 (rows: the switch as `test_rows.py`'s scans; stacked: the unrolled path) slow; the
# scan in float32 in the suite
@pytest.mark.parametrize("held", ["float32"] + [pytest.param(h, marks=pytest.mark.slow)
                                                for h in ("bf16 rows", "bf16 stacked")])  # fmt: skip
def test_the_scanned_decode_step_equals_the_unrolled(qwen_prompt, held):
    """The step's logits and written cache as the unrolled blocks', two steps on a
    left-padded batch: float32 (the scan), bf16 held as rows on a CPU (the scan through
    the switch) and stacked bf16 (unrolled there, `models.scan.in_place`)."""
    m, inputs = qwen_prompt
    params = m.params
    if held != "float32":
        params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
        params["lm"] = scan.apart(params["lm"]) if held == "bf16 rows" else params["lm"]
    tol = TOL if held == "float32" else BF16_TOL
    step = jax.jit(gen.decode_step, static_argnums=6)
    want = jax.jit(_unrolled_step, static_argnums=6)
    for (g_logits, g_cache), (w_logits, w_cache) in zip(
        _two_steps(step, params, inputs, m.config), _two_steps(want, params, inputs, m.config)
    ):
        _close(g_logits, w_logits, tol)
        assert np.abs(np.asarray(g_logits)).max() > 1  # not a vacuous comparison
        for g, w in zip(g_cache, w_cache):
            assert g.shape == w.shape and g.shape[0] == m.config.lm_layers
            _close(g, w, tol)


def test_the_decode_step_does_not_grow_with_its_blocks():
    """One scan over the blocks: the step's program has as many ops for 2 blocks as for
    6 (unrolled, it grew by a block's ops per block)."""
    B, S, N = 1, 5, 3
    inputs = types.SimpleNamespace(tokens_BxS=jnp.zeros((B, S), jnp.int32))

    def ops(n):
        lay = layout.LMLayout(32, 4, 2, 8, 64, n, 50, True)
        lm = layout.init_from_shapes(layout.lm_shapes(lay), jax.random.PRNGKey(n))
        d = gen.Decoding(None, n, 1e-6, "silu", lambda inputs, k: jnp.zeros((B, 1, 4)))
        cache = tuple(jnp.zeros((n, B, S + N, 2, 8)) for _ in RESUME_SITES)
        valid = jnp.ones((B, S + N), bool)
        f = lambda lm, cache: gen.decode_step({"lm": lm}, inputs, jnp.zeros(B, jnp.int32),  # noqa: E731
                                              cache, valid, jnp.int32(0), d)  # fmt: skip
        jaxpr = jax.make_jaxpr(f)(lm, cache).jaxpr
        return len(jaxpr.eqns), sum(block_scan(e) for e in jaxpr.eqns)

    assert ops(2) == ops(6) and ops(6)[1] == 1


def test_generate_reads_a_stacked_model_inside_its_compiled_calls(qwen_prompt):
    """`generate(model=k)` on params stacked over models (a report's [K, ...], no eager
    copy of model k's weights) gives model k's tokens and logits; an index outside the
    stack is refused naming `model`."""
    m, inputs = qwen_prompt
    enc = types.SimpleNamespace(inputs=inputs)
    one = gen.generate(qwen.decoding, m.config, m.params, enc, max_new_tokens=3, logits=True)
    other = jax.tree.map(lambda w: w * 1.5, m.params)  # a second model that answers apart
    params_K = jax.tree.map(lambda a, b: jnp.stack([b, a]), m.params, other)
    got = gen.generate(qwen.decoding, m.config, params_K, enc, max_new_tokens=3, logits=True,
                       model=1)  # fmt: skip
    np.testing.assert_array_equal(got.tokens_BxN, one.tokens_BxN)
    _close(got.logits_BxNxV, one.logits_BxNxV)
    with pytest.raises(ValueError, match="model = 2"):
        gen.generate(qwen.decoding, m.config, params_K, enc, max_new_tokens=3, model=2)


# ---- mllama's LM -------------------------------------------------------------------------


def _unrolled_kinds(part, x, layers, kind_of, bodies, outer):
    """mllama's LM as it ran before the scan: layer after layer, each kind's body."""
    for i in layers:
        x = bodies[kind_of[i]](layout.block(part, i), x, outer, i)
    return x


@pytest.fixture(scope="module")
def mllama_case():
    """(config with 6 LM layers, cross-attention at 1 and 4; random params with gates
    away from 0; the fixture's two-image batch)."""
    folder = os.path.join(FIX, "mllama", "mllama")
    m = jaxmech.load(folder)
    ref = np.load(os.path.join(folder, "reference.npz"))
    qs = [t.split("<|image|>")[1].split("<|eot_id|>")[0] for t in ref["batch/prompt"]]
    enc = m.encode([os.path.join(FIX, "mllama", f"batch{i}.png") for i in range(2)], qs)
    c = dataclasses.replace(m.config, lm_layers=6, cross_layers=(1, 4))
    p = mparams.init_params(c, jax.random.PRNGKey(6))
    for i, g in ((1, 0.8), (4, -0.6)):
        p["lm"][f"block_{i}"] |= {"attn_gate": jnp.full((1,), g), "mlp_gate": jnp.full((1,), -g)}
    return c, p, enc.inputs


def _mllama(c, p, inputs, edits=NO_EDITS, capture=True, last_row=False, scanned=True):
    kinds = mllama.scan_kinds if scanned else _unrolled_kinds
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mllama, "scan_kinds", kinds)
        f = lambda p, inputs, edits: mllama.forward(p, inputs, edits, config=c, capture=capture,  # noqa: E731
                                                    last_row=last_row)  # fmt: skip
        return jax.jit(f)(p, inputs, edits)


# the whole scan without `last_row` also in the edit and capture tests below: slow here
@pytest.mark.parametrize("last_row", [pytest.param(False, marks=pytest.mark.slow), True])
def test_mllama_lm_scanned_equals_unrolled(mllama_case, last_row):
    """Logits and every site (both kinds' layers, the ViT's, `lm/final`) as unrolled, also
    under `last_row` (the last layer on its own, its last row)."""
    c, p, inputs = mllama_case
    got, aux = _mllama(c, p, inputs, last_row=last_row)
    want, want_aux = _mllama(c, p, inputs, last_row=last_row, scanned=False)
    _close(got, want)
    assert set(aux) == set(want_aux) and {"lm/vision.4", "lm/rot_k.5", "lm/pattern.1"} <= set(aux)
    for k, v in want_aux.items():
        assert aux[k].shape == v.shape, k
        _close(aux[k], v)


# slow (~8 s: unrolled references of three edited forwards); in the suite edits by layer
# inside a scan are `test_scan.py`'s (the same `LayerSites`), and this scan's per-kind
# slots the capture test below
@pytest.mark.slow
def test_mllama_an_edit_at_one_layer_acts_there_only(mllama_case):
    """An add at a cross layer's `resid_mid` and a replace at a self layer's `q`: scanned
    as unrolled; the layers before untouched, the edited site plain + delta, the layers
    after changed; the other layer of the same kind's site unchanged before the edit."""
    c, p, inputs = mllama_case
    plain, plain_aux = _mllama(c, p, inputs)
    x = plain_aux["lm/resid_mid.4"]
    delta = 0.5 * jax.random.normal(jax.random.PRNGKey(1), x.shape)
    q3 = plain_aux["lm/q.3"]
    edits = Edits(add={"lm/resid_mid.4": delta}, replace={"lm/q.3": (True, jnp.zeros_like(q3))})
    got, aux = _mllama(c, p, inputs, edits)
    want, want_aux = _mllama(c, p, inputs, edits, scanned=False)
    _close(got, want)
    for k, v in want_aux.items():
        _close(aux[k], v)
    for k in ("lm/resid_mid.1", "lm/q.2", "lm/pattern.1"):
        _close(aux[k], plain_aux[k], 0)
    assert not np.any(np.asarray(aux["lm/q.3"]))
    edited_in = aux["lm/resid_pre.4"]  # the q edit at 3 changed what enters 4
    assert np.abs(np.asarray(edited_in - plain_aux["lm/resid_pre.4"])).max() > 1e-4
    _, only_q = _mllama(c, p, inputs, Edits(replace=edits.replace))
    _close(aux["lm/resid_mid.4"], only_q["lm/resid_mid.4"] + delta)
    assert np.abs(np.asarray(got - plain)).max() > 1e-3


def test_mllama_a_capture_of_some_layers_equals_the_full_capture(mllama_case):
    c, p, inputs = mllama_case
    _, full = _mllama(c, p, inputs)
    asked = ("lm/pattern.1", "lm/pattern.3", "lm/resid_pre.0", "lm/z", "lm/vision")
    _, aux = _mllama(c, p, inputs, capture=asked)
    want = {"lm/pattern.1", "lm/pattern.3", "lm/resid_pre.0", "lm/vision.1", "lm/vision.4"}
    want |= {f"lm/z.{i}" for i in range(c.lm_layers)}
    assert set(aux) == want
    for k in want:
        _close(aux[k], full[k], 0)


@pytest.mark.slow  # ~16 s: three gradient compiles of the whole model
def test_mllama_gradients_through_the_scan_equal_the_unrolled(mllama_case):
    """The LM params' gradients through the scan as unrolled, also with the scan's steps
    rematerialised (`remat="full"`: values unchanged)."""
    c, p, inputs = mllama_case

    def loss(lm, scanned, remat="off"):
        q = {**p, "lm": lm}
        cr = dataclasses.replace(c, remat=remat)
        return jnp.sum(_mllama(cr, q, inputs, capture=False, scanned=scanned)[0][:, -1] ** 2)

    want = jax.grad(loss)(p["lm"], False)
    for got in (jax.grad(loss)(p["lm"], True), jax.grad(loss)(p["lm"], True, "full")):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.abs(np.asarray(w)).max() > 0
            _close(g, w, 1e-4 * max(1.0, float(np.abs(np.asarray(w)).max())))


def test_mllama_lm_does_not_grow_with_its_layers(mllama_case):
    """One scan for the LM (beside the local ViT layers'; the fixture's one global layer
    runs on its own): the forward's ops the same for 4 LM layers (one cross) as for 8
    (two cross)."""
    c, _, inputs = mllama_case

    def ops(n, cross):
        cn = dataclasses.replace(c, lm_layers=n, cross_layers=cross)
        p = mparams.init_params(cn, jax.random.PRNGKey(0))
        f = lambda p: mllama.forward(p, inputs, config=cn)[0]  # noqa: E731
        jaxpr = jax.make_jaxpr(f)(p).jaxpr
        return len(jaxpr.eqns), sum(block_scan(e) for e in jaxpr.eqns)

    assert ops(4, (2,)) == ops(8, (2, 5)) and ops(8, (2, 5))[1] == 2
