"""A checkpoint over several devices (`jaxmech.load(folder, place="shard")`): on 4 fake
CPU devices each fixture's matrices are split (the largest axis 4 divides; vectors and
what 4 divides nowhere replicated: `models.hub._sharding`) and its logits equal the
one-device load's; a report run with `--place=shard` writes the table `--place=one`
writes; the memory planner counts a sharded program per device."""

import csv
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env

from jaxmech import memory

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QUESTION = "Is the red circle to the left or the right of the blue square? Answer with one word."

# In a subprocess: JAX takes its device count when it starts. Prints one JSON line per
# checkpoint: the largest difference of the forward's logits and of the next-token
# log-probabilities between the two placements, and how the params were laid out.
SCRIPT = """
import json, sys
from jaxmech.cli import setup_runtime
setup_runtime()
import jax, numpy as np
import jaxmech
from jaxmech.bench.sharded_peak import placement_bytes
from jaxmech.memory import device_bytes
folder, image, question = sys.argv[1:]
one, shard = (jaxmech.load(folder, place=p) for p in ("one", "shard"))
encoded = one.encode([image], [question])
diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())
leaves = jax.tree_util.tree_leaves(shard.params)
split = [x for x in leaves if not x.sharding.is_fully_replicated]
print(json.dumps({
    "devices": jax.device_count(),
    "logits": diff(one.forward(encoded.inputs)[0], shard.forward(encoded.inputs)[0]),
    "logprobs": diff(one.next_token_logprobs(encoded), shard.next_token_logprobs(encoded)),
    "scale": float(np.abs(np.asarray(one.forward(encoded.inputs)[0])).max()),
    "one_device": all(len(x.sharding.device_set) == 1
                      for x in jax.tree_util.tree_leaves(one.params)),
    "split": len(split), "leaves": len(leaves),
    "split_matrices_only": all(x.ndim >= 2 for x in split),
    "shard_bytes": [int(x.addressable_shards[0].data.nbytes) for x in split],
    "bytes": [int(x.nbytes) for x in split],
    "placed": placement_bytes(shard.params), "placed_one": placement_bytes(one.params),
    "device_bytes": device_bytes(shard.params),
}))
"""


def _sharded_vs_one(folder, image):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, os.path.join(FIXTURES, folder),
         os.path.join(FIXTURES, image), QUESTION],
        env=subprocess_env(devices=4), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(got):
    assert got["devices"] == 4 and got["one_device"]
    assert got["split"] > got["leaves"] // 2 and got["split_matrices_only"], got
    assert all(s * 4 == b for s, b in zip(got["shard_bytes"], got["bytes"]))  # a quarter each
    # the same sums in another order: float32 rounding, not a different model
    assert got["logits"] <= 1e-5 * max(got["scale"], 1.0), got
    assert got["logprobs"] <= 1e-5, got
    # the benchmark's and the planner's accounting: a quarter of what is split, plus
    # every replicated leaf whole, on each device (`bench.sharded_peak`, `memory`)
    placed, rep = got["placed"], got["placed"]["replicated"]
    replicated = rep["vectors"][1] + rep["matrices"][1]
    assert placed["split"] == got["split"] and placed["total"] == got["placed_one"]["total"]
    assert placed["per_device"] == [(placed["total"] - replicated) // 4 + replicated] * 4
    assert got["device_bytes"] == placed["per_device"][0]
    assert got["placed_one"]["per_device"] == [placed["total"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "folder, image",
    [
        ("qwen2_vl/qwen2_vl", "qwen2_vl/single0.png"),
        ("llava/llava", "llava/single0.png"),
        ("internvl/internvl", "internvl/tiled0.png"),
        ("qwen3_vl/qwen3_vl", "qwen3_vl/single0.png"),
    ],
)
def test_a_checkpoint_sharded_over_four_devices_equals_one_device(folder, image):
    """Slow (~15 s of CPU each, 30-60 s on a shared 2-core machine): a subprocess with its
    own JAX start, two loads and two compiles per family. In the suite,
    test_qwen2_vl_load's test_ask_sharded_over_two_devices covers the sharded placement."""
    _check(_sharded_vs_one(folder, image))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report(report: str, place: str, out: str, *flags) -> str:
    """`experiments.REPORT` on the Qwen2-VL fixture with `--place`, in a process of 4
    fake CPU devices (`--xla_force_host_platform_device_count=4`); its log."""
    xla = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    env = subprocess_env() | {"XLA_FLAGS": xla.strip()}
    cmd = [sys.executable, "-m", f"experiments.{report}",
           f"--checkpoint={os.path.join(FIXTURES, 'qwen2_vl', 'qwen2_vl')}", f"--out={out}",
           "--size=112", "--grid=2x2", f"--place={place}", *flags]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _same_tables(one: str, shard: str, rtol: float, atol: float) -> int:
    """Every CSV of report folder `one` has its twin in `shard`: the same rows and
    text, the numbers within `rtol` / `atol` (NaN where the other is NaN); how many
    finite numbers were compared."""
    names = sorted(os.listdir(one))
    assert [n for n in names if n.endswith(".csv")], names
    compared = 0
    for name in (n for n in names if n.endswith(".csv")):
        a, b = (list(csv.DictReader(open(os.path.join(d, name)))) for d in (one, shard))
        assert len(a) == len(b) > 0 and a[0].keys() == b[0].keys(), name
        for ra, rb in zip(a, b):
            for k, v in ra.items():
                try:
                    x, y = float(v), float(rb[k])
                except ValueError:
                    assert v == rb[k], (name, k)
                    continue
                assert np.isnan(x) == np.isnan(y), (name, k, v, rb[k])
                assert np.isnan(x) or abs(x - y) <= atol + rtol * abs(x), (name, k, v, rb[k])
                compared += int(np.isfinite(x) and x != 0)
    return compared


def _chunks(folder: str) -> dict:
    """A report's stored chunks (`chunks.ChunkStore`): its raw numbers, by file and key."""
    files = sorted(glob.glob(os.path.join(folder, "chunks", "*", "*.npz")))
    return {(os.path.basename(f), k): v for f in files for k, v in np.load(f).items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "report, flags, rtol, atol",
    [
        # the authors' protocol counts every question (the random fixture answers
        # wrong, so jaxmech's keeps none); its belief shifts are ratios over the
        # twin's small change of the fixture's log-probs (~1e-2), which amplify the
        # log-probs' float32 rounding (measured 5.3e-4 at shifts up to 4.7)
        ("patching", ("--questions=4", "--protocol=authors"), 1e-3, 2e-3),
        # R^2, norms and cosines: float32 rounding (measured 3.8e-6 at values up to 6)
        ("spatial_ids", ("--questions=2",), 1e-5, 1e-5),
    ],
)
def test_a_report_on_sharded_params_writes_the_one_device_tables(report, flags, rtol, atol,
                                                                 tmp_path):  # fmt: skip
    """Slow (two report processes each, on a shared 2-core machine: patching 4.7 min,
    most of it the sharded table's compile for 4 devices; spatial_ids ~1 min):
    `--place=shard` splits the weights over the 4 devices, plans its rows per
    device (the log says so), and writes every CSV `--place=one` writes, to float32
    rounding; the raw numbers a table stores (patching's log-probs) within 1e-5
    (measured 9.5e-7 at ~4.9)."""
    one_log = _report(report, "one", str(tmp_path / "one"), *flags)
    shard_log = _report(report, "shard", str(tmp_path / "shard"), *flags)
    assert "sharded over" not in one_log and "x 4 devices" not in one_log
    assert "sharded over 4 devices" in shard_log and "x 4 devices, one host's memory" in shard_log
    one, shard = (str(tmp_path / p / report) for p in ("one", "shard"))
    assert _same_tables(one, shard, rtol, atol) > 0  # numbers, not only NaNs
    raw_one, raw_shard = _chunks(one), _chunks(shard)
    assert raw_one.keys() == raw_shard.keys() and (raw_one or report != "patching")
    for k, v in raw_one.items():
        np.testing.assert_allclose(raw_shard[k], v, rtol=0, atol=1e-5, err_msg=str(k))


def test_device_bytes_count_one_device_s_share():
    """`memory.device_bytes`: one device's params are all their bytes; a host array
    counts whole (the sharded case: the slow subprocess tests and the benchmark)."""
    tree = {"w": jnp.ones((8, 4)), "b": jnp.ones(3, jnp.bfloat16), "h": np.ones(5, np.float32)}
    assert memory.device_bytes(tree) == memory.tree_bytes(tree) == 8 * 4 * 4 + 3 * 2 + 5 * 4
    assert memory.tree_devices(tree) == 1 and memory.tree_devices({"h": np.ones(2)}) == 1


def test_a_sharded_program_is_planned_per_device_on_the_host(monkeypatch):
    """On CPU every fake device is the host's memory: a program over 4 devices is
    charged 4 times XLA's (per-device) bytes per row beyond the weights' shards, and
    its plan says so; on one device the plan is as before."""
    monkeypatch.setattr(memory, "held_bytes", lambda: 1e9)
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(1))
    at = lambda b: f.lower(jax.ShapeDtypeStruct((b, 256), jnp.float32)).compile()  # noqa: E731
    per = memory.compiled_bytes(at(1)) - 100
    budget = memory.Budget(1e9 + 8 * per, "test")  # 8 rows: under CPU_MAX_ROWS
    quiet = lambda *_: None  # noqa: E731
    one = memory.plan_rows(at, 1000, budget, 100, quiet)
    four = memory.plan_rows(at, 1000, budget, 100, quiet, devices=4)
    assert one.per_row == per and four.per_row == 4 * per and four.devices == 4
    assert one.rows == 8 and four.rows == 2 and four.bytes() <= budget.bytes
    assert "x 4 devices" in four.text() and "devices" not in one.text()
