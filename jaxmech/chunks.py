"""Long tables computed chunk by chunk, each finished chunk kept on disk, so that a
killed run resumes at the first chunk it had not finished.

A `ChunkStore` is a folder named by a hash of everything its chunks depend on (the
checkpoint's files, the report, its options, the chunk size; `store_for`): a table with
other options gets another folder, so a finished chunk is never overwritten by a
different table's, and a rerun with the same options reads what is there. Each chunk
is one `.npz` of a nested dict of arrays, written under a temporary name and renamed,
so a chunk on disk is whole. The code is not part of the key: after changing it,
remove the folder (or pass another `--out`) to recompute.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, NamedTuple

import numpy as np


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
    folder: str

    def path(self, c: int) -> str:
        return os.path.join(self.folder, f"chunk_{c:05d}.npz")

    def get(self, c: int) -> dict | None:
        """Chunk c as written, or None if it was not finished."""
        if not os.path.exists(self.path(c)):
            return None
        with np.load(self.path(c)) as f:
            return unflatten({k: f[k] for k in f.files})

    def put(self, c: int, tree: dict) -> None:
        tmp = self.path(c) + ".tmp.npz"
        np.savez(tmp, **flatten(tree))
        os.replace(tmp, self.path(c))


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
               store: ChunkStore | None = None) -> dict:  # fmt: skip
    """`fn(rows)` (a nested dict of host arrays whose last axis is the rows) over rows
    0..n-1, `batch` at a time (the last chunk padded: `chunk_rows`), concatenated on
    the last axis and cut to n. With a `store`, finished chunks are read from it and
    each new one written to it. `progress(done, n, resumed)` after each computed chunk
    (`resumed`: the rows read from the store)."""
    outs, resumed = [], 0
    for c, rows in enumerate(chunk_rows(n, batch)):
        out = store.get(c) if store is not None else None
        if out is not None:
            resumed += len(rows)
        else:
            out = fn(rows)
            if store is not None:
                store.put(c, out)
            if progress is not None:
                progress(min((c + 1) * batch, n), n, min(resumed, n))
        outs.append(out)
    cat = lambda *x: np.concatenate(x, -1)[..., :n]  # noqa: E731
    return unflatten({k: cat(*(flatten(o)[k] for o in outs)) for k in flatten(outs[0])})
