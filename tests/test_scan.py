"""The loaded families' LM blocks under one `lax.scan` over stacked weights
(`models.scan`, `models.decoder.stack`): equal to the unrolled blocks written here from
`models.layout.block` (Qwen2-VL and Gemma-3's fixtures), an edit at one layer touching
that layer only, a capture of some layers equal to the full capture's, a resume from a
traced layer equal to one from a static layer, one block body compiled however many
blocks, the key map's stacked leaves and their sharding."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmech
from jaxmech.families.gemma3 import model as gemma
from jaxmech.families.qwen2_vl import model as qwen
from jaxmech.families.qwen2_vl import positions as qpos
from jaxmech.models import hub, layout
from jaxmech.models.decoder import (
    ACT,
    RESUME_SITES,
    Resume,
    Sites,
    block_forward,
    lm_mask,
    logits_at,
    rms_norm,
    run_lm,
)
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.models.positions import rotary_angles

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN = os.path.join(FIX, "qwen2_vl", "qwen2_vl")
GEMMA = os.path.join(FIX, "gemma3", "gemma3")
TOL = 1e-5  # the same float32 ops in one order; seen: <= 1e-6


def _enc(folder, images, question):
    m = jaxmech.load(folder)
    return m, m.encode([os.path.join(os.path.dirname(folder), i) for i in images], [question])


@pytest.fixture(scope="module")
def qwen_run():
    """(model, inputs, the LM's input [1, S, D]) of the Qwen2-VL fixture."""
    m, enc = _enc(QWEN, ["single0.png"], "Is the red circle left of the blue square?")
    return m, enc.inputs, m.params["lm"]["E"][enc.inputs.tokens_BxS]  # any input serves


def _qwen_angles(c, inputs):
    freq = qpos.inv_freq(c.lm_head_dim, c.lm_rope_theta)
    return qpos.lm_angles(inputs.pos_Bx3xS, freq, c.lm_mrope_section, c.lm_mrope_interleaved)


@functools.partial(jax.jit, static_argnums=0)
def _unrolled(c, lm, inputs, x, edits):
    """The LM as it ran before the scan: one block after another, block i's weights
    from the accessor."""
    site = Sites(edits, True)
    angles, causal = _qwen_angles(c, inputs), lm_mask(jnp.asarray(inputs.valid_BxS, bool))
    for i in range(c.lm_layers):
        x = block_forward(layout.block(lm, i), x, angles, causal, site, "lm", i, c.lm_eps,
                          ACT["silu"])  # fmt: skip
    return rms_norm(x, lm["lnf_w"], c.lm_eps), site.aux


def _qwen_unrolled(m, inputs, x, edits=NO_EDITS):
    return _unrolled(m.config, m.params["lm"], inputs, x, edits)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _scanned(c, lm, inputs, x, edits, capture):
    site = Sites(edits, capture if isinstance(capture, bool) else list(capture))
    out = qwen.language_model(lm, x, inputs.pos_Bx3xS, inputs.valid_BxS, c, site)
    return out, site.aux


def _qwen_scanned(m, inputs, x, edits=NO_EDITS, capture=True):
    capture = capture if isinstance(capture, bool) else tuple(capture)
    return _scanned(m.config, m.params["lm"], inputs, x, edits, capture)


def _close(a, b, tol=TOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=0)


def test_qwen2_vl_scanned_equals_unrolled(qwen_run):
    m, inputs, x = qwen_run
    want, want_aux = _qwen_unrolled(m, inputs, x)
    got, aux = _qwen_scanned(m, inputs, x)
    _close(got, want)
    assert set(aux) == set(want_aux) | {"lm/final"} and len(want_aux) == 13 * m.config.lm_layers
    for k, v in want_aux.items():
        _close(aux[k], v)


def test_an_edit_at_one_layer_touches_that_layer_only(qwen_run):
    m, inputs, x = qwen_run
    delta = 0.5 * jax.random.normal(jax.random.PRNGKey(0), x.shape)
    edits = Edits(add={"lm/resid_mid.0": delta})
    plain, plain_aux = _qwen_scanned(m, inputs, x)
    got, aux = _qwen_scanned(m, inputs, x, edits)
    want, want_aux = _qwen_unrolled(m, inputs, x, edits)
    _close(got, want)
    for k, v in want_aux.items():
        _close(aux[k], v)
    # before the edit, as plain; at it, plain + delta; after it, changed
    for k in ("lm/resid_pre.0", "lm/q.0", "lm/pattern.0", "lm/attn_out.0"):
        _close(aux[k], plain_aux[k], 0)
    _close(aux["lm/resid_mid.0"], plain_aux["lm/resid_mid.0"] + delta)
    assert np.abs(np.asarray(aux["lm/resid_pre.1"] - plain_aux["lm/resid_pre.1"])).max() > 1e-3
    # a replace at layer 1 only: layer 0 untouched
    edits = Edits(replace={"lm/resid_pre.1": (True, jnp.zeros_like(x))})
    _, aux = _qwen_scanned(m, inputs, x, edits)
    _close(aux["lm/resid_post.0"], plain_aux["lm/resid_post.0"], 0)
    assert not np.any(np.asarray(aux["lm/resid_pre.1"]))


def test_a_capture_of_some_layers_equals_the_full_capture(qwen_run):
    m, inputs, x = qwen_run
    _, full = _qwen_scanned(m, inputs, x)
    asked = ["lm/pattern.1", "lm/resid_pre.0", "lm/z"]
    _, aux = _qwen_scanned(m, inputs, x, capture=asked)
    want = {"lm/pattern.1", "lm/resid_pre.0"} | {f"lm/z.{i}" for i in range(m.config.lm_layers)}
    assert set(aux) == want
    for k in want:
        _close(aux[k], full[k], 0)


def test_resume_from_a_traced_layer_equals_the_static_one(qwen_run):
    m, inputs, x = qwen_run
    c, s0 = m.config, 5
    full, aux = _qwen_scanned(m, inputs, x, capture=["lm/resid_pre", *RESUME_SITES])
    resid = {k: v for k, v in aux.items() if k.startswith("lm/resid_pre")}
    aux = {k: v for k, v in aux.items() if k.split(".")[0] in RESUME_SITES}

    def run(p, y, x_y, aux):
        return qwen.forward(p, inputs, config=c, last_row=True, resume=Resume(y, s0, x_y, aux))[0]

    static = jax.jit(run, static_argnums=1)
    traced = jax.jit(run)
    plain = logits_at(m.params["lm"], full, last_row=True)  # the run resumed from
    for layer in range(c.lm_layers):
        x_y = resid[f"lm/resid_pre.{layer}"][:, s0:]
        want = static(m.params, layer, x_y, aux)
        got = traced(m.params, jnp.int32(layer), x_y, aux)
        _close(got, want, 1e-4)
        _close(got, plain, 1e-4)


def _toy_lm(n_layers):
    lay = layout.LMLayout(32, 4, 2, 8, 64, n_layers, 50, True, qkv_bias=True)
    return layout.init_from_shapes(layout.lm_shapes(lay), jax.random.PRNGKey(n_layers))


def test_one_block_body_however_many_blocks():
    """The LM's program does not grow with its blocks (an unrolled one grows by a block's
    ops per block): one scan, the same number of ops for 2 and 6 blocks, and under
    `last_row` one block more (the last, run on its own)."""
    S = 7
    x = jnp.ones((1, S, 32))
    angles = jnp.zeros((1, S, 4))
    valid = jnp.ones((1, S), bool)

    def ops(n, last_row=False, capture=False):
        lm = _toy_lm(n)
        f = lambda lm, x: run_lm(lm, x, angles, valid, n, 1e-6, Sites(NO_EDITS, capture),  # noqa: E731
                                 last_row=last_row)  # fmt: skip
        jaxpr = jax.make_jaxpr(f)(lm, x)
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        return len(jaxpr.jaxpr.eqns), len(scans)

    assert ops(2) == ops(6) and ops(6)[1] == 1
    assert ops(2, capture=["lm/resid_pre.1"]) == ops(6, capture=["lm/resid_pre.1"])
    assert ops(3, last_row=True) == ops(6, last_row=True)


def test_gemma3_scanned_equals_unrolled():
    """Gemma-3's sliding-window and global layers (their masks and rotary tables switched
    by the layer's index in the scan) as the unrolled blocks, edits and captures too."""
    m, enc = _enc(GEMMA, ["single0.png"], "Is the red circle left of the blue square?")
    c, inputs = m.config, enc.inputs
    assert len(set(c.lm_layer_types)) == 2  # both kinds in the fixture
    x0 = gemma.embed(m.params["lm"], inputs.tokens_BxS, c)  # any input serves
    masks = gemma.lm_masks(inputs.valid_BxS, inputs.image_BxI, c, True)
    delta = 0.1 * jax.random.normal(jax.random.PRNGKey(1), x0.shape)
    edits = Edits(add={f"lm/attn_out.{c.lm_layers - 1}": delta})

    @jax.jit
    def unrolled(lm, x, edits):
        site = Sites(edits, True)
        for i in range(c.lm_layers):
            kind = c.lm_layer_types[i]
            angles = rotary_angles(inputs.pos_BxS, gemma.rotary(c, kind))
            x = gemma.gemma_block(layout.block(lm, i), x, angles, masks[kind], site, i, c)
        return gemma.gemma_norm(x, lm["lnf_w"], c.lm_eps), site.aux

    @jax.jit
    def scanned(lm, x, edits):
        site = Sites(edits, True)
        return gemma.run_lm(lm, x, inputs.pos_BxS, masks, c, site), site.aux

    want, want_aux = unrolled(m.params["lm"], x0, edits)
    got, aux = scanned(m.params["lm"], x0, edits)
    _close(got, want)
    for k, v in want_aux.items():
        _close(aux[k], v)
    assert (
        np.abs(
            np.asarray(
                aux["lm/attn_out.0"] - scanned(m.params["lm"], x0, NO_EDITS)[1]["lm/attn_out.0"]
            )
        ).max()
        == 0
    )  # the edit's layer is the last


def test_key_map_writes_layer_i_at_row_i():
    """The loaded stacked leaves hold the stored layer i at row i; the accessor reads it."""
    c, p = jaxmech.load(QWEN).config, jaxmech.load(QWEN).params
    stored = hub.Stored(hub.weight_files(QWEN), qwen_canonical())
    blocks = p["lm"][layout.BLOCKS]
    assert blocks["W_in"].shape[0] == c.lm_layers and "block_0" not in p["lm"]
    for i in range(c.lm_layers):
        w = stored.array(f"lm.layers.{i}.mlp.up_proj.weight")
        np.testing.assert_array_equal(np.asarray(layout.block(p["lm"], i)["W_in"]), w.T)


def qwen_canonical():
    from jaxmech.families.qwen2_vl.load import canonical

    return canonical


def test_sharding_never_splits_the_block_axis():
    devices = jax.devices()
    spec = hub._sharding((4 * len(devices) * 8, 2, 3 * len(devices)), devices, stacked=True).spec
    assert spec[0] is None and spec[2] == "d"
    # a stacked vector ([L, D]): one axis but the block axis, replicated like any vector
    assert all(a is None for a in hub._sharding((8, 16), devices, stacked=True).spec)


def fixture_table(m):
    """(patch(view) -> `patch_logp`'s dict, the view, the resume plan): a patching table
    of the Qwen2-VL fixture loaded as `m`, every LM layer, the mirror twins."""
    from jaxmech.analysis.patching import patch_logp, resume_plan, token_groups
    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.families.qwen2_vl.view import checkpoint_view
    from jaxmech.families.vlm_view import examples

    view = checkpoint_view(QWEN, m.config, Grid(4, 4), 112)
    specs = pair_questions(view.grid, 2, view.n_labels, view.n_colours, seed=1)
    ex = examples(view, specs["examples"])
    mirror = view.render(specs["mirror"], ask=specs["examples"])[0]
    groups = token_groups(ex.spans)
    plan = resume_plan(view, groups, np.asarray(ex.spans.image_BxI)[:, 0])
    layers = tuple(range(m.config.lm_layers))

    def patch(v):
        return patch_logp(v, m.params, ex.inputs, mirror, groups, ex.answer_B, ex.other_B,
                          layers, plan=plan)  # fmt: skip

    return patch, view, plan


def test_the_patching_table_resumes_every_layer_in_one_program():
    """Where the view takes a traced layer (`resume_any_layer`), a patching table's
    resumed runs are one `lax.map` over the layers per group: the same values as one
    resumed LM per layer and group, and the program has one resumed LM per group."""
    patch, view, plan = fixture_table(jaxmech.load(QWEN))
    assert view.resume_any_layer
    per_layer = view._replace(resume_any_layer=False)
    got, want = jax.jit(lambda: (patch(view), patch(per_layer)))()
    np.testing.assert_allclose(got["patched"], want["patched"], atol=1e-5)
    assert np.abs(np.asarray(got["patched"] - got["orig"])).max() > 1e-4  # patches act
    eqns = jax.make_jaxpr(lambda: patch(view))().jaxpr.eqns
    maps = [e for e in eqns if e.primitive.name == "scan" and _scans(e.params["jaxpr"].jaxpr)]
    assert len(maps) == len(plan)  # per group, a lax.map over the layers of a resumed LM


def _scans(jaxpr) -> int:
    """How many scans a jaxpr holds at any depth."""
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == "scan"
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                n += _scans(inner) if hasattr(inner, "eqns") else 0
    return n
