"""Orbax saves: the one module that talks to Orbax.

A save folder is an Orbax `CheckpointManager` directory whose steps each hold two items:
`state` (a pytree of arrays, e.g. stacked params or a whole stacked TrainState) and
`meta` (JSON: config, settings, anything the caller needs to check it resumes the same
thing). "Save", not "checkpoint": in jaxmech a checkpoint is a model family's Hugging
Face folder, which this module never reads. A later Orbax API change touches only this
file. In a multi-process run (`jax.distributed`) a folder is read and written by one
process alone, from host arrays (`save` gathers none): a sweep's process 0, which holds
every model's state after each segment (`train.fetch`).

Integrity: Orbax does not notice a flipped byte in its data files (it loads it, or
fails with a raw tensorstore error). So `save` adds a manifest to each step folder,
`MANIFEST` (relative path -> size and sha256 of every file Orbax wrote), and `restore`
checks it before Orbax reads anything. Orbax ignores the extra file (it never rewrites
a finished step, and deletes the whole folder when `max_to_keep` drops a step). A step
without a manifest (written before manifests existed, or by a save interrupted between
Orbax finishing and the manifest landing) is legacy: accepted unchecked. Files in a
step folder that the manifest does not list are ignored (Orbax wrote none after it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

MANIFEST = "jaxmech_manifest.json"  # in each step folder, next to Orbax's files
# The stored name keeps the module's old word: every save written so far carries it, and
# `_read_manifest` calls a manifest with another format damaged. Never rename it.
_MANIFEST_FORMAT = "jaxmech-checkpoint-manifest/1"


class SaveError(RuntimeError):
    """A save folder is unreadable, damaged, or not what the caller expected."""


def _without_closed_loop_noise(previous: Callable) -> Callable:
    """An unraisable hook that drops RuntimeError('Event loop is closed') and passes
    everything else on to `previous`.

    Why: after a failed read, tensorstore still delivers completions to Orbax's asyncio
    loop, which Orbax has already closed; each is reported through sys.unraisablehook
    as a full traceback (one per pending read), burying the one error that matters.
    """

    def hook(unraisable):
        exc = unraisable.exc_value
        if type(exc) is RuntimeError and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook.jaxmech_filter = True  # lets a re-import see it is installed already
    return hook


if not getattr(sys.unraisablehook, "jaxmech_filter", False):
    sys.unraisablehook = _without_closed_loop_noise(sys.unraisablehook)


def _manager(directory: str, max_to_keep: int | None = 2, read_only: bool = False):
    # Readers only pass create=False: Orbax's read_only mode logs warnings on every open.
    directory = os.path.abspath(directory)
    alone = {}
    if jax.process_count() > 1:
        # In a multi-process run one process reads and writes a folder (a sweep's
        # process 0) on host arrays it holds whole; Orbax would otherwise wait at a
        # barrier for every process. It refuses to create the folder in this mode.
        me = jax.process_index()
        alone = {"multiprocessing_options": ocp.options.MultiprocessingOptions(
            primary_host=me, active_processes={me})}  # fmt: skip
        if not read_only:
            os.makedirs(directory, exist_ok=True)
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            create=not read_only and not alone,
            enable_async_checkpointing=False,
            **alone,
        ),
        item_names=("state", "meta"),
    )


def _step_dir(directory: str, step: int) -> str:
    """The folder of `step` (Orbax's default step naming: the bare number)."""
    return os.path.join(os.path.abspath(directory), str(step))


# --- manifest ----------------------------------------------------------------------


def _sha256(path: str) -> str:
    """Hex sha256 of the file at `path`, read in 1 MiB blocks (params can be large;
    hashlib.file_digest needs Python 3.11)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _step_files(step_dir: str) -> list[str]:
    """Relative '/'-separated paths of the files in `step_dir`, bar the manifest (and
    a manifest temp file a crash may have left)."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if not rel.startswith(MANIFEST):
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _entries_digest(files: dict) -> str:
    """sha256 of the manifest's file table, so damage to the manifest itself is
    reported as such, not as a mismatch of the data file whose entry it hit."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _write_manifest(step_dir: str) -> None:
    """Records size and sha256 of every file in `step_dir`, atomically: a step has a
    complete manifest or none (a temp file replaced in one rename)."""
    files = {
        rel: {
            "size": os.path.getsize(os.path.join(step_dir, rel)),
            "sha256": _sha256(os.path.join(step_dir, rel)),
        }
        for rel in _step_files(step_dir)
    }
    body = {"format": _MANIFEST_FORMAT, "files": files, "sha256": _entries_digest(files)}
    path = os.path.join(step_dir, MANIFEST)
    with open(path + ".tmp", "w") as fh:
        json.dump(body, fh, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def _read_manifest(step_dir: str) -> dict | None:
    """The manifest's file table, None when the step has no manifest (legacy).
    Raises SaveError naming the manifest when it is itself damaged."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as fh:
            body = json.loads(fh.read().decode())
        files = body["files"]
        intact = (
            isinstance(files, dict)
            and body["format"] == _MANIFEST_FORMAT
            and body["sha256"] == _entries_digest(files)
        )
    except (ValueError, KeyError, TypeError):  # not UTF-8 / not JSON / wrong shape
        intact = False
    if not intact:
        raise SaveError(
            f"{path}: manifest is damaged (unreadable or differs from its own checksum)"
        )
    return files


def _file_problem(path: str, entry: dict) -> str | None:
    """What is wrong with file `path` against its manifest entry, None if nothing."""
    if not os.path.isfile(path):
        return "file is missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"size is {size} bytes, the manifest says {entry['size']}"
    if _sha256(path) != entry["sha256"]:
        return "content differs from its sha256 checksum"
    return None


def _damage(step_dir: str) -> list[str] | None:
    """['<path>: <problem>', ...] for the files of `step_dir` that differ from its
    manifest ([] when intact), None for a legacy step without a manifest."""
    try:
        files = _read_manifest(step_dir)
    except SaveError as e:
        return [str(e)]
    if files is None:
        return None
    problems = []
    for rel, entry in files.items():
        path = os.path.join(step_dir, *rel.split("/"))
        problem = _file_problem(path, entry)
        if problem:
            problems.append(f"{path}: {problem}")
    return problems


def verify(directory: str, step: int) -> bool:
    """Checks save step `step` in `directory` against its manifest without Orbax.

    Returns True when it was checked and is intact, False for a legacy step (no
    manifest: written before manifests existed) that is accepted unchecked. Raises
    SaveError naming each damaged file (content or size differs, or missing) or
    a damaged manifest. Files the manifest does not list are ignored.
    """
    step_dir = _step_dir(directory, step)
    if not os.path.isdir(step_dir):
        raise SaveError(f"no save step {step} in {directory!r} ({step_dir} is missing)")
    problems = _damage(step_dir)
    if problems:
        raise SaveError(
            f"save step {step} in {directory!r} is damaged: {'; '.join(problems)}. "
            f"Move or delete {step_dir} to resume from an older step (restore_latest "
            "moves it aside)"
        )
    return problems is not None


# --- save / restore ------------------------------------------------------------------


def save(directory: str, step: int, state: Any, meta: dict, max_to_keep: int | None = 2) -> None:
    """Writes `state` (arrays pytree) and `meta` (JSON-able dict) as save step `step`,
    then its manifest (see the module docstring)."""
    state = jax.tree_util.tree_map(np.asarray, jax.device_get(state))
    try:
        with _manager(directory, max_to_keep) as mngr:
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
            mngr.wait_until_finished()
    except Exception as e:  # a full disk or a lost mount, in whatever type Orbax raises
        raise SaveError(  # on one line: it is the last line a crash prints
            f"could not write save step {step} to {directory!r}: "
            f"{type(e).__name__}: {' '.join(str(e).split())}"
        ) from e
    step_dir = _step_dir(directory, step)
    if not os.path.isdir(step_dir):  # Orbax changed its step naming: fix _step_dir
        raise SaveError(f"Orbax wrote step {step} of {directory!r} but not to {step_dir}")
    _write_manifest(step_dir)


def latest_step(directory: str) -> int | None:
    """The newest complete step in `directory`, or None if there is none (unchecked:
    see `restore_latest` for the newest intact one)."""
    steps = _steps(directory)
    return steps[0] if steps else None


def _steps(directory: str) -> list[int]:
    """The complete steps in `directory` as Orbax lists them, newest first."""
    if not os.path.isdir(directory):
        return []
    with _manager(directory, read_only=True) as mngr:
        return sorted(mngr.all_steps(), reverse=True)


def restore(directory: str, step: int | None = None, like: Any = None) -> tuple[Any, dict]:
    """Reads save step `step` (default: latest) -> (state, meta).

    `like` is a pytree with the expected structure (arrays or ShapeDtypeStructs); with
    it a structure or shape mismatch is an error instead of a surprise later.
    The step is verified first (`verify`), so damage never reaches Orbax.
    Raises SaveError naming the folder when nothing readable is there, or the
    damaged file.
    """
    step = latest_step(directory) if step is None else step
    if step is None:
        raise SaveError(f"no save found in {directory!r}")
    verify(directory, step)
    return _read(directory, step, like)


def restore_latest(
    directory: str, like: Any = None, log: Callable[[str], Any] = print
) -> tuple[Any, dict, int] | None:
    """(state, meta, step) of the newest intact step in `directory`, None when there is
    no step or none is intact.

    Each damaged step on the way is moved aside to '<step>.damaged' (Orbax does not
    list it, and a later save of the same step number works) with one warning line
    through `log` naming the damaged file and the step it falls back to. A legacy step
    (no manifest) counts as intact; if Orbax then cannot read it, or it does not match
    `like`, that SaveError is raised, not skipped: it may be a wrong `like`.
    """
    steps = _steps(directory)
    for i, step in enumerate(steps):
        problems = _damage(_step_dir(directory, step))
        if not problems:
            state, meta = _read(directory, step, like)
            return state, meta, step
        aside = _set_aside(_step_dir(directory, step))
        older = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no older step"
        log(
            f"warning: save step {step} in {directory!r} is damaged "
            f"({'; '.join(problems)}); moved it to {aside}; {older}"
        )
    return None


def _set_aside(step_dir: str) -> str:
    """Renames a damaged step folder to '<step>.damaged[.n]' (a name Orbax does not
    take for a step) and returns the new path; kept for inspection, not deleted."""
    target, n = step_dir + ".damaged", 1
    while os.path.exists(target):
        n += 1
        target = f"{step_dir}.damaged.{n}"
    os.rename(step_dir, target)
    return target


def _read(directory: str, step: int, like: Any) -> tuple[Any, dict]:
    """Orbax's restore of `step` -> (state, meta), errors turned into SaveError."""
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
        raise SaveError(  # on one line: it is the last line a crash prints
            f"save step {step} in {directory!r} is damaged or not a jaxmech "
            f"save: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from e
    state = jax.tree_util.tree_map(np.asarray, out["state"])
    if like is not None:
        want = jax.tree_util.tree_structure(like)
        got = jax.tree_util.tree_structure(state)
        if want != got:
            raise SaveError(f"save in {directory!r} has a different structure than expected")
    return state, dict(out["meta"])
