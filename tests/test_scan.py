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
from conftest import block_scan

import jaxmech
from jaxmech.families.gemma3 import model as gemma
from jaxmech.families.internvl import model as internvl
from jaxmech.families.llava import model as llava
from jaxmech.families.mllama import model as mllama
from jaxmech.families.qwen2_vl import model as qwen
from jaxmech.families.qwen2_vl import positions as qpos
from jaxmech.models import hub, layout, scan
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
        scans = [e for e in jaxpr.jaxpr.eqns if block_scan(e)]
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
    maps = [e for e in eqns if block_scan(e) and _scans(e.params["jaxpr"].jaxpr)]
    assert len(maps) == len(plan)  # per group, a lax.map over the layers of a resumed LM


def _scans(jaxpr) -> int:
    """How many scans a jaxpr holds at any depth."""
    n = 0
    for e in jaxpr.eqns:
        n += block_scan(e)
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                n += _scans(inner) if hasattr(inner, "eqns") else 0
    return n


# The ViTs (`models.scan.run_blocks`): their per-block weights (`vit/block_{i}`) read as
# rows, one scan over the blocks. The unrolled reference is the loop that runs where
# `scans_part` says no (low-precision weights on a CPU), chosen here by patching it.
VITS = {
    "qwen2_vl": (QWEN, "single0.png", qwen),
    "qwen2_5_vl": (os.path.join(FIX, "qwen2_vl", "qwen2_5_vl"), "single0.png", qwen),
    "qwen3_vl": (os.path.join(FIX, "qwen3_vl", "qwen3_vl"), "single0.png", qwen),
    "llava": (os.path.join(FIX, "llava", "llava"), "single0.png", llava),
    "gemma3": (GEMMA, "single0.png", gemma),
    "internvl": (os.path.join(FIX, "internvl", "internvl"), "batch0.png", internvl),
    "mllama": (os.path.join(FIX, "mllama", "mllama"), "single0.png", mllama),
}
# float32, the same ops fused otherwise: seen <= 4.1e-6 (Gemma-3's logits, ~ 2^-18:
# a few ulps of values ~ 1-10)
VIT_TOL = 1e-5


@functools.cache
def _vit_fixture(name):
    folder, image, model = VITS[name]
    return *_enc(folder, [image], "Is the red circle left of the blue square?"), model


def _vit_forward(name, edits, scanned: bool, monkeypatch, capture=True):
    """(logits, aux, how many scans the program runs) of a ViT fixture's forward."""
    m, enc, model = _vit_fixture(name)
    if not scanned:
        monkeypatch.setattr(scan, "scans_part", lambda *a: False)
    f = jax.jit(lambda p, e: model.forward(p, enc.inputs, e, config=m.config, capture=capture))
    logits, aux = f(m.params, edits)
    n_scans = _scans(jax.make_jaxpr(f)(m.params, edits).jaxpr)
    monkeypatch.undo()
    return logits, aux, n_scans


# in the suite: DeepStack taps, a position table, windows off (Qwen3-VL) and the
# projector's tap before the last block (LLaVA); the others (~ 5 s each) in the slow set
IN_SUITE = ("qwen3_vl", "llava")


@pytest.mark.parametrize(
    "name", [n if n in IN_SUITE else pytest.param(n, marks=pytest.mark.slow) for n in VITS]
)
def test_vit_scanned_equals_unrolled(name, monkeypatch):
    """Every family's ViT under the scan: every site and the logits as the unrolled
    blocks', with an edit at one block too; that edit leaves the blocks before it as
    they were and adds exactly its value there."""
    plain, plain_aux, n_plain = _vit_forward(name, NO_EDITS, True, monkeypatch)
    shape = plain_aux["vit/resid_mid.1"].shape  # every family's ViT has 2+ blocks
    delta = 0.5 * jax.random.normal(jax.random.PRNGKey(2), shape)
    edits = Edits(add={"vit/resid_mid.1": delta})
    got, aux, n_scans = _vit_forward(name, edits, True, monkeypatch)
    want, want_aux, n_unrolled = _vit_forward(name, edits, False, monkeypatch)
    assert n_scans == n_plain == n_unrolled + 1  # the ViT's one scan (and the LM's)
    assert set(aux) == set(want_aux)
    _close(got, want, VIT_TOL)
    for k, v in want_aux.items():
        _close(aux[k], v, VIT_TOL)
    block_0 = [k for k in aux if k.startswith("vit/") and k.endswith(".0")]
    assert len(block_0) >= 10
    for k in block_0 + ["vit/resid_pre.1", "vit/attn_out.1"]:
        _close(aux[k], plain_aux[k], 0)
    _close(aux["vit/resid_mid.1"], plain_aux["vit/resid_mid.1"] + delta, 0)
    assert np.abs(np.asarray(aux["vit/mlp_out.1"] - plain_aux["vit/mlp_out.1"])).max() > 1e-4


def _vit_only(name, edits, scanned: bool, monkeypatch):
    """(the image features, the DeepStack features; every ViT site) of a Qwen fixture's
    ViT alone (no LM to compile)."""
    m, enc, _ = _vit_fixture(name)
    if not scanned:
        monkeypatch.setattr(scan, "scans_part", lambda *a: False)

    @jax.jit
    def f(p, e):
        site = Sites(e, True)
        return qwen.vision(p, enc.inputs, m.config, e, site), site.aux

    out = f(m.params, edits)
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("name", [pytest.param("qwen2_vl", marks=pytest.mark.slow), "qwen3_vl"])
def test_a_vit_position_edit_at_one_block_acts_there_only(name, monkeypatch):
    """A per-block ViT position edit (`Edits.vit_rows` [n, P], one row a block; with a
    position table, row 0 the table's) moving block 1's rows only, by a fractional
    amount: scanned as unrolled, block 0's rotary inputs as without it, block 1's not."""
    m, enc, _ = _vit_fixture(name)
    c, rows = m.config, np.asarray(enc.inputs.rows_BxP[0], np.float32)
    table = int(bool(c.vit_pos_table))
    edit = np.tile(rows, (table + c.vit_depth, 1))
    edit[table + 1] += 1.5
    edits = Edits(vit_rows=jnp.asarray(edit))
    plain = _vit_only(name, NO_EDITS, True, monkeypatch)[1]
    got, aux = _vit_only(name, edits, True, monkeypatch)
    want, want_aux = _vit_only(name, edits, False, monkeypatch)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        _close(a, b, VIT_TOL)
    for k, v in want_aux.items():
        _close(aux[k], v, VIT_TOL)
    _close(aux["vit/rot_q.0"], plain["vit/rot_q.0"], 0)
    _close(aux["vit/q.1"], plain["vit/q.1"], 0)  # block 1's input: as before
    assert np.abs(np.asarray(aux["vit/rot_q.1"] - plain["vit/rot_q.1"])).max() > 1e-3


def _qwen_vit_ops(depth: int, stacked: bool, compiled: bool = False):
    """(ops, scans) of the Qwen2-VL fixture's ViT at `depth` blocks (random weights),
    per block (`vit/block_{i}`) or stacked (`layout.BLOCKS`): the jaxpr's top-level
    equations, or with `compiled` the compiled HLO's instructions and loops."""
    import dataclasses

    from jaxmech.families.qwen2_vl import params as qparams

    m, enc, _ = _vit_fixture("qwen2_vl")
    c = dataclasses.replace(m.config, vit_depth=depth)
    p = qparams.init_params(c, jax.random.PRNGKey(0))
    if stacked:
        blocks = [p["vit"].pop(f"block_{i}") for i in range(depth)]
        p["vit"][layout.BLOCKS] = jax.tree_util.tree_map(lambda *w: jnp.stack(w), *blocks)

    def f(p):
        return qwen.vision(p, enc.inputs, c, NO_EDITS, Sites(NO_EDITS, False))

    if compiled:
        text = jax.jit(f).lower(p).compile().as_text()
        return sum(" = " in line for line in text.splitlines()), text.count(" while(")
    eqns = jax.make_jaxpr(f)(p).jaxpr.eqns
    return len(eqns), sum(block_scan(e) for e in eqns)


def test_one_vit_block_body_however_many_blocks():
    """The ViT's program does not grow with its blocks: one scan and the same number of
    operations for 2 and 6 blocks, stored per block (read through a switch) or stacked;
    compiled, a stacked ViT's HLO is the same size at both depths."""
    for stacked in (False, True):
        assert _qwen_vit_ops(2, stacked) == _qwen_vit_ops(6, stacked)
        assert _qwen_vit_ops(6, stacked)[1] == 1
    assert _qwen_vit_ops(2, True, True) == _qwen_vit_ops(6, True, True)


def test_a_stacked_vit_scans_as_one_stored_per_block():
    """A ViT stored stacked (`layout.BLOCKS`, read in place) gives what the same weights
    stored per block (read through a switch) give, bit for bit."""
    m, enc, _ = _vit_fixture("qwen3_vl")
    c, vit = m.config, m.params["vit"]
    blocks = [vit[f"block_{i}"] for i in range(c.vit_depth)]
    rest = {k: v for k, v in vit.items() if not k.startswith("block_")}
    stacked = rest | {layout.BLOCKS: jax.tree_util.tree_map(lambda *w: jnp.stack(w), *blocks)}

    @jax.jit
    def f(vit):
        site = Sites(NO_EDITS, ["vit/pattern", "vit/resid_post"])
        return qwen.vision({**m.params, "vit": vit}, enc.inputs, c, NO_EDITS, site), site.aux

    for a, b in zip(jax.tree_util.tree_leaves(f(vit)), jax.tree_util.tree_leaves(f(stacked))):
        _close(a, b, 0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's rule")
def test_a_low_precision_vit_on_a_cpu_scans_too():
    """ViT blocks are stored apart (`block_{i}`), so bf16 ones on a CPU scan as float32
    ones do, each step's block picked by a switch (`scan.in_place` on rows): no stacked
    bf16 leaf is sliced (XLA's CPU backend would convert it whole)."""
    m, enc, _ = _vit_fixture("qwen2_vl")

    def scans(dtype):
        p = jax.tree_util.tree_map(lambda w: w.astype(dtype), m.params)
        f = lambda p: qwen.vision(p, enc.inputs, m.config, NO_EDITS, Sites(NO_EDITS, False))  # noqa: E731
        return _scans(jax.make_jaxpr(f)(p).jaxpr)

    assert scans(jnp.bfloat16) == 1 and scans(jnp.float32) == 1


@pytest.mark.slow  # ~6 s (two gradient compiles); the fine-tune tests train through it
def test_vit_gradients_through_the_scan_equal_the_unrolled(monkeypatch):
    """The fine-tunes differentiate the ViT's per-block leaves (through the scan's
    switch): the gradient of a feature sum for block 1's MLP and block 0's query weights
    (the rest frozen, as `finetune` does) equals the unrolled blocks'."""
    m, enc, _ = _vit_fixture("qwen2_vl")
    c = m.config
    trained = {(1, "W_in"), (1, "W_out"), (0, "W_Q")}

    def loss(w):
        vit = dict(m.params["vit"])
        for i in range(c.vit_depth):
            b = jax.tree_util.tree_map(jax.lax.stop_gradient, vit[f"block_{i}"])
            vit[f"block_{i}"] = b | {k: w[f"{i}/{k}"] for j, k in trained if j == i}
        site = Sites(NO_EDITS, False)
        feats = qwen.vision({**m.params, "vit": vit}, enc.inputs, c, NO_EDITS, site)[0]
        return jnp.sum(jnp.sin(feats))

    w = {f"{i}/{k}": m.params["vit"][f"block_{i}"][k] for i, k in trained}
    got = jax.jit(jax.grad(loss))(w)
    monkeypatch.setattr(scan, "scans_part", lambda *a: False)
    want = jax.jit(jax.grad(loss))(w)
    for k in w:
        assert np.abs(np.asarray(want[k])).max() > 0
        _close(got[k], want[k], VIT_TOL)


def test_mllama_gated_global_layers_scanned_equal_unrolled(monkeypatch):
    """Llama-3.2-Vision's gated global ViT layers (the fixture has one: unrolled) at 3
    layers under the scan (random weights, gates non-zero) as unrolled, every site."""
    import dataclasses

    from jaxmech.families.mllama import params as mparams

    m, enc, _ = _vit_fixture("mllama")
    c = dataclasses.replace(m.config, vit_global_depth=3)
    p = mparams.init_params(c, jax.random.PRNGKey(3))
    for i in range(3):  # tanh gates away from 0, so each branch counts
        p["vit"][f"global_block_{i}"] |= {"gate_attn": jnp.full((1,), 0.5 + i),
                                          "gate_ffn": jnp.full((1,), -0.7)}  # fmt: skip

    def run(p):
        site = Sites(NO_EDITS, True)
        return mllama.vision(p, enc.inputs, c, NO_EDITS, site), site.aux

    got, aux = jax.jit(run)(p)
    assert _scans(jax.make_jaxpr(run)(p).jaxpr) == 2  # the local stack's, the global's
    monkeypatch.setattr(scan, "scans_part", lambda *a: False)
    want, want_aux = jax.jit(run)(p)
    assert set(aux) == set(want_aux) and "vit_global/resid_post.2" in aux
    _close(got, want, VIT_TOL)
    for k, v in want_aux.items():
        _close(aux[k], v, VIT_TOL)
