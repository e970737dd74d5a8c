"""`heartbeat`: a line every few seconds while a long call runs, none after it."""

import re
import time

import jax
import jax.numpy as jnp
import pytest

from jaxmech.heartbeat import heartbeat


def test_a_long_block_beats_and_a_short_one_does_not():
    lines = []
    with heartbeat("table", lines.append, every=0.05):
        time.sleep(0.3)
    n = len(lines)
    assert n >= 2 and all(line.startswith("  table: still running (") for line in lines)
    # each line says the process's memory now and at its peak (Linux's /proc)
    m = re.search(r"resident ([0-9.]+) GB, peak ([0-9.]+) GB\)$", lines[-1])
    assert m and 0 < float(m[1]) <= float(m[2])
    time.sleep(0.15)
    assert len(lines) == n  # the beat stops with the block
    quiet = []
    with heartbeat("table", quiet.append, every=5.0):
        pass
    assert quiet == []


def test_the_beat_stops_when_the_block_raises():
    lines = []
    with pytest.raises(ValueError, match="bad row"):
        with heartbeat("table", lines.append, every=0.02):
            raise ValueError("bad row")
    n = len(lines)
    time.sleep(0.1)
    assert len(lines) == n


def test_it_speaks_while_xla_computes():
    # XLA runs a compiled call with Python's lock released: the thread gets to speak
    step = jax.jit(lambda x: jax.lax.fori_loop(0, 12000, lambda i, a: jnp.tanh(a @ a), x))
    x = jnp.full((96, 96), 0.01)
    step(x).block_until_ready()  # compiled outside the block
    lines = []
    t0 = time.perf_counter()
    with heartbeat("table", lines.append, every=0.02):
        jax.device_get(step(x))
    if time.perf_counter() - t0 > 0.1:
        assert lines, "no line while XLA computed"
