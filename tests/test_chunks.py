"""Tables computed chunk by chunk (`chunks`) and their rows per call sized from the
compiled program (`sizing.rows_for_memory`)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech import sizing
from jaxmech.chunks import ChunkStore, flatten, run_chunks, store_for, unflatten


def _table(rows):
    """A nested table whose last axis is the rows."""
    r = np.asarray(rows, float)
    return {"a": {"x": np.stack([r, -r]), "y": r[None, None] * 2}, "n": r + 0.5}


def _assert_same(a, b):
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k])


def test_flatten_round_trip_and_bad_keys():
    t = _table(np.arange(3))
    _assert_same(unflatten(flatten(t)), t)
    with pytest.raises(ValueError, match="'a/b'"):
        flatten({"a/b": np.zeros(1)})


def test_a_killed_table_resumes_equal_to_an_uninterrupted_one(tmp_path):
    """Chunks finished before a failure are read back, not recomputed; the rest are
    computed; the result equals the uninterrupted table (padding cut)."""
    whole = run_chunks(_table, 7, 3)
    assert flatten(whole)["a/x"].shape == (2, 7)
    store = store_for(str(tmp_path), {"table": "t", "batch": 3})
    calls, kill_at = [], [1]

    def killed(rows):
        calls.append([int(r) for r in rows])
        if len(calls) - 1 in kill_at:
            raise RuntimeError("killed")
        return _table(rows)

    with pytest.raises(RuntimeError, match="killed"):
        run_chunks(killed, 7, 3, store=store)
    assert store.get(0) is not None and store.get(1) is None
    calls.clear(), kill_at.clear()
    seen = []
    resumed = run_chunks(killed, 7, 3, lambda *a: seen.append(a), store)
    assert calls == [[3, 4, 5], [6, 0, 0]]  # chunk 0 read from the store
    assert seen == [(6, 7, 3), (7, 7, 3)]  # done, n, resumed rows
    _assert_same(resumed, whole)


def test_a_stored_chunk_is_what_a_rerun_reads(tmp_path):
    store = store_for(str(tmp_path), {"x": 1})
    run_chunks(_table, 4, 2, store=store)
    store.put(0, jax.tree_util.tree_map(np.zeros_like, store.get(0)))
    again = run_chunks(lambda rows: pytest.fail("recomputed"), 4, 2, store=store)
    np.testing.assert_array_equal(again["n"], [0, 0, 2.5, 3.5])


def test_other_options_get_another_store(tmp_path):
    a, b = store_for(str(tmp_path), {"batch": 2}), store_for(str(tmp_path), {"batch": 4})
    assert a.folder != b.folder and a == store_for(str(tmp_path), {"batch": 2})
    assert os.path.exists(os.path.join(a.folder, "key.json"))
    assert ChunkStore(a.folder).get(0) is None


def test_rows_for_memory_fits_the_compiled_program():
    """The rows chosen are the largest power of two whose compiled footprint fits the
    share of memory given (from XLA's memory analysis at two small sizes)."""
    f = jax.jit(lambda x: jnp.cumsum(jnp.tanh(x), 1))

    def compile_at(b):
        return f.lower(jax.ShapeDtypeStruct((b, 4096), jnp.float32)).compile()

    memory = 2 * sizing.compiled_bytes(compile_at(20))  # half of it: 20 rows' footprint
    rows, how = sizing.rows_for_memory(compile_at, 1000, memory=memory)
    assert rows == 16 and "16 rows" in how
    assert sizing.compiled_bytes(compile_at(rows)) <= sizing.MEMORY_SHARE * memory
    assert sizing.compiled_bytes(compile_at(2 * rows)) > sizing.MEMORY_SHARE * memory
    assert sizing.rows_for_memory(compile_at, 5, memory=memory)[0] == 5  # at most n
