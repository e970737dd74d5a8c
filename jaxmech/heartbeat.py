"""A line every few seconds while a long call runs (a compile, a table's chunk), so a
command at a real model's size is never silent for long. XLA compiles and computes
with Python's lock released, so a daemon thread can speak meanwhile; the call itself is
untouched (same program, same numbers)."""

from __future__ import annotations

import contextlib
import threading
import time

EVERY_S = 10.0  # the longest silence a long call leaves


@contextlib.contextmanager
def heartbeat(what: str, log=print, every: float = EVERY_S):
    """Within the block, `log("  {what}: still running (N s)")` every `every` seconds
    (none for a block shorter than that; `every <= 0` or `log=None`: none at all)."""
    if log is None or every <= 0:
        yield
        return
    done, t0 = threading.Event(), time.perf_counter()

    def beat():
        while not done.wait(every):
            log(f"  {what}: still running ({time.perf_counter() - t0:.0f} s)")

    thread = threading.Thread(target=beat, name="jaxmech-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
