"""How many models one compiled chunk holds: measured from the program, not guessed.

On an accelerator the models of a chunk train side by side, so throughput grows with
the chunk until memory runs out. The chunk is chosen from the training program's own
memory footprint: XLA's memory analysis of the compiled program (arguments + outputs +
temporaries, less what is aliased) at two small model counts gives bytes per model and
fixed bytes (the data, replicated); the chunk per device is the largest power of two
whose footprint fits in MEMORY_SHARE of the device's memory. Powers of two keep the
choice stable against small changes of the analysis between versions; the choice
depends on the config and the device, never on a sweep's size, so a model's numbers
do not depend on how many models share its sweep.

The same measurement sizes an analysis table's chunk of rows (`plan_rows`): there memory,
not speed, is the limit, so it applies on CPU too, within a budget the user can set
(`memory_budget`, `--memory`): what the process already holds (resident memory on CPU,
the weights among it) plus the program's bytes beyond its resident arguments. XLA's
analysis is an estimate, so a chunked table measures its first chunk's peak and shrinks
the rows before the next when it went over (`Plan.within`, `chunks.run_chunks`).

On CPU a training chunk stays CPU_CHUNK_PER_DEVICE per device, and an entry point asks
for one CPU device per usable core (`cpu_devices`; $JAXMECH_CPU_DEVICES overrides): the
toy models' steps are too small for one XLA CPU device to keep two cores busy, so the
chunk's models run side by side, split over the devices (BUILD_NOTES.md, Speed).
"""

from __future__ import annotations

import functools
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Config
from jaxmech.memory import compiled_bytes, device_memory, host_memory  # noqa: F401
from jaxmech.train import _train_program, build_data, init_program, program_config, stack_settings

CPU_CHUNK_PER_DEVICE = 4  # one chunk of 8 beat four of 2 for 8 VLM seeds on 2 devices
# Without a memory figure from the device (memory_stats() is None on some backends).
FALLBACK_CHUNK_PER_DEVICE = 256
MEMORY_SHARE = 0.5  # of a device's memory for one chunk's program (the rest: XLA's
# workspace, the host-device copies of a checkpoint, fragmentation)
MAX_CHUNK_PER_DEVICE = 8192
PROBE_MODELS = (4, 8)


CPU_DEVICES_ENV = "JAXMECH_CPU_DEVICES"
# Measured on 2 cores only. A chunk is CPU_CHUNK_PER_DEVICE per device and smaller sweeps
# pad it, so the default stops at 8 devices (a chunk of 32) on larger machines.
MAX_DEFAULT_CPU_DEVICES = 8
_FORCED_COUNT = "xla_force_host_platform_device_count"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cpu_devices() -> int | None:
    """How many CPU devices an entry point asks JAX for (None: leave JAX's choice).

    One per usable core by default (at most MAX_DEFAULT_CPU_DEVICES): the toy models'
    steps are too small for one XLA CPU device to keep two cores busy, so a sweep splits
    its chunk over the devices, which run side by side (BUILD_NOTES.md, Speed).
    $JAXMECH_CPU_DEVICES sets another count (1: one device, as runs made before the split
    had); an `--xla_force_host_platform_device_count` in $XLA_FLAGS is left to
    decide. Raises ValueError naming the variable for a bad value.
    """
    if _FORCED_COUNT in os.environ.get("XLA_FLAGS", ""):
        return None
    text = os.environ.get(CPU_DEVICES_ENV, "").strip()
    if not text:
        return min(usable_cores(), MAX_DEFAULT_CPU_DEVICES)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{CPU_DEVICES_ENV}={text!r} is invalid: allowed an integer >= 1")
    return int(text)


class Footprint(NamedTuple):
    """Bytes of the training program on one device: `fixed + per_model * K`."""

    per_model: float
    fixed: float

    def bytes(self, k: int) -> float:
        return self.fixed + self.per_model * k


def fit_footprint(bytes_by_models: dict[int, float]) -> Footprint:
    """The line through the footprints at two model counts {K: bytes}."""
    (a, ma), (b, mb) = sorted(bytes_by_models.items())
    per = max((mb - ma) / (b - a), 1.0)
    return Footprint(per, max(ma - a * per, 0.0))


def program_bytes(config: Config, k: int) -> int:
    """Peak bytes XLA's memory analysis gives for the training program of k models
    (one evaluation segment) compiled for one device."""
    prog = program_config(config)
    like = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)  # noqa: E731
    stacked = jax.tree_util.tree_map(like, stack_settings([config.settings()] * k))
    state = jax.eval_shape(lambda s: init_program(s, config), stacked)
    budget = jax.ShapeDtypeStruct((k,), jnp.int32)
    data = jax.tree_util.tree_map(jnp.asarray, build_data(config))
    return compiled_bytes(_train_program.lower(state, stacked, budget, data, prog).compile())


@functools.lru_cache(maxsize=32)
def footprint(config: Config, probe=PROBE_MODELS) -> Footprint:
    """Bytes per model and fixed bytes, from the program at two model counts (two
    compiles; remembered per config in this process)."""
    return fit_footprint({k: program_bytes(config, k) for k in probe})


def chunk_for_memory(fp: Footprint, memory_bytes: float, share: float = MEMORY_SHARE) -> int:
    """The largest power of two K (1 .. MAX_CHUNK_PER_DEVICE) with fp.bytes(K) within
    `share` of `memory_bytes` (1 if even one model does not fit: training will say)."""
    fit = (share * memory_bytes - fp.fixed) / fp.per_model
    if fit < 1:
        return 1
    return int(min(2 ** int(np.floor(np.log2(fit))), MAX_CHUNK_PER_DEVICE))


def chunk_per_device(config: Config) -> tuple[int, str]:
    """(models per device in one chunk, how it was chosen) on this backend."""
    if jax.default_backend() == "cpu":
        return CPU_CHUNK_PER_DEVICE, "cpu default"
    memory = device_memory()
    if memory is None:
        return FALLBACK_CHUNK_PER_DEVICE, "fallback (the device reports no memory size)"
    fp = footprint(config)
    chunk = chunk_for_memory(fp, memory)
    return chunk, (
        f"measured: {fp.per_model / 2**20:.2f} MiB per model + {fp.fixed / 2**20:.1f} MiB "
        f"fixed, {MEMORY_SHARE:.0%} of {memory / 2**30:.1f} GiB"
    )


def matmul_rate(n: int = 2048, repeats: int = 10, dtype=jnp.float32) -> float:
    """Best-of matmul throughput (FLOP/s) of an n x n x n product on this backend, in
    float32 or, for a narrower `dtype`, its products with float32 accumulation (as
    `models.precision` writes them): the training bench's yardstick and a table's time
    estimate's (`product_seconds`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


# XLA's CPU compile time per jaxpr equation (`program_cost`'s count): Qwen2-VL-2B's
# forward, 6,215 equations in float32 and 11,714 in bfloat16, compiled in 9 s and 18 s
# on a quiet 2-core AMD EPYC (BUILD_NOTES.md, Speed): 1.45-1.54 ms each
COMPILE_S_PER_EQUATION = 1.5e-3


def program_cost(jaxpr) -> dict:
    """What a program costs, from its (closed) jaxpr: "flops" of its products computed
    at the float32 rate, "flops_low" of those with low-precision operands and float32
    accumulation (`models.precision`'s), each dot_general's 2 x (its output's size) x
    (its contracted size), times the length of every scan around it (XLA's cost analysis
    counts a loop's body once; a while loop's body counts once here too); "equations",
    each loop body's once (as XLA compiles it), the compile's yardstick
    (`COMPILE_S_PER_EQUATION`). A cond counts its costliest branch."""
    out = {"flops": 0.0, "flops_low": 0.0, "equations": 0}
    _add_cost(getattr(jaxpr, "jaxpr", jaxpr), 1.0, out)
    return out


def product_seconds(cost: dict) -> tuple[float, str]:
    """(seconds, the rates used, as text) of a `program_cost`'s products at this
    machine's matmul rates (`matmul_rate`): its "flops" at float32's, its "flops_low" at
    bf16's with float32 accumulation (measured only where the program has such
    products): a time the program's other work does not let it beat on CPU."""
    rate = matmul_rate(1024, 5)
    secs, rates = cost["flops"] / rate, f"{rate / 1e9:.0f} GFLOP/s float32"
    if cost["flops_low"]:
        low = matmul_rate(1024, 5, jnp.bfloat16)
        secs += cost["flops_low"] / low
        rates += f", {low / 1e9:.0f} bf16"
    return secs, rates


def _sub_jaxprs(value):
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [getattr(v, "jaxpr", v) for v in values if hasattr(v, "eqns") or
            hasattr(getattr(v, "jaxpr", None), "eqns")]  # fmt: skip


def _add_cost(jaxpr, times: float, out: dict) -> None:
    for e in jaxpr.eqns:
        out["equations"] += 1
        if e.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in e.invars)
            (_, rc), (_, rb) = e.params["dimension_numbers"]
            contracted = np.prod([rhs.shape[d] for d in rc])
            flops = 2.0 * np.prod(e.outvars[0].aval.shape) * contracted * times
            pref = e.params.get("preferred_element_type")
            low = lhs.dtype.itemsize < 4 and pref is not None and np.dtype(pref).itemsize >= 4
            out["flops_low" if low else "flops"] += flops
            continue
        n = float(e.params.get("length", 1)) if e.primitive.name == "scan" else 1.0
        if e.primitive.name == "cond":
            parts = []
            for branch in _sub_jaxprs(e.params["branches"]):
                part = {"flops": 0.0, "flops_low": 0.0, "equations": 0}
                _add_cost(branch, times, part)
                parts.append(part)
            out["equations"] += sum(p["equations"] for p in parts)
            costliest = max(parts, key=lambda p: p["flops"] + p["flops_low"])
            out["flops"] += costliest["flops"]
            out["flops_low"] += costliest["flops_low"]
            continue
        for value in e.params.values():
            for sub in _sub_jaxprs(value):
                _add_cost(sub, times * n, out)
