"""A line every few seconds while a long call runs (a compile, a table's chunk), so a
command at a real model's size is never silent for long. XLA compiles and computes
with Python's lock released, so a daemon thread can speak meanwhile; the call itself is
untouched (same program, same numbers). Each line carries the process's resident
memory and its peak (where the OS says), so a run at a real model's size shows which
phase (the compile, the compute) takes its memory."""

from __future__ import annotations

import contextlib
import threading
import time

EVERY_S = 10.0  # the longest silence a long call leaves


def status_bytes(field: str) -> int | None:
    """A byte count of this process's `/proc/self/status` (`VmRSS`, `VmHWM`), or None
    where the OS has no such file (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident() -> str:
    """The suffix "; resident X GB, peak Y GB" (this process, host memory), or "" where
    the OS does not say."""
    now, peak = status_bytes("VmRSS"), status_bytes("VmHWM")
    if now is None or peak is None:
        return ""
    return f"; resident {now / 1e9:.1f} GB, peak {peak / 1e9:.1f} GB"


@contextlib.contextmanager
def heartbeat(what: str, log=print, every: float = EVERY_S):
    """Within the block, `log("  {what}: still running (N s; resident X GB, peak Y GB)")`
    every `every` seconds (none for a block shorter than that; `every <= 0` or
    `log=None`: none at all)."""
    if log is None or every <= 0:
        yield
        return
    done, t0 = threading.Event(), time.perf_counter()

    def beat():
        while not done.wait(every):
            log(f"  {what}: still running ({time.perf_counter() - t0:.0f} s{resident()})")

    thread = threading.Thread(target=beat, name="jaxmech-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
