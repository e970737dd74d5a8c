"""The one module that talks to Orbax.

A checkpoint folder is an Orbax `CheckpointManager` directory whose steps each hold two
items: `state` (a pytree of arrays, e.g. stacked params or a whole stacked TrainState)
and `meta` (JSON: config, settings, anything the caller needs to check it resumes the
same thing). A later Orbax API change touches only this file.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint folder is unreadable, damaged, or not what the caller expected."""


def _manager(directory: str, max_to_keep: int | None = 2, read_only: bool = False):
    # Readers only pass create=False: Orbax's read_only mode logs warnings on every open.
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            create=not read_only,
            enable_async_checkpointing=False,
        ),
        item_names=("state", "meta"),
    )


def save(directory: str, step: int, state: Any, meta: dict, max_to_keep: int | None = 2) -> None:
    """Writes `state` (arrays pytree) and `meta` (JSON-able dict) as checkpoint `step`."""
    state = jax.tree_util.tree_map(np.asarray, jax.device_get(state))
    with _manager(directory, max_to_keep) as mngr:
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        mngr.wait_until_finished()


def latest_step(directory: str) -> int | None:
    """The newest complete step in `directory`, or None if there is none."""
    if not os.path.isdir(directory):
        return None
    with _manager(directory, read_only=True) as mngr:
        return mngr.latest_step()


def restore(directory: str, step: int | None = None, like: Any = None) -> tuple[Any, dict]:
    """Reads checkpoint `step` (default: latest) -> (state, meta).

    `like` is a pytree with the expected structure (arrays or ShapeDtypeStructs); with
    it a structure or shape mismatch is an error instead of a surprise later.
    Raises CheckpointError naming the folder when nothing readable is there.
    """
    step = latest_step(directory) if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint found in {directory!r}")
    target = None
    if like is not None:
        target = jax.tree_util.tree_map(
            lambda x: (
                jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
                if not isinstance(x, jax.ShapeDtypeStruct)
                else x
            ),
            like,
        )
    try:
        with _manager(directory, read_only=True) as mngr:
            out = mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                ),
            )
    except Exception as e:  # Orbax raises many types; the caller needs one clear one.
        raise CheckpointError(
            f"checkpoint step {step} in {directory!r} is damaged or not a jaxmech "
            f"checkpoint: {type(e).__name__}: {e}"
        ) from e
    state = jax.tree_util.tree_map(np.asarray, out["state"])
    if like is not None:
        want = jax.tree_util.tree_structure(like)
        got = jax.tree_util.tree_structure(state)
        if want != got:
            raise CheckpointError(
                f"checkpoint in {directory!r} has a different structure than expected"
            )
    return state, dict(out["meta"])
