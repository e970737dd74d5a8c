"""Low-precision LM blocks on a CPU held one array a block (`models.layout.Rows`,
`models.scan.held_apart`): what the loader places, run one after another the same
values as the stacked bf16 path (bit for bit), scanned (a switch picking each block's
rows, the default) within bf16 rounding of it, the same sites, and
in the compiled forward no copy of an MLP weight (the stacked path copies each one as
its static slice). Under a traced `Resume.layer` the rows scan, a switch picking each
block's (`models.scan.block_row`): a patching table compiles one block per group, not one
unrolled LM per layer and group, its values and scratch as the per-layer path's."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import block_scan

import jaxmech
from jaxmech.families.qwen2_vl import model as qwen
from jaxmech.models import decoder, layout, scan
from jaxmech.models.attention import n_blocks
from jaxmech.models.edits import Edits

QWEN = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
MLP = ("W_in", "W_gate", "W_out")

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU's layout")


@pytest.fixture(scope="module")
def bf16():
    """(the fixture loaded in bfloat16, its inputs for one picture and question)."""
    m = jaxmech.load(QWEN, dtype=jnp.bfloat16)
    png = os.path.join(os.path.dirname(QWEN), "single0.png")
    return m, m.encode([png], ["Is the red circle left of the blue square?"]).inputs


def _stacked(params):
    """`params` with the LM's `Rows` stacked again (the layout before `held_apart`)."""
    blocks = {k: jnp.stack(w.rows) if isinstance(w, layout.Rows) else w
              for k, w in params["lm"][layout.BLOCKS].items()}  # fmt: skip
    return {**params, "lm": {**params["lm"], layout.BLOCKS: blocks}}


def _forward(m, capture=True, edits=None):
    f = lambda p, x: m.family.forward(p, x, edits=edits, config=m.config, capture=capture)  # noqa: E731
    return jax.jit(f)


def test_a_bf16_load_on_a_cpu_places_each_block_apart(bf16):
    m, _ = bf16
    f32 = jaxmech.load(QWEN)
    blocks, want = m.params["lm"][layout.BLOCKS], f32.params["lm"][layout.BLOCKS]
    assert set(blocks) == set(want)
    for k, w in blocks.items():
        assert isinstance(w, layout.Rows) and w.shape == want[k].shape, k
        assert w.dtype == jnp.bfloat16 and isinstance(want[k], jax.Array)
        for i in range(len(w)):  # row i is stored layer i, as the stacked leaf's row i
            np.testing.assert_array_equal(
                np.asarray(w[i], np.float32),
                np.asarray(want[k][i].astype(jnp.bfloat16), np.float32),
            )
    assert m.sites() == f32.sites()
    assert n_blocks(m.params["lm"]) == n_blocks(f32.params["lm"]) == m.config.lm_layers
    with pytest.raises(TypeError, match="Python int"):
        blocks["W_in"][0:1]


def test_rows_equal_the_stacked_bf16_forward_bit_for_bit_and_scan_within_rounding(
    bf16, monkeypatch
):
    """Every site and the logits, with an edit at the last layer (the sites before it
    unedited): held apart and run one after another, the blocks compute what the
    stacked bf16 path (static slices, tied) computed, bit for bit; scanned (the default:
    a switch picks each block's rows) the logits within a few bf16 ulps of that. In the
    suite (three compiles of the fixture's forward, ~5 s of CPU): every loaded bf16
    model on a CPU runs this path."""
    m, inputs = bf16
    delta = jnp.full((m.config.lm_width,), 0.25, jnp.bfloat16)
    edits = Edits(add={f"lm/resid_mid.{m.config.lm_layers - 1}": delta})
    scanned = np.asarray(_forward(m, edits=edits)(m.params, inputs)[0], np.float32)
    lowered = jax.make_jaxpr(lambda p: m.family.forward(p, inputs, config=m.config))(m.params)
    assert any(block_scan(e) for e in lowered.jaxpr.eqns)
    monkeypatch.setattr(decoder, "in_place", lambda stacked: False)  # the blocks unrolled
    got, aux = _forward(m, edits=edits)(m.params, inputs)
    want, want_aux = _forward(m, edits=edits)(_stacked(m.params), inputs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert set(aux) == set(want_aux) and len(aux) > 13 * m.config.lm_layers
    for k, v in want_aux.items():
        np.testing.assert_array_equal(np.asarray(aux[k], np.float32), np.asarray(v, np.float32))
    want = np.asarray(want, np.float32)
    ulp = 2.0**-7 * np.abs(want).max()  # bf16's spacing at the largest logit
    assert np.abs(scanned - want).max() <= 4 * ulp, (np.abs(scanned - want).max(), ulp)


def test_scanned_bf16_equals_rows_within_rounding(bf16, monkeypatch):
    """The scan (what an accelerator runs) on the stacked bf16 leaves against the rows'
    scan (a switch picking each block): the same ops, up to XLA's excess precision (a
    few bf16 ulps)."""
    m, inputs = bf16
    got = _forward(m, capture=False)(m.params, inputs)[0]
    monkeypatch.setattr(decoder, "in_place", lambda stacked: True)
    jaxpr = jax.make_jaxpr(lambda p: m.family.forward(p, inputs, config=m.config))(
        _stacked(m.params)
    )
    assert any(block_scan(e) for e in jaxpr.jaxpr.eqns)
    want = _forward(m, capture=False)(_stacked(m.params), inputs)[0]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ulp = 2.0**-7 * np.abs(want).max()  # bf16's spacing at the largest logit
    assert np.abs(got - want).max() <= 4 * ulp, (np.abs(got - want).max(), ulp)


def _mlp_copies(m, params, inputs) -> int:
    """How many ops of the compiled forward's entry read an LM MLP weight parameter and
    make a value of that weight's size (a copy: a product's output is [.., S, M])."""
    hlo = _forward(m, capture=False).lower(params, inputs).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    line = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = \w+\[([\d,]*)\]\{[^}]*\} ([\w-]+)\((.*?)\)")
    sizes, copies = {}, 0
    for text in entry.splitlines():
        hit = line.match(text)
        if not hit:
            continue
        name, shape, op, operands = hit.groups()
        dims = [int(d) for d in shape.split(",") if d]
        if op == "parameter":
            if any(f"blocks____{w}_" in name for w in MLP):
                sizes[name] = int(np.prod(dims[-2:]))  # one block's
            continue
        read = [sizes[o] for o in re.findall(r"%[\w.\-]+", operands) if o in sizes]
        copies += bool(read) and int(np.prod(dims)) in read
    assert sizes, "no MLP weight parameter found in the compiled entry"
    return copies


def test_no_mlp_weight_is_copied_with_bf16_products(bf16, monkeypatch):
    """With bf16 products the MLP's weights go to their products as stored: no copy of
    them in the compiled program held apart, where the stacked path copies each one of
    every block (its static slice)."""
    monkeypatch.setenv("JAXMECH_BF16_PRODUCTS", "on")
    m, inputs = bf16
    assert _mlp_copies(m, m.params, inputs) == 0
    assert _mlp_copies(m, _stacked(m.params), inputs) == len(MLP) * m.config.lm_layers


def test_apart_holds_low_precision_blocks_as_rows_only():
    lay = layout.LMLayout(32, 4, 2, 8, 64, 3, 50, True)
    lm = layout.init_from_shapes(layout.lm_shapes(lay), jax.random.PRNGKey(0))
    assert scan.apart(lm) is lm  # float32: stacked, scanned
    low = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), lm)
    rows = scan.apart(low)
    assert rows["E"] is low["E"] and scan.apart(rows) is rows
    for k, w in rows[layout.BLOCKS].items():
        assert isinstance(w, layout.Rows) and len(w) == 3
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(w[i], np.float32),
                                          np.asarray(low[layout.BLOCKS][k][i], np.float32))  # fmt: skip
    # rows scan (a switch picks each block's arrays); stacked bf16 leaves on a CPU do not
    assert scan.in_place(rows[layout.BLOCKS]) and scan.in_place(lm[layout.BLOCKS])
    assert not scan.in_place(low[layout.BLOCKS])


def test_a_traced_resume_scans_the_rows_and_equals_the_static_one(bf16):
    """Under a traced `Resume.layer` (a patching table's `lax.map` over its layers) the
    rows run as one scan, each block's weights picked by a switch, the blocks before the
    layer skipped: one block compiled, not every block; its logits those of the static
    resume (the blocks from the layer on) within rounding."""
    m, inputs = bf16
    c, s0 = m.config, 5
    f = _forward(m, capture=["lm/resid_pre", *decoder.RESUME_SITES])
    _, aux = f(m.params, inputs)
    cache = {k: v for k, v in aux.items() if k.split(".")[0] in decoder.RESUME_SITES}

    def run(p, y, x_y):
        resume = decoder.Resume(y, s0, x_y, cache)
        return qwen.forward(p, inputs, config=c, last_row=True, resume=resume)[0]

    traced = jax.jit(run)
    assert "scan" in str(jax.make_jaxpr(run)(m.params, jnp.int32(0), aux["lm/resid_pre.0"][:, s0:]))
    for layer in range(c.lm_layers):
        x_y = aux[f"lm/resid_pre.{layer}"][:, s0:]
        want = np.asarray(jax.jit(run, static_argnums=1)(m.params, layer, x_y), np.float32)
        got = np.asarray(traced(m.params, jnp.int32(layer), x_y), np.float32)
        ulp = 2.0**-7 * np.abs(want).max()
        assert np.abs(got - want).max() <= 4 * ulp, (layer, np.abs(got - want).max(), ulp)


def _scratch(depth: int, folder: str, table: bool) -> tuple[float, float]:
    """(XLA's scratch bytes, one LM block's bf16 bytes) over bf16 `Rows` on a
    Qwen2-VL-layout config whose LM weights dwarf its activations (compiled only): of a
    patching table's resumed runs (`table`: a `lax.map` over every layer, the layer
    traced) or of the plain forward."""
    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.families.qwen2_vl import params as qp
    from jaxmech.families.qwen2_vl.config import QwenVLConfig
    from jaxmech.families.qwen2_vl.stand_in import word_tokenizer
    from jaxmech.families.qwen2_vl.view import checkpoint_view
    from jaxmech.families.vlm_view import examples

    os.makedirs(folder)
    ids = word_tokenizer(folder)
    c = QwenVLConfig(vit_depth=1, vit_width=64, vit_heads=2, vit_mlp=128, lm_vocab=128,
                     lm_width=512, lm_layers=depth, lm_heads=4, lm_kv_heads=2, lm_mlp=2048,
                     lm_mrope_section=(16, 24, 24), tie_embeddings=True, patch_size=14,
                     image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    view = checkpoint_view(folder, c, Grid(2, 2), 56)
    like = lambda s: jax.ShapeDtypeStruct(tuple(s), jnp.bfloat16)  # noqa: E731
    p = jax.tree_util.tree_map(like, qp.param_shapes(c), is_leaf=qp.is_shape)
    blocks = p["lm"][layout.BLOCKS]
    p["lm"][layout.BLOCKS] = {
        k: layout.Rows([like(w.shape[1:])] * depth) for k, w in blocks.items()
    }
    spec = pair_questions(view.grid, 1, view.n_labels, view.n_colours)["examples"]
    x = jax.tree_util.tree_map(lambda a: np.asarray(a)[:1], examples(view, spec).inputs)
    sites = [f"lm/resid_pre.{i}" for i in range(depth)] + list(decoder.RESUME_SITES)
    _, aux = jax.eval_shape(lambda p, x: view.forward(p, x, capture=sites), p, x)

    def run(p, x, aux, s0=4):
        if not table:
            return view.forward(p, x)[0]
        xs = jnp.stack([aux[f"lm/resid_pre.{i}"][:, s0:] for i in range(depth)])
        one = lambda yx: view.forward_from(p, x, yx[0], s0, yx[1], aux)  # noqa: E731
        return jax.lax.map(one, (jnp.arange(depth, dtype=jnp.int32), xs))

    compiled = jax.jit(run).lower(p, x, aux).compile()
    block = sum(np.prod(w.shape) for w in jax.tree_util.tree_leaves(blocks)) * 2 / depth
    return float(compiled.memory_analysis().temp_size_in_bytes), float(block)


@pytest.mark.slow  # ~3.5 s; test_no_mlp_weight_is_copied_with_bf16_products keeps the no-copy property of the entry
def test_the_rows_forward_holds_one_block_copy_at_a_time(tmp_path, monkeypatch):
    """With bf16 products the plain forward over rows scans them, the switch copying the
    running block's weights (the price of one compiled block): its scratch is flat with
    depth and about one block's bytes (3 or 6 blocks: 8.5 MB against a block's 7.9; the
    stacked bf16 path's grew with depth, a copy of every block). Compile only."""
    monkeypatch.setenv("JAXMECH_BF16_PRODUCTS", "on")
    small, block = _scratch(3, str(tmp_path / "a"), table=False)
    large, _ = _scratch(6, str(tmp_path / "b"), table=False)
    assert abs(large - small) < 0.1 * block and large < 1.25 * block, (small, large, block)


@pytest.mark.slow  # ~5.5 s; test_a_traced_resume_scans_the_rows_and_equals_the_static_one keeps the scan
@pytest.mark.parametrize("products", ["off", "on"])
def test_scanned_rows_hold_one_block_at_a_time(tmp_path, monkeypatch, products):
    """The switch that picks a block's rows inside the scan copies that block only: the
    scratch of a table's resumed runs does not grow with the LM's depth (it would by a
    block's weights per block if XLA copied or converted every row up front; seen 0.09
    MB a block against a block's 7.9 MB)."""
    monkeypatch.setenv("JAXMECH_BF16_PRODUCTS", products)
    small, block = _scratch(2, str(tmp_path / "a"), table=True)
    large, _ = _scratch(6, str(tmp_path / "b"), table=True)
    assert large - small < 0.25 * block, (large - small, block)


def test_a_bf16_patching_table_on_rows_resumes_every_layer_in_one_program(bf16):
    """With the rows, a patching table's resumed runs take the traced-layer path: per
    group one `lax.map` over the layers, each a scan of one block (what made the 2B
    table's compile minutes long was one unrolled LM per layer, group and twin)."""
    from test_scan import _scans, fixture_table

    patch, view, plan = fixture_table(bf16[0])
    maps = [e for e in jax.make_jaxpr(lambda: patch(view))().jaxpr.eqns
            if block_scan(e) and _scans(e.params["jaxpr"].jaxpr)]  # fmt: skip
    assert len(maps) == len(plan)  # per group, a lax.map over the layers of a scanned LM


@pytest.mark.slow  # compiles the per-layer table too (~40 s on a loaded CPU)
def test_the_bf16_table_on_rows_equals_the_per_layer_one(bf16):
    """The traced-layer table on rows: the per-layer path's values within bf16 rounding."""
    from test_scan import fixture_table

    patch, view, _ = fixture_table(bf16[0])
    per_layer = view._replace(resume_any_layer=False)
    got, want = jax.jit(lambda: (patch(view)["patched"], patch(per_layer)["patched"]))()
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ulp = 2.0**-7 * np.abs(want).max()
    assert np.abs(got - want).max() <= 4 * ulp, (np.abs(got - want).max(), ulp)
