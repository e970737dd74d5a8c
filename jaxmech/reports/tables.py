"""How reports write and print numbers: CSV / JSON files, spreads and 95% intervals over
models or questions, and ablation tables.

* `write_csv` and `write_json` (the one CSV and JSON writers, from `jaxmech.results`);
* `spread` / `fmt_spread` / `fmt_ci`: mean, std, min, max over models (finite values),
  and mean +- std with a 95% t-interval (`jaxmech.stats.mean_ci`); `question_ci` /
  `fmt_question_ci` the per-question bootstrap of one model; `cell_interval` whichever
  of the two a table cell rests on; `fmt_interval` one printed cell, "empty (n = 0)"
  where nothing was counted;
* `ablation_rows`, `ablation_summary`, `print_ablation_summary`: a [K, A] table of
  accuracies per metric (models x ablations) as CSV rows, as per-ablation statistics,
  and as the printed table.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxmech.results import write_csv, write_json
from jaxmech.stats import bootstrap_ci, mean_ci

__all__ = ["write_csv", "write_json"]  # re-exported: the one CSV and JSON writers


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
    """mean +-std [95% CI] over models (interval clipped to [lo, hi]), one table cell;
    "empty (n = 0)" where no value is finite (never a measured-looking zero or NaN)."""
    m, a, b, n = mean_ci(values, lo, hi)
    if n == 0:
        return "empty (n = 0)"
    v = np.asarray(values, float)
    return f"{m:+.3f} +-{float(v[np.isfinite(v)].std()):.3f} [{a:+.3f},{b:+.3f}]"


def question_ci(values, lo: float | None = None, hi: float | None = None):
    """(mean, ci_low, ci_high, n) of one checkpoint's per-question numbers (NaN: a
    question the number is not defined on, left out): the seeded per-question
    bootstrap 95% interval (`stats.bootstrap_ci`), clipped to [lo, hi]. A checkpoint is
    one model, so `mean_ci` over models has none."""
    return bootstrap_ci(values, lo, hi)


def fmt_question_ci(values, lo: float | None = None, hi: float | None = None) -> str:
    """`question_ci` as one table cell (`fmt_interval`)."""
    return fmt_interval(question_ci(values, lo, hi))


def fmt_interval(ci, signed: bool = True) -> str:
    """(mean, ci_low, ci_high, n) as one table cell, "mean [lo, hi] (n = N)"; "empty
    (n = 0)" where nothing was counted (never a measured-looking zero)."""
    m, a, b, n = ci
    if n == 0:
        return "empty (n = 0)"
    f = "+.3f" if signed else ".3f"
    return f"{m:{f}} [{a:{f}},{b:{f}}] (n = {n})"


def cell_interval(per_example_KxB, lo: float | None = None, hi: float | None = None):
    """(mean, ci_low, ci_high, n) of one table cell from each model's per-example values
    [K, B] (NaN: not counted): over the per-model means (`mean_ci`) for a run of
    several models; over the questions (`question_ci`, the per-question bootstrap) for
    one model, a checkpoint; n counts what it rests on."""
    v = np.asarray(per_example_KxB)
    if v.shape[0] == 1:
        return question_ci(v[0], lo, hi)
    n = np.isfinite(v).sum(-1)
    return mean_ci(np.where(n > 0, np.nansum(v, -1) / np.maximum(n, 1), np.nan), lo, hi)


def ablation_rows(table: dict, columns: list[dict], metrics, models=None) -> list[dict]:
    """CSV rows of a models x ablations table, model-major.

    Args:
      table: {metric: [K, A]} accuracies.
      columns: A dicts, the labels of each column (e.g. {"ablation": "ep"}); they go
        between `model` and the metrics.
      metrics: which metrics of `table`, in CSV order.
      models: [K] the `model` of each row (`LoadedRun.models`: the index in the run);
        default 0..K-1.
    """
    k = np.shape(table[metrics[0]])[0]
    models = range(k) if models is None else models
    return [
        {"model": models[i], **col, **{m: float(table[m][i, j]) for m in metrics}}
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
