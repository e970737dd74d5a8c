"""Fine-tune starts: a sweep's models starting from the trained params of a finished
results folder (`InitFrom`) instead of a fresh init.

Every check of an `InitFrom` against a grid runs before any compute (`check_init_from`,
the `_check_*`: a ValueError naming the argument, `init_from.run` / `.models` /
`.static`); `_start` resolves it into the starting params and the record `sweep.json`
keeps (with sha256 fingerprints, `params_fingerprint`), and `_start_difference` says how
a folder's record differs from a new one (`record.sweep_difference`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmech import outdir, results
from jaxmech.sweep.spec import Grid
from jaxmech.train import (
    init_program,
    pad_models,
    stack_settings,
)


class InitFrom(NamedTuple):
    """Where a sweep's models start: the trained params of a finished results folder
    instead of a fresh init (`run_grid(..., init_from=...)`).

    run: the base run, a finished results folder (`results.load_run`) of the grid's
      model family (`model_kind`) whose params fit the grid config's models.
    models: one entry per model of the grid, in the grid's order: the index of the base
      model (results.csv `model`, the params' row) it starts from. A base model may
      start several grid models; a diverged one starts none.
    static: optional per-model constants of `params["static"]` that replace or add to
      the base's: {name: array [K, ...]} for the grid's K models, each a constant the
      grid config's models have (e.g. `id_target` when `id_site > 0`). Values are cast
      to the constant's dtype. For `check_init_from` alone a value may be a
      `jax.ShapeDtypeStruct` (checked by shape, before the values are computed).

    Each model starts at step 0 from its params with a fresh optimiser state
    (`train.restart_state`); its seed still draws its batches.
    """

    run: str
    models: tuple[int, ...]
    static: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class _Start:
    """A resolved `InitFrom`: the starting params and what `sweep.json` records."""

    params: Any  # host NumPy [n_chunks * chunk, ...] (padded by repeating the last model)
    record: dict  # `identity`'s "init_from" (see `_start`)


def params_fingerprint(tree) -> str:
    """sha256 over a params tree: each leaf's path, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.ascontiguousarray(np.asarray(x))
        h.update(f"{jax.tree_util.keystr(path)} {x.dtype.str} {x.shape}\n".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _check_base(grid: Grid, init_from, out: str | None) -> None:
    """Checks `init_from`'s type and its base run's folder (not `out`; a finished
    results folder, from config.json alone) and family."""
    if not isinstance(init_from, InitFrom):
        raise TypeError(
            f"init_from = {init_from!r}: expected a sweep.InitFrom(run, models, static)"
        )
    run = init_from.run
    if not isinstance(run, (str, os.PathLike)):
        raise ValueError(f"init_from.run = {run!r}: expected the path of a results folder")
    mine = {os.path.abspath(out), os.path.abspath(outdir.staging_path(out))} if out else set()
    if os.path.abspath(run) in mine:
        raise ValueError(
            f"init_from.run = {run!r} is the sweep's own output folder: a sweep cannot start "
            "from the folder it writes; choose another --out"
        )
    try:
        kind = results.load_config(run).model.model_kind
    except ValueError as e:
        raise ValueError(f"init_from.run: {e}") from None
    if kind != grid.config.model.model_kind:
        raise ValueError(
            f"init_from.run = {run!r} holds model_kind = {kind!r} models, this grid trains "
            f"{grid.config.model.model_kind!r}: a model starts only from params of its own "
            "family"
        )


def _check_models(models, k: int) -> list[int]:
    """`init_from.models` as K ints (their range is checked against the base run)."""
    try:
        if isinstance(models, (str, bytes)) or any(isinstance(m, bool) for m in models):
            raise TypeError
        models = [operator.index(m) for m in models]
    except TypeError:
        raise ValueError(
            f"init_from.models = {models!r}: expected one base model index (an integer) per "
            "model of the grid"
        ) from None
    if len(models) != k:
        raise ValueError(
            f"init_from.models has {len(models)} entries for the grid's {k} model(s): give "
            "one base model index per model of the grid"
        )
    return models


def _check_in_base(models: list[int], base: results.Run, run: str) -> None:
    """Every base model index names a model of the base run that did not diverge."""
    n_base = len(np.asarray(base.settings.seed))
    rows = {int(r["model"]): r for r in base.results if "model" in r}
    for i, m in enumerate(models):
        if not 0 <= m < n_base:
            raise ValueError(
                f"init_from.models[{i}] = {m} is out of range: {run!r} has {n_base} "
                f"model(s), 0..{n_base - 1}"
            )
        div = int(rows.get(m, {}).get("diverged_step", -1))
        if div >= 0:
            raise ValueError(
                f"init_from.models[{i}] = {m}: base model {m} of {run!r} diverged at step "
                f"{div}; its params are the last finite ones, not a trained model"
            )


def _check_static(static: dict, like_static: dict, k: int) -> None:
    """Each override names one of the grid's constants, with one row per model."""
    for name, v in static.items():
        if name not in like_static:
            raise ValueError(
                f"init_from.static[{name!r}]: not a constant of this grid's models "
                f"(params['static'] holds {', '.join(sorted(like_static)) or 'nothing'})"
            )
        want = (k, *like_static[name].shape[1:])
        if _shape(v) != want:
            raise ValueError(
                f"init_from.static[{name!r}] has shape {_shape(v)}: expected {want} (one "
                "row per model of the grid, then the constant's shape)"
            )


def _fit_problems(start, like, static: dict) -> list[str]:
    """How params `start` [K, ...] (static overrides merged in) differ from the grid's
    init `like` [1, ...]: missing or extra leaves, per-model shapes, dtypes."""
    flat = lambda t: {  # noqa: E731
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(t)[0]
    }
    got, want = flat(start), flat(like)
    overridden = {f"['static']['{n}']" for n in static}  # cast to the init's dtype later
    problems = [f"{n} missing" for n in want if n not in got]
    problems += [f"{n} is not in this grid's models" for n in got if n not in want]
    for n in (n for n in want if n in got):
        if _shape(got[n])[1:] != want[n].shape[1:]:
            problems.append(f"{n} has shape {_shape(got[n])[1:]}, expected {want[n].shape[1:]}")
        elif n not in overridden and got[n].dtype != want[n].dtype:
            problems.append(f"{n} is {got[n].dtype}, expected {want[n].dtype}")
    return problems


def _check_start(grid: Grid, init_from, out: str | None = None):
    """(base run's absolute path, the grid's models' base params [K, ...] as host
    NumPy, the static overrides, the grid's init params' shapes [1, ...]) after every
    check of `init_from`; a ValueError naming the argument (`init_from.run`, `.models`,
    `.static`) for anything wrong. No compute: it reads the base folder and traces the
    init's shapes."""
    _check_base(grid, init_from, out)
    run, k = init_from.run, len(grid.settings)
    models = _check_models(init_from.models, k)
    try:
        base = results.load_run(run)
    except ValueError as e:
        raise ValueError(f"init_from.run: {e}") from None
    _check_in_base(models, base, run)
    one = stack_settings(list(grid.settings[:1]))
    like = jax.eval_shape(lambda s: init_program(s, grid.config), one).params
    static = dict(init_from.static or {})
    _check_static(static, like.get("static", {}) if isinstance(like, dict) else {}, k)
    params = jax.tree_util.tree_map(lambda x: np.asarray(x)[np.asarray(models, int)], base.params)
    merged = {**params, "static": {**params.get("static", {}), **static}} if static else params
    problems = _fit_problems(merged, like, static)
    if problems:
        hint = " (a missing constant can be given in init_from.static)"
        raise ValueError(
            f"init_from.run = {run!r}: its params do not fit the models of this grid's "
            f"config: {'; '.join(problems[:4])}"
            + (hint if any("missing" in p and "static" in p for p in problems) else "")
        )
    return os.path.abspath(run), params, static, like


def check_init_from(grid: Grid, init_from: InitFrom) -> None:
    """Checks `init_from` against `grid` as `run_grid` does, without computing: raises
    ValueError naming the argument (`init_from.run`, `.models`, `.static`)."""
    _check_start(grid, init_from)


def _start(grid: Grid, init_from: InitFrom, n_padded: int, out: str | None) -> _Start:
    """The starting params of every model (padded to `n_padded`) and their record."""
    path, params, static, like = _check_start(grid, init_from, out)
    cast = {}
    for name, v in static.items():
        if isinstance(v, jax.ShapeDtypeStruct):
            raise ValueError(
                f"init_from.static[{name!r}] is a shape ({v}), not values: give the arrays "
                "to train (shapes are for check_init_from)"
            )
        cast[name] = np.asarray(v, like["static"][name].dtype)
    start = {**params, "static": {**params["static"], **cast}} if cast else params
    record = {
        "run": path,
        "models": [operator.index(m) for m in init_from.models],
        "static": sorted(cast),
        "base_sha256": params_fingerprint(params),  # the base models' params, as stored
        "sha256": params_fingerprint(start),  # what training starts from
    }
    return _Start(pad_models(start, n_padded), record)


def _start_difference(old: dict | None, new: dict | None) -> str | None:
    """What a folder's `init_from` record (None: a fresh init) holds instead of `new`."""
    if old == new:
        return None
    if new is None:
        return f"a sweep started from the params of {old['run']!r} (init_from), not a fresh init"
    if old is None:
        return f"a sweep from a fresh init, not one started from {new['run']!r} (init_from)"
    if old["run"] != new["run"]:
        return (
            f"a sweep started from {old['run']!r} (folder), not from {new['run']!r} (init_from.run)"
        )
    if old["models"] != new["models"]:
        return f"a sweep started from other models of {new['run']!r} (init_from.models)"
    if old["static"] != new["static"]:
        return (
            f"a sweep with other static overrides ({', '.join(old['static']) or 'none'} "
            f"(folder) vs {', '.join(new['static']) or 'none'}; init_from.static)"
        )
    if old["base_sha256"] != new["base_sha256"]:
        return (
            f"a sweep started from other params: the base run {new['run']!r} changed since "
            f"this sweep began (its models' params: sha256 {old['base_sha256'][:12]}... "
            f"(folder) vs {new['base_sha256'][:12]}... now; was it trained again?)"
        )
    return (
        f"a sweep started from other static constants (init_from.static values: sha256 "
        f"{old['sha256'][:12]}... (folder) vs {new['sha256'][:12]}... now)"
    )
