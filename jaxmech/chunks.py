"""Long tables computed chunk by chunk, each finished chunk kept on disk, so that a
killed run resumes at the first chunk it had not finished.

A `ChunkStore` is a folder named by a hash of everything its chunks depend on (the
checkpoint's files, the report, its options; `store_for`): a table with other options
gets another folder, so a finished chunk is never overwritten by a different table's,
and a rerun with the same options reads what is there. Each chunk is one `.npz` of a
nested dict of arrays named by the rows it holds (not by the rows per call, which the
memory plan may change between runs or after a chunk that went over its budget),
written under a temporary name and renamed, so a chunk on disk is whole. The code is not part of the key: after changing it,
remove the folder (or pass another `--out`) to recompute.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, NamedTuple

import numpy as np

from jaxmech import memory
from jaxmech.heartbeat import heartbeat


def chunk_rows(n: int, batch: int) -> list[np.ndarray]:
    """Row indices of `n` questions in chunks of `batch`, the last padded by repeating
    row 0 (so every chunk has one shape and one compiled program serves them all; cut
    the padding with `[:n]` after concatenating)."""
    idx = np.concatenate([np.arange(n), np.zeros(-n % batch, int)])
    return list(idx.reshape(-1, batch))


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{"a/b": array} of a nested dict of arrays (keys must not contain "/")."""
    out = {}
    for k, v in tree.items():
        if "/" in str(k):
            raise ValueError(f"key {k!r}: a chunk's keys may not contain '/'")
        name = f"{prefix}{k}"
        out |= flatten(v, name + "/") if isinstance(v, dict) else {name: np.asarray(v)}
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    for name, v in flat.items():
        *path, last = name.split("/")
        node = out
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return out


class ChunkStore(NamedTuple):
    """Finished chunks of one table, each named by the rows it holds (`rows_START-STOP`),
    so a rerun reads them whatever rows per call it now runs."""

    folder: str

    def path(self, start: int, stop: int) -> str:
        return os.path.join(self.folder, f"rows_{start:06d}-{stop:06d}.npz")

    def get(self, start: int) -> dict | None:
        """The finished chunk whose first row is `start`, or None (also for a chunk whose
        arrays come back as raw bytes: written before `put` kept ml_dtypes)."""
        prefix = f"rows_{start:06d}-"
        names = [n for n in os.listdir(self.folder) if n.startswith(prefix) and n.endswith(".npz")
                 and ".tmp" not in n]  # fmt: skip
        if not names:
            return None
        with np.load(os.path.join(self.folder, max(names))) as f:
            flat = _typed({k: f[k] for k in f.files})
        if any(v.dtype.kind == "V" and not _ml(v) for v in flat.values()):
            return None  # raw bytes: written before dtypes were kept; computed again
        return unflatten(flat)

    def put(self, start: int, tree: dict) -> None:
        """Keeps chunk `tree` (its rows on the last axis) as the rows from `start` on."""
        tmp = self.path(start, start + n_rows(tree)) + ".tmp.npz"
        np.savez(tmp, **_untyped(flatten(tree)))
        os.replace(tmp, self.path(start, start + n_rows(tree)))


# NumPy's npz keeps only its own dtypes: an ml_dtypes array (a bf16 table's log-probs)
# would come back as raw bytes ("V2"). Such arrays are stored as unsigned ints of their
# width beside the dtype's name and viewed back on reading, bit for bit.
_DTYPE_KEY = "::dtype"


def _ml(v: np.ndarray) -> bool:
    return v.dtype.type.__module__.startswith("ml_dtypes")


def _untyped(flat: dict) -> dict:
    out = {}
    for k, v in flat.items():
        if _ml(v):
            out[k] = v.view(f"u{v.dtype.itemsize}")
            out[k + _DTYPE_KEY] = np.asarray(v.dtype.name)
        else:
            out[k] = v
    return out


def _typed(flat: dict) -> dict:
    import ml_dtypes

    names = {k[: -len(_DTYPE_KEY)]: str(v) for k, v in flat.items() if k.endswith(_DTYPE_KEY)}
    return {k: v.view(getattr(ml_dtypes, names[k])) if k in names else v
            for k, v in flat.items() if not k.endswith(_DTYPE_KEY)}  # fmt: skip


def n_rows(tree: dict) -> int:
    """The rows of a chunk (the last axis of its leaves)."""
    return int(np.shape(next(iter(flatten(tree).values())))[-1])


def file_stamps(folder: str) -> list:
    """[(name, bytes, mtime ns)] of the files in `folder`: a checkpoint's identity for
    the key (re-downloaded or edited weights get a new store)."""
    names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
    stats = [os.stat(os.path.join(folder, n)) for n in names]
    return [(n, s.st_size, s.st_mtime_ns) for n, s in zip(names, stats)]


def store_for(root: str, what: dict) -> ChunkStore:
    """The store of the table described by `what` (JSON-able) under `root`: the folder
    `root/KEY` (KEY a hash of `what`, written beside the chunks as key.json)."""
    text = json.dumps(what, sort_keys=True, default=list)
    folder = os.path.join(root, hashlib.sha256(text.encode()).hexdigest()[:16])
    os.makedirs(folder, exist_ok=True)
    key = os.path.join(folder, "key.json")
    if not os.path.exists(key):
        with open(key + ".tmp", "w") as f:
            f.write(text)
        os.replace(key + ".tmp", key)
    return ChunkStore(folder)


def run_chunks(fn: Callable[[np.ndarray], dict], n: int, batch: int, progress=None,
               store: ChunkStore | None = None, plan=None, log=print) -> dict:  # fmt: skip
    """`fn(rows)` (a nested dict of host arrays whose last axis is the rows) over rows
    0..n-1, `batch` at a time (the last chunk padded by repeating row 0, so one compiled
    program serves every chunk; the padding is cut), concatenated on the last axis.

    With a `store`, finished chunks are read from it and each new one written to it.
    `progress(done, n, resumed)` after each computed chunk (`resumed`: the rows read
    from the store). With a `plan` (`memory.Plan` of `batch` rows), each computed
    chunk's peak memory is measured; over the plan's budget, the rows per call shrink
    for the chunks after it (`Plan.within`), and when not even one row fits the table
    stops with `memory.MemoryBudgetError` (its finished chunks kept in the store)."""
    outs, resumed, start, resumed_chunks = [], 0, 0, 0
    while start < n:
        out = store.get(start) if store is not None else None
        if out is not None:
            stop = start + n_rows(out)
            resumed += stop - start
            resumed_chunks += 1
        else:
            stop = min(start + batch, n)
            rows = np.concatenate([np.arange(start, stop), np.zeros(batch - (stop - start), int)])
            if plan is not None:
                memory.reset_peak()
            # the first chunk also compiles the program: often the longest silence
            with heartbeat(f"rows {start + 1}-{stop} of {n}", log):
                out = cut_rows(fn(rows), stop - start)
            if store is not None:
                store.put(start, out)
            if progress is not None:
                progress(stop, n, min(resumed, n))
            if plan is not None:
                plan = _measured(plan, log, first=len(outs) == resumed_chunks)
                batch = plan.rows
        outs.append(out)
        start = stop
    cat = lambda *x: np.concatenate(x, -1)  # noqa: E731
    return unflatten({k: cat(*(flatten(o)[k] for o in outs)) for k in flatten(outs[0])})


def cut_rows(tree: dict, rows: int) -> dict:
    """`tree` (host arrays, rows on the last axis) cut to its first `rows` rows."""
    return unflatten({k: np.asarray(v)[..., :rows] for k, v in flatten(tree).items()})


def _measured(plan, log, first: bool = False):
    """`plan` after a chunk: the first one's measured peak logged beside the plan; over
    the budget, re-fitted to what was measured (`Plan.within`)."""
    peak = memory.peak_bytes()
    if first:
        log(f"  memory: the first chunk peaked at {peak / 2**30:.2f} GB resident (plan "
            f"{plan.bytes() / 2**30:.2f} GB)")  # fmt: skip
    if peak <= plan.budget.bytes:
        return plan
    new = plan.within(peak)
    if new.rows < 1:
        raise memory.MemoryBudgetError(
            f"memory: a chunk of {plan.rows} question(s) peaked at {peak / 2**30:.1f} GB, over the "
            f"budget of {plan.budget.bytes / 2**30:.1f} GB ({plan.budget.how}), and one question "
            "would not fit either; raise --memory (finished chunks are kept)"
        )
    log(f"  memory: a chunk of {plan.rows} peaked at {peak / 2**30:.1f} GB (plan "
        f"{plan.bytes() / 2**30:.1f} GB), over the budget: {new.rows} per call from here")  # fmt: skip
    return new
