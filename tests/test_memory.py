"""Checkpoint reports keep the memory budget they are given: the peak resident memory
the OS reports for a whole report process, at the default 448 px."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import subprocess_env

from jaxmech.memory import peak_run

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
BUDGET_GB = 3.0


def _fixture_at_448(tmp_path) -> str:
    """The Qwen2-VL fixture with the real checkpoints' max_pixels, so it keeps 448 px
    pictures (the stored one caps them at 112 px for the reference comparisons)."""
    out = tmp_path / "qwen2_vl_448"
    shutil.copytree(FIXTURE, out)
    cfg = out / "preprocessor_config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"max_pixels": 12845056}))
    return str(out)


# slow: a report subprocess at the real 448 px (~35 s); the plan's arithmetic and refusals stay in the suite
@pytest.mark.slow
def test_diagnostics_at_448_px_stays_within_its_budget(tmp_path):
    """The report that used to be killed by the kernel (24 GB on this fixture) runs in
    a subprocess under --memory=3 at 448 px; its peak resident memory, read from the OS
    for that process, is within the budget, and it logs the plan and the peak. ~45 s
    under the suite: 4 probe sets of 80 pictures of 1024 patches each, rendered and run
    (the 448 px size is what the budget is about)."""
    folder = _fixture_at_448(tmp_path)
    cmd = [sys.executable, "-m", "experiments.diagnostics", f"--checkpoint={folder}",
           f"--out={tmp_path / 'out'}", "--questions=2", "--grid=2x2", f"--memory={BUDGET_GB}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code, _, peak_gb, text = peak_run(cmd, str(tmp_path / "log.txt"), env=env, timeout=600,
                                      cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert code == 0, text[-3000:]
    assert peak_gb < BUDGET_GB, f"peak {peak_gb:.2f} GB over the {BUDGET_GB} GB budget"
    assert "question(s) per call" in text and "plan" in text  # the plan, before compute
    assert f"budget {BUDGET_GB:.1f} GB" in text and "memory: peak" in text


def test_a_bad_budget_is_refused_before_the_weights_are_read(tmp_path):
    from jaxmech.reports.common import open_checkpoint

    with pytest.raises(ValueError, match="--memory"):
        open_checkpoint(FIXTURE, size=112, memory="lots")


def test_weights_over_the_budget_are_refused_before_any_is_read(monkeypatch):
    """The weights' bytes from the files' headers against the budget, before loading: the
    error names what to change (`--dtype=bfloat16` only where narrower weights exist)."""
    from jaxmech import memory
    from jaxmech.models import hub
    from jaxmech.reports.common import open_checkpoint

    n = hub.stored_elements(FIXTURE)
    assert n == sum(x.size for x in _stored_arrays(FIXTURE))  # every stored number, no more
    small = memory.Budget(3.5 * n, "a test's")
    memory.check_weights_fit(2 * n, small, "bfloat16", "w")  # 2 bytes a number: fits
    with pytest.raises(memory.MemoryBudgetError, match="--dtype=bfloat16, a larger --memory"):
        memory.check_weights_fit(4 * n, small, "float32", "w")
    with pytest.raises(memory.MemoryBudgetError) as e:
        memory.check_weights_fit(4 * n, memory.Budget(3.9 * n, "x"), "bfloat16", "w")
    assert "--dtype" not in str(e.value) and "--memory" in str(e.value)

    def no_load(*a, **k):
        raise AssertionError("the weights were read before the check")

    monkeypatch.setattr("jaxmech.model.load", no_load)  # the one loading path
    with pytest.raises(memory.MemoryBudgetError, match="weights alone take"):
        open_checkpoint(FIXTURE, size=112, memory="0.00000001")


def test_reports_and_ask_load_through_the_one_handle(monkeypatch):
    """`jaxmech.load(budget=)` refuses weights over the budget before its family reads
    any; a report's checkpoint subject holds the `Model` that loaded it (params moved
    into the run, stacked [1, ...], equal to a plain `jaxmech.load`'s)."""
    import jax
    import numpy as np

    import jaxmech
    from jaxmech import memory
    from jaxmech.reports.checkpoints import open_checkpoint

    run = open_checkpoint(FIXTURE, grid=(2, 2), size=112, questions=2, log=lambda *a: None)
    model, plain = run.subject.model, jaxmech.load(FIXTURE)
    assert isinstance(model, jaxmech.Model) and model.params is None
    assert model.family is run.family and model.folder == run.path == plain.folder
    assert model.describe() == plain.describe() and model.tokenizer is not None
    same = jax.tree_util.tree_map(lambda a, b: np.array_equal(a[0], b), run.params, plain.params)
    assert all(jax.tree_util.tree_leaves(same))

    real = jaxmech.model.checkpoint_family

    def no_load(*a, **k):
        raise AssertionError("the weights were read before the check")

    monkeypatch.setattr("jaxmech.model.checkpoint_family", lambda f: real(f)._replace(load=no_load))
    with pytest.raises(memory.MemoryBudgetError, match="weights alone take"):
        jaxmech.load(FIXTURE, budget=memory.Budget(1.0, "a test's"))


def _stored_arrays(folder):
    from jaxmech.models.hub import Stored, weight_files

    stored = Stored(weight_files(folder))
    return [stored.array(k) for k in stored.entries]


def test_ask_refuses_weights_over_its_budget_by_name():
    """`experiments.ask --memory=` too small for the weights: exit 1, the error last."""
    image = os.path.join(os.path.dirname(FIXTURE), "single0.png")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.ask", f"--checkpoint={FIXTURE}", f"--image={image}",
         "--question=Is it left?", "--memory=0.00000001"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {FIXTURE}: the weights alone take"), last
    assert "--memory" in last and "rank" not in out.stdout


def _scratch_bytes(depth: int, tmp_path) -> tuple[float, float]:
    """(XLA's scratch bytes of a bfloat16 forward of one 56 px picture, one LM block's
    weights in float32) on a Qwen2-VL-layout config whose weights dwarf its
    activations, at `depth` ViT and LM blocks (compiled only; no weights made)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.families.qwen2_vl import params as qp
    from jaxmech.families.qwen2_vl.config import QwenVLConfig
    from jaxmech.families.qwen2_vl.stand_in import word_tokenizer
    from jaxmech.families.qwen2_vl.view import checkpoint_view
    from jaxmech.families.vlm_view import examples

    tmp_path.mkdir()
    ids = word_tokenizer(str(tmp_path))
    c = QwenVLConfig(vit_depth=depth, vit_width=64, vit_heads=2, vit_mlp=128, lm_vocab=128,
                     lm_width=512, lm_layers=depth, lm_heads=4, lm_kv_heads=2, lm_mlp=2048,
                     lm_mrope_section=(16, 24, 24), tie_embeddings=True, patch_size=14,
                     image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    view = checkpoint_view(str(tmp_path), c, Grid(2, 2), 56)
    shapes = qp.param_shapes(c)
    like = lambda s: jax.ShapeDtypeStruct(tuple(s), jnp.bfloat16)  # noqa: E731
    p = jax.tree_util.tree_map(like, shapes, is_leaf=qp.is_shape)
    spec = pair_questions(view.grid, 1, view.n_labels, view.n_colours)["examples"]
    x = jax.tree_util.tree_map(lambda a: np.asarray(a)[:1], examples(view, spec).inputs)
    compiled = jax.jit(lambda p, x: view.forward(p, x)[0]).lower(p, x).compile()
    stacked = jax.tree_util.tree_leaves(shapes["lm"]["blocks"], is_leaf=qp.is_shape)
    block = sum(np.prod(s) for s in stacked) / depth
    return float(compiled.memory_analysis().temp_size_in_bytes), 4.0 * block


@pytest.mark.parametrize("products", ["off", "on"])
def test_low_precision_weights_are_converted_block_by_block(tmp_path, monkeypatch, products):
    """With float32 products ("off"), XLA's CPU backend computes a bfloat16 dot in
    float32 and converts the weights; tied to each block's input (`decoder.after`), the
    conversions are made as the blocks run, so the compiled forward's scratch does not
    grow by a float32 copy of each block (untied, it grew by exactly that: 5.5 GB at
    Qwen2-VL-2B's size). With bf16 products ("on": `models.precision`) nothing is
    converted, and the attention weights' relayout copies, tied, do not grow it either
    (untied: 0.4 of a float32 block per block). Compile only."""
    monkeypatch.setenv("JAXMECH_BF16_PRODUCTS", products)
    small, block = _scratch_bytes(2, tmp_path / "a")
    large, _ = _scratch_bytes(6, tmp_path / "b")
    # untied: about 4 blocks (off), 1.6 (on); tied: 0 either way
    assert large - small < (1.5 if products == "off" else 0.5) * block, (large - small, block)


def test_the_tie_changes_no_value():
    """`models.order.tie` adds an exact zero to the bits: the same values, also after a
    non-finite tying value; no gradient flows into the tying input, and the tied
    leaves have the identity's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmech.models.order import tie

    w = {"a": jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.bfloat16),
         "i": jnp.arange(3)}  # fmt: skip
    for x in (jnp.float32(3.5), jnp.float32(np.inf), jnp.float32(np.nan), jnp.bfloat16(-0.0)):
        out = jax.jit(tie)(w, x)
        assert out["a"].dtype == jnp.bfloat16 and out["i"].dtype == w["i"].dtype
        np.testing.assert_array_equal(
            np.asarray(out["a"], np.float32), np.asarray(w["a"], np.float32)
        )
    g = jax.grad(lambda x: tie({"a": jnp.ones(3)}, x)["a"].sum())(jnp.float32(2.0))
    assert g == 0.0
    # the identity's derivative for the tied leaves (fine-tuning goes through it)
    dw = jax.grad(lambda w: (tie({"a": w}, jnp.float32(1.0))["a"] * jnp.arange(3.0)).sum())
    np.testing.assert_array_equal(dw(jnp.ones(3, jnp.bfloat16)).astype(np.float32), [0, 1, 2])


def test_the_real_size_stand_in_writes_a_loadable_checkpoint(tmp_path):
    """`stand_in.write_stand_in` (the real-size check's checkpoint) on a tiny Hub config:
    the Hub's tensor names in two shards and an index, which jaxmech's loader and the
    safetensors package both read; norm weights 1, other values random bf16."""
    import numpy as np
    from safetensors import safe_open

    from jaxmech.families import load_checkpoint
    from jaxmech.families.qwen2_vl.stand_in import write_stand_in

    with open(os.path.join(FIXTURE, "config.json")) as f:
        hub = json.load(f)
    folder = write_stand_in(str(tmp_path / "stand_in"), hub=hub, log=lambda *_: None)
    index = json.loads((tmp_path / "stand_in" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    hub_names = ("model.", "visual.", "lm_head.")
    assert len(shards) == 2 and all(k.startswith(hub_names) for k in index["weight_map"])
    names = set()
    for s in shards:
        with safe_open(str(tmp_path / "stand_in" / s), "np") as f:
            names |= set(f.keys())
    assert names == set(index["weight_map"])
    _, config, params = load_checkpoint(folder)
    from jaxmech.models.layout import block

    assert np.all(np.asarray(block(params["lm"], 0)["ln1_w"]) == 1.0)
    w = np.asarray(block(params["lm"], 0)["W_Q"])
    assert 0.005 < w.std() < 0.05 and config.lm_layers == hub["num_hidden_layers"]
