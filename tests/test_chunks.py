"""Tables computed chunk by chunk (`chunks`) and their rows per call sized from the
compiled program within a memory budget (`memory.plan_rows`)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech import memory
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
    assert store.get(0) is not None and store.get(3) is None  # chunks by their first row
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


def test_a_bfloat16_chunk_reads_back_bit_for_bit(tmp_path):
    """A bf16 table's chunk (ml_dtypes arrays, which npz alone returns as raw bytes)
    reads back with its dtype and bits, so a resumed bf16 table is the uninterrupted
    one."""
    import ml_dtypes

    store = store_for(str(tmp_path), {"t": 1})
    x = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7).astype(ml_dtypes.bfloat16)
    store.put(0, {"logp": {"id": x}, "n": np.arange(4)})
    back = ChunkStore(store.folder).get(0)
    assert back["logp"]["id"].dtype == ml_dtypes.bfloat16 and back["n"].dtype == np.arange(1).dtype
    np.testing.assert_array_equal(back["logp"]["id"].view(np.uint16), x.view(np.uint16))
    assert set(back) == {"logp", "n"} and set(back["logp"]) == {"id"}
    # a chunk written as raw bytes (before dtypes were kept) is computed again, not read
    np.savez(store.path(4, 7), **{"logp/id": x})
    assert ChunkStore(store.folder).get(4) is None


def test_other_options_get_another_store(tmp_path):
    a, b = store_for(str(tmp_path), {"batch": 2}), store_for(str(tmp_path), {"batch": 4})
    assert a.folder != b.folder and a == store_for(str(tmp_path), {"batch": 2})
    assert os.path.exists(os.path.join(a.folder, "key.json"))
    assert ChunkStore(a.folder).get(0) is None


def _compile_at(b):
    f = jax.jit(lambda x: jnp.cumsum(jnp.tanh(x), 1))
    return f.lower(jax.ShapeDtypeStruct((b, 4096), jnp.float32)).compile()


def test_a_small_table_s_sizing_compile_is_its_own_program(monkeypatch):
    """Where every row fits one call (n <= CPU_MAX_ROWS), the program is compiled once,
    at n rows, and `remembered` hands that compile to the table; over the budget, one
    row is compiled too and charged to every row."""
    monkeypatch.setattr(memory, "held_bytes", lambda: 1e9)
    calls = []
    at = memory.remembered(lambda b: calls.append(b) or _compile_at(b))
    plan = memory.plan_rows(at, 4, memory.Budget(1e12, "test"), log=lambda *_: None)
    assert plan.rows == 4 and calls == [4]
    assert at.program(4) is at(4) and calls == [4] and at.program(1) is None
    four = memory.compiled_bytes(at(4))
    tight = memory.Budget(1e9 + four - 1, "test")  # 4 rows do not fit
    calls.clear()
    again = memory.plan_rows(memory.remembered(lambda b: calls.append(b) or _compile_at(b)),
                             4, tight, log=lambda *_: None)  # fmt: skip
    assert calls == [4, 1] and again.rows < 4 and again.bytes() <= tight.bytes


def test_on_cpu_a_chunk_holds_about_chunk_seconds_of_estimated_compute(monkeypatch):
    """A row estimated at a third of `CPU_CHUNK_SECONDS` gets 3 rows per call (compiled
    once, at 3), a row over it one, whatever the memory would allow; rows estimated
    fast, or no estimate, leave the plan to the memory; the cap is logged."""
    monkeypatch.setattr(memory, "held_bytes", lambda: 1e9)
    big, lines = memory.Budget(1e12, "test"), []
    chunk = memory.CPU_CHUNK_SECONDS
    for row_s, rows in [(chunk / 3, 3), (2 * chunk, 1), (chunk / 100, 8), (None, 8)]:
        calls, lines = [], []
        at = memory.remembered(lambda b, calls=calls: calls.append(b) or _compile_at(b))
        plan = memory.plan_rows(at, 8, big, log=lines.append, row_seconds=row_s)
        assert plan.rows == rows and calls == [rows], (row_s, plan, calls)
        assert any("per call on CPU" in t for t in lines) == (rows < 8)


def test_plan_rows_fits_the_compiled_program_beside_what_is_held(monkeypatch):
    """The rows planned are the largest power of two whose cost (XLA's analysis of the
    program for one row, beyond its resident arguments, per row) fits the budget
    beside the bytes held now, counted once; one row that does not fit is refused,
    naming --memory."""
    monkeypatch.setattr(memory, "held_bytes", lambda: 1e9)
    one = memory.compiled_bytes(_compile_at(1))
    budget = memory.Budget(1e9 + 10 * (one - 100), "test")
    plan = memory.plan_rows(_compile_at, 1000, budget, resident_args=100, log=lambda *_: None)
    assert plan.rows == 8 and plan.held == 1e9 and plan.per_row == one - 100
    assert plan.bytes() <= budget.bytes < plan.bytes(16)
    safe = memory.plan_rows(_compile_at, 1000, budget, log=lambda *_: None)
    assert safe.bytes(8) >= 1e9 + memory.compiled_bytes(_compile_at(8))  # errs on the safe side
    assert "8 question(s) per call" in plan.text() and "budget" in plan.text()
    assert memory.plan_rows(_compile_at, 5, budget, log=lambda *_: None).rows == 5  # all n
    with pytest.raises(memory.MemoryBudgetError, match="--memory"):
        memory.plan_rows(_compile_at, 8, memory.Budget(1e9, "test"), log=lambda *_: None)


def test_memory_budget_reads_gb_fractions_and_percents():
    total = memory.host_memory()
    assert memory.memory_budget("8").bytes == 8 * 2**30
    assert memory.memory_budget("2.5GB").bytes == 2.5 * 2**30
    assert memory.memory_budget("0.25").bytes == pytest.approx(0.25 * total)
    assert memory.memory_budget("30%").bytes == pytest.approx(0.3 * total)
    default = memory.memory_budget()
    assert 0 < default.bytes <= memory.DEFAULT_BUDGET_SHARE * total and default.how
    for bad in ("lots", "-1", "0", "150%"):
        with pytest.raises(ValueError, match="--memory"):
            memory.memory_budget(bad)


def test_a_chunk_over_its_budget_shrinks_the_rest(tmp_path, monkeypatch):
    """A chunk whose measured peak went over the budget makes the next chunks smaller
    (re-fitted to what was measured); the table equals the unchunked one, and a rerun
    with another batch reads the chunks stored under their rows."""
    peaks = iter([9e9] + [1e9] * 10)
    monkeypatch.setattr(memory, "peak_bytes", lambda: next(peaks))
    plan = memory.Plan(rows=4, per_row=1e9, held=0.0, budget=memory.Budget(5e9, "t"))
    calls = []

    def fn(rows):
        calls.append(len(rows))
        return _table(rows)

    store = store_for(str(tmp_path), {"table": "t"})
    out = run_chunks(fn, 9, 4, store=store, plan=plan, log=lambda *_: None)
    assert calls == [4, 2, 2, 2]  # 9 GB for 4 rows: 2.25 GB a row, 2 fit in 5 GB
    _assert_same(out, run_chunks(_table, 9, 9))
    again = run_chunks(lambda rows: pytest.fail("recomputed"), 9, 8, store=store)
    _assert_same(again, out)
    with pytest.raises(memory.MemoryBudgetError, match="--memory"):
        peaks = iter([9e9])
        run_chunks(_table, 9, 4, plan=plan._replace(budget=memory.Budget(1e9, "t")))
