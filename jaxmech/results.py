"""Results folders: what a training run or sweep writes, and one call to load it.

Layout of a results folder:
  config.json   the shared Config
  results.csv   one row per model: model, seed, every sweepable field, the family's
                metrics (dual encoder: single_acc, seen_acc, unseen_acc, labelset_acc),
                final_loss, diverged_step, steps_trained (optimiser steps the model
                took: its finite-set budget or `steps`); metrics and final_loss are
                NaN for a diverged model
  curves.csv    one row per model per evaluation: model, step, `train.curve_fields`
  params/       stacked params of all models (Orbax, checksummed; leading axis = model)
  sweep.json    written by `sweep.run_grid`: what a resume must match (config,
                settings, program)

`results.csv` is written last (atomically), so its presence marks a finished run.
`load_run` (and the cheaper `load_config`) refuse, with a ValueError naming the path,
anything that is not such a finished folder. `write_csv` is the one CSV writer and
`write_json` the one JSON writer (reports and benches use them too).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from typing import Any, NamedTuple

import numpy as np

from jaxmech import saves
from jaxmech.config import SWEEPABLE, Config, Settings
from jaxmech.data.tasks import build_data, get_task
from jaxmech.families import family_for


class Run(NamedTuple):
    """A loaded results folder: what a report needs, in one call (`load_run`)."""

    config: Config
    settings: Settings  # arrays [K]
    params: Any  # stacked [K, ...]
    results: list[dict]
    curves: list[dict]
    family: Any = None  # `families.TrainedFamily` of the run's model_kind
    task: Any = None  # `data.tasks.Task` of its task_kind
    data: Any = None  # the task's tables and eval sets (`data.tasks.build_data`), if asked


def result_rows(
    settings: Settings, curves: dict, diverged_step, metrics: tuple[str, ...], steps_trained=None
) -> list[dict]:
    """One dict per model: settings, final `metrics` (the family's) and loss (last
    evaluation). `steps_trained` [K] defaults to the last evaluated step.

    A diverged model (`diverged_step >= 0`) gets NaN metrics and loss: its frozen
    last-finite params are not a trained model, and a 0.0 would be averaged in silently.
    """
    k = len(np.asarray(settings.seed))
    if steps_trained is None:
        steps_trained = np.asarray(curves["step"])[:, -1]
    rows = []
    for i in range(k):
        row: dict[str, Any] = {"model": i}
        for name, col in zip(SWEEPABLE, settings):
            row[name] = np.asarray(col)[i].item()
        div = int(np.asarray(diverged_step)[i])
        for name, col in [*zip(metrics, metrics), ("final_loss", "loss")]:
            row[name] = np.nan if div >= 0 else float(np.asarray(curves[col])[i, -1])
        row["diverged_step"] = div
        row["steps_trained"] = int(np.asarray(steps_trained)[i])
        rows.append(row)
    return rows


def curve_rows(curves: dict) -> list[dict]:
    names = [n for n in curves if n != "step"]
    steps = np.asarray(curves["step"])
    rows = []
    for i in range(steps.shape[0]):
        for j in range(steps.shape[1]):
            row = {"model": i, "step": int(steps[i, j])}
            row.update({n: float(np.asarray(curves[n])[i, j]) for n in names})
            rows.append(row)
    return rows


def write_csv(path: str, rows: list[dict]) -> None:
    """Writes dict rows as CSV (header: the first row's keys), atomically.

    The file appears complete or not at all (written beside it, then renamed), so a
    killed process never leaves a half-written table that a resume would trust.
    """
    if not rows:
        raise ValueError(f"write_csv({path!r}): no rows to write (a CSV needs a header row)")
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def write_json(path: str, obj) -> None:
    """A summary.json (NumPy scalars written as floats)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=float)


def read_csv(path: str) -> list[dict]:
    """The rows of a CSV written by `write_csv`, numbers parsed back (int, then float)."""

    def parse(v: str):
        for t in (int, float):
            try:
                return t(v)
            except ValueError:
                pass
        return v

    with open(path, newline="") as f:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_files(
    out: str,
    config: Config,
    settings: Settings,
    params,
    curves: dict,
    diverged_step,
    extra: dict | None = None,
    steps_trained=None,
) -> list[dict]:
    """Writes the results files into folder `out`; results.csv last (it marks completion).

    Returns the result rows.
    """
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write(config.to_json())
    metrics = family_for(config).metrics(config)
    rows = result_rows(settings, curves, diverged_step, metrics, steps_trained)
    write_csv(os.path.join(out, "curves.csv"), curve_rows(curves))
    meta = {
        "settings": {n: np.asarray(v).tolist() for n, v in zip(SWEEPABLE, settings)},
        **(extra or {}),
    }
    params_dir = os.path.join(out, "params")
    if os.path.exists(params_dir):
        shutil.rmtree(params_dir)
    saves.save(params_dir, 0, params, meta)
    write_csv(os.path.join(out, "results.csv"), rows)  # atomic: marks completion
    return rows


_EXPECTED = "a results folder written by experiments.train or experiments.sweep"


def _refuse(path, what: str) -> ValueError:
    return ValueError(f"path = {path!r} {what}; expected {_EXPECTED}")


def load_config(path: str) -> Config:
    """The Config of a finished results folder, after checking the folder is one.

    Cheap (reads config.json only), so entry points can refuse a bad folder before any
    compute. Raises ValueError naming `path`, what is wrong and what was expected: a
    path that does not exist or is not a folder; a missing config.json, curves.csv,
    results.csv (written last: without it training did not finish) or params/; a
    config.json that does not parse into a valid Config.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise _refuse(path, f"is a {type(path).__name__}, not a path")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise _refuse(path, "does not exist")
    if not os.path.isdir(path):
        raise _refuse(path, "is not a folder")
    # results.csv is written last, so without it training did not finish
    for name in ("config.json", "curves.csv", "results.csv", "params"):
        is_kind = os.path.isdir if name == "params" else os.path.isfile
        if not is_kind(os.path.join(path, name)):
            kind = "folder" if name == "params" else "file"
            raise _refuse(path, f"has no {name} {kind}")
    with open(os.path.join(path, "config.json")) as f:
        text = f.read()
    try:
        if not isinstance(json.loads(text), dict):
            raise TypeError(f"expected a JSON object of config groups, got {text[:40]!r}")
        return Config.from_json(text)
    except (ValueError, TypeError) as e:  # bad JSON, bad or unknown field, not an object
        raise _refuse(path, f"has a broken config.json ({type(e).__name__}: {e})") from None


def load_run(path: str, *, with_data: bool = False) -> Run:
    """Loads a finished results folder (config, settings [K], stacked params, CSV rows,
    its family and task, and with `with_data` the task's tables and eval sets).

    Raises ValueError (see `load_config`) for a path that is not such a folder, and for
    params/ that hold no readable save.
    """
    config = load_config(path)
    try:
        params, meta = saves.restore(os.path.join(path, "params"))
    except saves.SaveError as e:
        raise _refuse(path, f"has unreadable params ({e})") from None
    if "seed" not in meta.get("settings", {}):
        raise _refuse(path, "has params without the models' settings (not written by write_files)")
    k = len(meta["settings"]["seed"])
    defaults = Config().flat()  # fields added after a folder was written take defaults
    settings = Settings(
        *(np.asarray(meta["settings"].get(n, [defaults[n]] * k)) for n in SWEEPABLE)
    )
    family = family_for(config)
    return Run(
        config,
        settings,
        family.complete_params(params, config),
        read_csv(os.path.join(path, "results.csv")),
        read_csv(os.path.join(path, "curves.csv")),
        family,
        get_task(config.task.task_kind),
        build_data(config) if with_data else None,
    )


def summary_table(rows: list[dict], swept: tuple[str, ...], metrics: tuple[str, ...]) -> str:
    """A per-model table (the family's `metrics` after the settings) plus mean +- std
    (and min) over finite models, as text."""
    cols = ["model", *swept, "seed", *metrics, "final_loss"]
    lines = ["  ".join(f"{c:>12}" for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:>12.3f}" if isinstance(v, float) else f"{v!s:>12}")
        flag = "  DIVERGED" if r.get("diverged_step", -1) >= 0 else ""
        lines.append("  ".join(cells) + flag)
    ok = [r for r in rows if r.get("diverged_step", -1) < 0]
    for label, fn in (("mean", np.nanmean), ("std", np.nanstd), ("min", np.nanmin)):
        cells = [f"{label:>12}"] + [f"{'':>12}"] * (len(swept) + 1)
        for c in (*metrics, "final_loss"):
            vals = np.asarray([r[c] for r in ok], float)
            cells.append(f"{fn(vals):>12.3f}" if len(vals) else f"{'n/a':>12}")
        lines.append("  ".join(cells))
    if len(ok) < len(rows):
        lines.append(f"({len(rows) - len(ok)} diverged model(s) excluded from mean/std/min)")
    return "\n".join(lines)
