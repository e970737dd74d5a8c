"""What every report shares: a loaded run, CSV / JSON files, seed summaries, ablation tables.

* `open_run(path)`: a finished results folder as device arrays (stacked params [K, ...],
  settings [K]) plus the task's data, the prologue of every report;
* `write_csv` (the one CSV writer, from `jaxmech.results`) and `write_json`;
* `spread` / `fmt_spread` / `fmt_ci`: mean, std, min, max over models (finite values),
  and mean +- std with a 95% t-interval (`jaxmech.stats.mean_ci`);
* `ablation_rows`, `ablation_summary`, `print_ablation_summary`: a [K, A] table of
  accuracies per metric (models x ablations) as CSV rows, as per-ablation statistics,
  and as the printed table.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Config, Settings
from jaxmech.results import load_config, load_run, write_csv
from jaxmech.stats import mean_ci
from jaxmech.train import build_data

__all__ = [
    "COMPACT",
    "WIDE",
    "LoadedRun",
    "TableStyle",
    "ablation_rows",
    "ablation_summary",
    "fmt_ci",
    "fmt_spread",
    "load_config",
    "open_run",
    "print_ablation_summary",
    "spread",
    "write_csv",
    "write_json",
]


class LoadedRun(NamedTuple):
    """A finished results folder, ready for analysis."""

    path: str
    config: Config
    params: Any  # stacked [K, ...], device arrays
    settings: Settings  # device arrays [K]
    data: Any  # the task's tables and eval sets (`train.build_data`); None if not asked
    results: list[dict]  # results.csv rows, one per model

    @property
    def k(self) -> int:
        return len(self.results)

    def unseen_acc(self) -> np.ndarray:
        """[K] each model's final unseen-pair accuracy (NaN where the task has none)."""
        return np.asarray([r.get("unseen_acc", np.nan) for r in self.results], float)


def open_run(path: str, *, with_data: bool = True) -> LoadedRun:
    """Loads results folder `path` (strict: see `results.load_config`) for a report."""
    run = load_run(path)
    return LoadedRun(
        path,
        run.config,
        jax.tree_util.tree_map(jnp.asarray, run.params),
        jax.tree_util.tree_map(jnp.asarray, run.settings),
        build_data(run.config) if with_data else None,
        run.results,
    )


def write_json(path: str, obj) -> None:
    """A report's summary.json (NumPy scalars written as floats)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=float)


def spread(values) -> tuple[float, float, float, float]:
    """(mean, std, min, max) over the finite values; NaNs when there are none."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    return (v.mean(), v.std(), v.min(), v.max()) if len(v) else (np.nan,) * 4


def fmt_spread(values, cell: str = "{mean:6.3f} +-{std:5.3f} [{min:.2f},{max:.2f}]") -> str:
    """`spread` of `values` as one table cell (format fields: mean, std, min, max)."""
    mean, std, lo, hi = spread(values)
    return cell.format(mean=mean, std=std, min=lo, max=hi)


def fmt_ci(values, lo: float | None = -1.0, hi: float | None = 1.0) -> str:
    """mean +-std [95% CI] over models (interval clipped to [lo, hi]), one table cell."""
    m, a, b, _ = mean_ci(values, lo, hi)
    sd = float(np.nanstd(np.asarray(values, float)))
    return f"{m:+.3f} +-{sd:.3f} [{a:+.3f},{b:+.3f}]"


def ablation_rows(table: dict, columns: list[dict], metrics) -> list[dict]:
    """CSV rows of a models x ablations table, model-major.

    Args:
      table: {metric: [K, A]} accuracies.
      columns: A dicts, the labels of each column (e.g. {"ablation": "ep"}); they go
        between `model` and the metrics.
      metrics: which metrics of `table`, in CSV order.
    """
    k = np.shape(table[metrics[0]])[0]
    return [
        {"model": i, **col, **{m: float(table[m][i, j]) for m in metrics}}
        for i in range(k)
        for j, col in enumerate(columns)
    ]


def ablation_summary(table: dict, names, metrics) -> dict:
    """{name: {metric: {mean, std, min, max}}} over models of a {metric: [K, A]} table."""
    out = {}
    for j, a in enumerate(names):
        out[a] = {}
        for m in metrics:
            mean, std, lo, hi = spread(np.asarray(table[m])[:, j])
            out[a][m] = {"mean": mean, "std": std, "min": lo, "max": hi}
    return out


class TableStyle(NamedTuple):
    """Layout of a printed ablation table."""

    name_width: int  # the ablation-name column
    col_width: int  # every metric column
    cell: str  # format of a cell; fields mean, std, min, max
    short_titles: bool  # drop "_acc" from the metric titles


WIDE = TableStyle(12, 24, "{mean:6.3f} +-{std:5.3f} [{min:.2f},{max:.2f}]", False)
COMPACT = TableStyle(10, 15, "{mean:.3f} +-{std:.3f}", True)


def print_ablation_summary(
    summary: dict, metrics, log, header: str = "ablation", style: TableStyle = WIDE
) -> None:
    """Logs an `ablation_summary`: a header line, then one line per ablation."""
    titles = [m.replace("_acc", "") if style.short_titles else m for m in metrics]
    log(f"{header:>{style.name_width}} " + " ".join(f"{t:>{style.col_width}}" for t in titles))
    for a, stats in summary.items():
        cells = [style.cell.format(**stats[m]) for m in metrics]
        log(f"{a:>{style.name_width}} " + " ".join(f"{c:>{style.col_width}}" for c in cells))
