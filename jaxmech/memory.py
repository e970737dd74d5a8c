"""Memory: what a process holds and may hold, and how many rows of a table fit.

* `memory_budget(text)`: the bytes a report may hold at its peak (`--memory`: GB, a
  fraction or a percent; default the smaller of 40% of the machine's memory and what
  is available now less 1 GB), with how it was chosen.
* `held_bytes`, `peak_bytes`, `reset_peak`: what the OS says this process holds now and
  held at most (VmRSS / VmHWM on CPU; the allocator's figures on an accelerator).
* `plan_rows`: rows per call of a program over rows (a table's questions) from XLA's
  memory analysis of the program compiled for one row, counting what is held now
  once; a `Plan` logs what it expects and re-fits itself to a measured peak
  (`Plan.within`), because XLA's analysis is an estimate (it does not see host copies).
  Sharded weights: XLA's analysis is per device, the weights counted by one device's
  shards (`device_bytes`), and on CPU, whose fake devices share the host's memory,
  a row costs its per-device bytes once per device.
* `compiled_bytes`: a compiled program's bytes by XLA's analysis (also the training
  chunk's sizing's, `sizing`).

Nothing of jaxmech is imported here, so analysis code and the chunk store can use it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import numpy as np

from jaxmech.heartbeat import heartbeat, status_bytes


def compiled_bytes(compiled) -> int:
    """Peak bytes of a compiled program by XLA's memory analysis: arguments + outputs +
    temporaries, less what is aliased."""
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return int(total)


def device_memory(device=None) -> int | None:
    """Bytes of memory of `device` (default: the first), None if it does not say."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def host_memory() -> int | None:
    """Bytes of this machine's memory (a CPU backend's device memory), None if unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


class MemoryBudgetError(ValueError):
    """A table whose one row does not fit in the memory budget (the message says what
    to change)."""


class Budget(NamedTuple):
    """The bytes a report may hold at its peak (resident memory on CPU, the device's on
    an accelerator), and how they were chosen (for the log)."""

    bytes: float
    how: str


GIB = 2**30
DEFAULT_BUDGET_SHARE = 0.4  # of the machine's memory: the rest stays usable
BUDGET_MARGIN = 1 * GIB  # kept free of what is available now


def _gb(x: float) -> str:
    return f"{x / GIB:.1f} GB"


def available_memory() -> int | None:
    """Bytes the OS says are available now (/proc/meminfo MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_budget(text: str | None = None) -> Budget:
    """The budget of `--memory`: "8" or "8GB" (GiB), "0.3" or "30%" (of the machine's
    memory; the device's on an accelerator); None: the smaller of DEFAULT_BUDGET_SHARE
    of the memory and what is available now less BUDGET_MARGIN. Raises ValueError
    naming `--memory` for a bad value."""
    cpu = jax.default_backend() == "cpu"
    total = host_memory() if cpu else device_memory()
    where = "host" if cpu else "device"
    if text is not None and str(text).strip():
        t = str(text).strip().lower().removesuffix("gib").removesuffix("gb").strip()
        pct = t.endswith("%")
        try:
            v = float(t.rstrip("%"))
        except ValueError:
            v = -1.0
        if not v > 0 or (pct and v > 100):
            raise ValueError(
                f"--memory = {text!r}: expected GB (e.g. 8), a fraction (0.3) or a percent (30%)"
            )
        if pct or v <= 1:
            if total is None:
                raise ValueError(
                    f"--memory = {text!r}: this {where} reports no memory size; give GB"
                )
            share = v / 100 if pct else v
            return Budget(share * total, f"--memory={text}: {share:.0%} of {_gb(total)} ({where})")
        return Budget(v * GIB, f"--memory={text}")
    if total is None:
        return Budget(16 * GIB, f"16 GB (the {where} reports no memory size; set --memory)")
    budget, how = (
        DEFAULT_BUDGET_SHARE * total,
        f"{DEFAULT_BUDGET_SHARE:.0%} of {_gb(total)} ({where})",
    )
    free = available_memory() if cpu else None
    if free is not None and free - BUDGET_MARGIN < budget:
        budget = max(free - BUDGET_MARGIN, 0.0)
        how = f"{_gb(free)} available now less {_gb(BUDGET_MARGIN)}"
    return Budget(budget, how)


def check_weights_fit(n_bytes: float, budget: Budget, dtype: str, what: str,
                      devices: int = 1) -> None:  # fmt: skip
    """Before any weight is read: `MemoryBudgetError` when the weights alone (`n_bytes`
    in `dtype`, over `devices` sharded devices) exceed `budget`, naming what to change.
    On a CPU every (fake) device is the host's memory, so the whole weights count; on
    an accelerator one device's share (the budget is one device's)."""
    share = n_bytes if jax.default_backend() == "cpu" else n_bytes / max(devices, 1)
    if share <= budget.bytes:
        return
    narrower = "--dtype=bfloat16, " if jax.numpy.dtype(dtype).itemsize >= 4 else ""
    raise MemoryBudgetError(
        f"{what}: the weights alone take {_gb(share)} in {dtype}, over the "
        f"{_gb(budget.bytes)} memory budget ({budget.how}); try {narrower}a larger "
        f"--memory, or --place=shard over several accelerators"
    )


def held_bytes() -> float:
    """Bytes held now: this process's resident memory on CPU, the device's in use on an
    accelerator (0 where neither says)."""
    if jax.default_backend() == "cpu":
        return float(status_bytes("VmRSS") or 0)
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("bytes_in_use", 0))


def peak_bytes() -> float:
    """The peak of `held_bytes` since the process began or `reset_peak` (the OS's
    VmHWM on CPU; the allocator's peak on an accelerator; 0 where neither says)."""
    if jax.default_backend() == "cpu":
        import resource

        hwm = status_bytes("VmHWM")
        return float(
            hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("peak_bytes_in_use", 0))


def reset_peak() -> None:
    """Restart `peak_bytes` from what is held now (Linux: /proc/self/clear_refs 5; a
    no-op where the OS has no such switch, so the peak then counts from the start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def release_freed() -> None:
    """Hands memory this process freed back to the OS (glibc's `malloc_trim`; a no-op
    elsewhere). Why: glibc may keep freed blocks (a loaded tensor's host copies, a
    compile's scratch) in its heap, and the resident memory a plan counts as held
    would then stay above what is live."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# runs argv[1:] and prints its peak resident memory as the OS counts it (wait4); a
# command forked straight from a large process would count that process's pages in
# its own peak until it execs, so `peak_run` starts it from this small one
_PEAK_RUNNER = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[1:])\n"
    "_, status, usage = os.wait4(child.pid, 0)\n"
    "print('PEAK_KB', usage.ru_maxrss, flush=True)\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def peak_run(cmd: list, log_path: str, env=None, cwd=None, timeout=None):
    """(exit code, wall s, peak resident GB the OS measured, log text) of one command,
    its output in `log_path`."""
    import subprocess
    import sys
    import time

    t0 = time.perf_counter()
    with open(log_path, "w+") as log:
        done = subprocess.run([sys.executable, "-c", _PEAK_RUNNER, *cmd], stdout=log,
                              stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout)  # fmt: skip
        log.seek(0)
        text = log.read()
    kb = text.rsplit("PEAK_KB ", 1)[1].split()[0] if "PEAK_KB " in text else "nan"
    return done.returncode, time.perf_counter() - t0, float(kb) / 2**20, text


def tree_bytes(tree) -> int:
    """Bytes of a pytree's array leaves."""
    return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")))  # fmt: skip


def device_bytes(tree) -> int:
    """The most bytes of a pytree's arrays that one device holds: a sharded array counts
    its shard on each of its devices, a replicated one its whole on each (a host array,
    with no shards, counts whole). One device's params: `tree_bytes`."""
    per_device: dict = {}
    host = 0
    for x in jax.tree_util.tree_leaves(tree):
        if not hasattr(x, "dtype"):
            continue
        size = np.dtype(x.dtype).itemsize
        if not hasattr(x, "addressable_shards"):
            host += int(np.prod(np.shape(x))) * size
            continue
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + int(
                np.prod(shard.data.shape) * size
            )
    return host + max(per_device.values(), default=0)


def tree_devices(tree) -> int:
    """How many devices a pytree's arrays lie on (1 for host arrays only)."""
    devices = set()
    for x in jax.tree_util.tree_leaves(tree):
        devices |= set(getattr(getattr(x, "sharding", None), "device_set", ()))
    return max(len(devices), 1)


class Plan(NamedTuple):
    """How many rows (questions) one compiled call holds, and what that should cost:
    `held` (resident before the table: the runtime, the weights) + `per_row` x rows
    (the program's bytes beyond its resident arguments, all charged to the rows),
    within `budget`."""

    rows: int
    per_row: float
    held: float
    budget: Budget
    devices: int = 1  # the devices the program runs on (`plan_rows`)

    def bytes(self, rows: int | None = None) -> float:
        return self.held + self.per_row * (self.rows if rows is None else rows)

    def text(self) -> str:
        return (
            f"{self.rows} question(s) per call at {self.per_row / 2**20:.1f} MiB each"
            f"{_devices_text(self.devices)}, {_gb(self.held)} held: plan "
            f"{_gb(self.bytes())} of a {_gb(self.budget.bytes)} budget ({self.budget.how})"
        )

    def within(self, measured_peak: float) -> "Plan":
        """The plan re-fitted to a chunk whose measured peak was `measured_peak`: the
        per-row cost scaled so that this plan's rows cost what was measured, and the
        rows shrunk (a power of two) until it fits the budget."""
        per = max((measured_peak - self.held) / self.rows, self.per_row)
        rows = _rows_within(self.budget.bytes - self.held, per, self.rows)
        return self._replace(rows=rows, per_row=per)


def _devices_text(devices: int) -> str:
    if devices == 1:
        return ""
    if jax.default_backend() == "cpu":  # `plan_rows`: every device's share is the host's
        return f" (XLA's per-device bytes x {devices} devices, one host's memory)"
    return f" on each of {devices} devices (the budget is one device's)"


CPU_MAX_ROWS = 16  # more per call are not faster on CPU (BUILD_NOTES.md, Memory)
# On CPU a chunk's rows are also capped to about this many seconds of estimated compute:
# more rows per call buy no speed there, and a finished chunk is rows reported and kept
# (at Qwen2-VL-2B's size one patching question is ~30 s: the first row comes after one)
CPU_CHUNK_SECONDS = 30.0


def _rows_within(room: float, per_row: float, most: int) -> int:
    """The largest power of two <= most whose rows cost at most `room` (0: none fits)."""
    fit = room / max(per_row, 1.0)
    if fit < 1:
        return 0
    return int(min(2 ** int(np.floor(np.log2(fit))), most))


def plan_rows(compile_at, n: int, budget: Budget, resident_args: float = 0.0,
              log=print, devices: int = 1, row_seconds: float | None = None) -> Plan:  # fmt: skip
    """The rows per call of a program over rows (a table's questions) within `budget`.

    `compile_at(b)` compiles it for b rows; XLA's memory analysis of it, less
    `resident_args` (arguments already held on one device, e.g. the weights or one
    device's shards of them: `device_bytes`), plus what this process holds now
    (`held_bytes`, counted once) is what a call costs. The rows are at most n (on CPU at
    most CPU_MAX_ROWS): where that is at most CPU_MAX_ROWS, the program at those rows is
    compiled first (the chunk's own program: with `remembered(compile_at)` its compile
    serves the table, so a small table compiles once) and taken where it fits. Else one
    compile at one row, its whole cost charged to every row (its fixed part too: a plan
    that errs on the safe side), and the rows the largest power of two that fits.
    Raises MemoryBudgetError when one row does not fit.

    `devices`: how many devices the program runs on (sharded weights). XLA's analysis
    is one device's: on an accelerator the budget is one device's memory too (and
    `held_bytes` the first device's); on CPU every device is the host's memory, so a
    row costs `devices` times its per-device bytes.

    `row_seconds`: one row's estimated compute (e.g. `questions.log_estimate` over n);
    on CPU the rows are at most those done in `CPU_CHUNK_SECONDS` (at least one)."""
    share = devices if jax.default_backend() == "cpu" else 1
    most = min(n, CPU_MAX_ROWS) if jax.default_backend() == "cpu" else n
    if jax.default_backend() == "cpu" and row_seconds and most > 1:
        in_time = max(int(CPU_CHUNK_SECONDS // row_seconds), 1)
        if in_time < most:
            most = in_time
            log(f"  memory: at most {most} question(s) per call on CPU (~{row_seconds:.0f} s "
                f"each by the estimate: a chunk within ~{CPU_CHUNK_SECONDS:.0f} s)")  # fmt: skip

    def cost(b: int) -> float:
        log(f"  memory: sizing the call (compiling it for {b} question(s))")
        with heartbeat("memory: sizing the call", log):
            out = share * max(compiled_bytes(compile_at(b)) - resident_args, 1.0)
        release_freed()  # the compile's scratch
        return out

    if 1 < most <= CPU_MAX_ROWS:
        whole = cost(most)
        held = held_bytes()
        if held + whole <= budget.bytes:
            return Plan(most, whole / most, held, budget, devices)
    per_row = cost(1)
    held = held_bytes()
    rows = _rows_within(budget.bytes - held, per_row, most)
    if rows < 1:
        raise MemoryBudgetError(
            f"memory: one question needs {_gb(per_row)} beyond the {_gb(held)} held, over "
            f"the budget of {_gb(budget.bytes)} ({budget.how}); raise --memory, lower "
            "--size or load with --dtype=bfloat16"
        )
    return Plan(rows, per_row, held, budget, devices)


class remembered:  # noqa: N801 (used as a function)
    """`compile_at` (b -> a compiled program for b rows) that keeps what it compiled:
    `plan_rows`'s sizing compile is then the table's own where the rows agree
    (`program(b)`: the compiled program for b rows, or None)."""

    def __init__(self, compile_at):
        self._compile_at, self._done = compile_at, {}

    def __call__(self, b: int):
        if b not in self._done:
            self._done[b] = self._compile_at(b)
        return self._done[b]

    def program(self, b: int):
        return self._done.get(b)
