"""Several processes (`jax.distributed`): process 0 reads and writes the sweep's folder,
every process trains.

`is_writer` says which process writes; `_on_writer` runs a read on process 0 and hands
its result (host arrays, shared bit for bit by `_share`) to every process, and stops
the others with `OtherProcessError` when process 0 fails.
"""

from __future__ import annotations

import jax
import numpy as np


class OtherProcessError(RuntimeError):
    """Process 0 of a multi-process sweep stopped with an error (its output names it)."""


def is_writer() -> bool:
    """Whether this process writes a sweep's folder: process 0 (the only one, usually)."""
    return jax.process_index() == 0


def _quiet(*_) -> None:
    pass


def _share(tree):
    """Process 0's host arrays `tree` on every process, bit for bit (each process passes
    a tree of the same shapes and dtypes)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    # gathered, then process 0's row: broadcast_one_to_all adds zeros, which turns -0.0
    # into 0.0 (a resumed model would then differ from an uninterrupted one)
    stacked = multihost_utils.process_allgather(tree, tiled=False)
    return jax.tree_util.tree_map(lambda x: np.array(x[0]), stacked)  # a writable copy


def _on_writer(read, like):
    """`read()` run by process 0; its result (None, or host arrays shaped as `like`) on
    every process. An error in `read` is raised on process 0 and as OtherProcessError on
    the others, so that no process waits for a peer that stopped."""
    tree, code = None, 0
    if is_writer():
        try:
            tree = read()
        except BaseException:
            _share(np.int32(2))  # tell the others before raising
            raise
        code = 0 if tree is None else 1
    code = int(_share(np.int32(code)))
    if code == 2:
        raise OtherProcessError(
            "process 0 of this multi-process sweep stopped with an error (its output says "
            "which); every process stops"
        )
    if code == 0:
        return None
    zeros = lambda x: np.zeros(np.shape(x), x.dtype)  # noqa: E731
    return _share(tree if is_writer() else jax.tree_util.tree_map(zeros, like))
