"""Results folders: what a training run or sweep writes, and one call to load it.

Layout of a results folder:
  config.json   the shared Config
  results.csv   one row per model: model, seed, every swept field, single_acc, seen_acc,
                unseen_acc, labelset_acc, final_loss, diverged_step, steps_trained
                (optimiser steps the model took: its finite-set budget or `steps`)
  curves.csv    one row per model per evaluation: model, step, CURVE_FIELDS
  params/       stacked params of all models (Orbax; leading axis = model)

`results.csv` is written last (atomically), so its presence marks a finished run.
"""

from __future__ import annotations

import csv
import os
import shutil
from typing import Any, NamedTuple

import numpy as np

from jaxmech import checkpoint
from jaxmech.config import SWEEPABLE, Config, Settings
from jaxmech.evaluate import METRICS

RESULT_FIELDS = ("model",) + SWEEPABLE + METRICS + ("final_loss", "diverged_step", "steps_trained")


class Run(NamedTuple):
    """A loaded results folder."""

    config: Config
    settings: Settings  # arrays [K]
    params: Any  # stacked [K, ...]
    results: list[dict]
    curves: list[dict]


def result_rows(settings: Settings, curves: dict, diverged_step, steps_trained=None) -> list[dict]:
    """One dict per model: settings, final accuracies and loss (last evaluation).

    `steps_trained` [K] defaults to the last evaluated step.
    """
    k = len(np.asarray(settings.seed))
    if steps_trained is None:
        steps_trained = np.asarray(curves["step"])[:, -1]
    rows = []
    for i in range(k):
        row: dict[str, Any] = {"model": i}
        for name, col in zip(SWEEPABLE, settings):
            row[name] = np.asarray(col)[i].item()
        for m in METRICS:
            row[m] = float(np.asarray(curves[m])[i, -1])
        row["final_loss"] = float(np.asarray(curves["loss"])[i, -1])
        row["diverged_step"] = int(np.asarray(diverged_step)[i])
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


def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _read_csv(path: str) -> list[dict]:
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
    rows = result_rows(settings, curves, diverged_step, steps_trained)
    _write_csv(os.path.join(out, "curves.csv"), curve_rows(curves))
    meta = {
        "settings": {n: np.asarray(v).tolist() for n, v in zip(SWEEPABLE, settings)},
        **(extra or {}),
    }
    params_dir = os.path.join(out, "params")
    if os.path.exists(params_dir):
        shutil.rmtree(params_dir)
    checkpoint.save(params_dir, 0, params, meta)
    tmp = os.path.join(out, ".results.csv.tmp")
    _write_csv(tmp, rows)
    os.replace(tmp, os.path.join(out, "results.csv"))
    return rows


def load_run(path: str) -> Run:
    """Loads a results folder written by `write_run` (training or sweep)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} is not a jaxmech results folder (no config.json)")
    with open(os.path.join(path, "config.json")) as f:
        config = Config.from_json(f.read())
    params, meta = checkpoint.restore(os.path.join(path, "params"))
    k = len(meta["settings"]["seed"])
    defaults = Config().flat()  # fields added after a folder was written take defaults
    settings = Settings(
        *(np.asarray(meta["settings"].get(n, [defaults[n]] * k)) for n in SWEEPABLE)
    )
    return Run(
        config,
        settings,
        params,
        _read_csv(os.path.join(path, "results.csv")),
        _read_csv(os.path.join(path, "curves.csv")),
    )


def summary_table(rows: list[dict], swept: tuple[str, ...] = ()) -> str:
    """A per-model table plus mean +- std (and min) over finite models, as text."""
    cols = ["model", *swept, "seed", *METRICS, "final_loss"]
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
        for c in (*METRICS, "final_loss"):
            vals = np.asarray([r[c] for r in ok], float)
            cells.append(f"{fn(vals):>12.3f}" if len(vals) else f"{'n/a':>12}")
        lines.append("  ".join(cells))
    if len(ok) < len(rows):
        lines.append(f"({len(rows) - len(ok)} diverged model(s) excluded from mean/std/min)")
    return "\n".join(lines)
