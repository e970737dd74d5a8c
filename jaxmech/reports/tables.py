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
  and as the printed table;
* `Measure`, `compare_groups`, `print_comparison`: a selection's passing - failing
  difference of a report's headline numbers over models (Welch 95% interval).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxmech.results import write_csv, write_json
from jaxmech.stats import bootstrap_ci, diff_ci, mean_ci

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
    "empty (n = 0)" where no value is finite (never a measured-looking zero or NaN), and
    one model's value without an interval (never "+-0.000 [nan, nan]")."""
    m, a, b, n = mean_ci(values, lo, hi)
    if n == 0:
        return "empty (n = 0)"
    if n == 1:
        return f"{m:+.3f} (n = 1: no interval)"
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


class Measure(NamedTuple):
    """A headline number a report compares between a selection's passing and failing
    models (`Report.compare`, `compare_groups`): per model, the mean of `column` over
    the rows of its table `table` that match `where` (column -> value, or a tuple of
    accepted values); one comparison per value combination of the `by` columns.
    `minus` (pairs that override `where`): each model's value less its mean over the
    rows so matched (e.g. ID steering less noise steering, model by model)."""

    label: str
    table: str
    column: str
    where: tuple = ()  # ((column, value or tuple of values), ...)
    by: tuple = ()
    minus: tuple = ()  # ((column, value), ...): the subtracted rows' `where` changes


COMPARED = ("passing - failing: difference of the means over models, Welch 95% "
            "t-interval (Welch-Satterthwaite df), each model one value, not corrected "
            "for the number of comparisons")  # fmt: skip


def group_measure(rows: list[dict], m: Measure, group: str) -> dict:
    """{(by values): [one value per model of `group`]}: `m` over the rows of
    `model_group` `group` (a model's value: the mean of its matching finite rows, less
    that of its `minus` rows; NaN when it has none, left out of the comparison)."""
    values = _per_model(rows, m.where, m, group)
    if m.minus:
        less = _per_model(rows, (*m.where, *m.minus), m, group)
        values = {k: {i: v - less.get(k, {}).get(i, np.nan) for i, v in per.items()}
                  for k, per in values.items()}  # fmt: skip
    return {k: list(per.values()) for k, per in values.items()}


def _per_model(rows: list[dict], where: tuple, m: Measure, group: str) -> dict:
    """{(by values): {model: mean of its matching finite rows' `m.column`, or NaN}};
    a later pair of `where` overrides an earlier one on the same column."""
    accepted = {c: v if isinstance(v, tuple) else (v,) for c, v in where}
    acc: dict = {}
    for r in rows:
        if r.get("model_group") == group and all(r.get(c) in v for c, v in accepted.items()):
            key = tuple(r[c] for c in m.by)
            acc.setdefault(key, {}).setdefault(r["model"], []).append(float(r[m.column]))
    mean = lambda v: float(np.mean(v)) if len(v) else np.nan  # noqa: E731
    return {k: {i: mean([x for x in v if np.isfinite(x)]) for i, v in per.items()}
            for k, per in acc.items()}  # fmt: skip


def group_difference(passing, failing) -> dict:
    """mean(passing) - mean(failing) over models (finite values) with its Welch 95%
    interval (`stats.diff_ci`): {"difference", "ci_low", "ci_high", "passing",
    "failing" (the means), "n_passing", "n_failing"}; NaN difference where a side has
    no model, NaN bounds where a side has one (no spread to estimate)."""
    p, f = (np.asarray(v, float) for v in (passing, failing))
    p, f = p[np.isfinite(p)], f[np.isfinite(f)]
    d, lo, hi = diff_ci(f, p)
    mean = lambda v: float(v.mean()) if len(v) else np.nan  # noqa: E731
    return {"difference": d, "ci_low": lo, "ci_high": hi, "passing": mean(p),
            "failing": mean(f), "n_passing": len(p), "n_failing": len(f)}  # fmt: skip


def compare_groups(tables: dict, measures) -> dict:
    """{question set ("all" where the rows name none): {measure label: `group_difference`}}
    of each `Measure` over the labelled rows of `tables` (`driver.report_parts`: each row
    with its `model_group`, "passing" or "failing", and `examples`). Raises ValueError
    for a measure whose table or columns the report's rows do not have."""
    out: dict = {}
    for m in measures:
        rows = tables.get(m.table, [])
        missing = {m.column, *m.by, *(c for c, _ in (*m.where, *m.minus))}
        missing -= set(rows[0] if rows else ())
        if missing:
            raise ValueError(f"Measure {m.label!r}: table {m.table!r} (tables: "
                             f"{list(tables)}) has no rows with columns {sorted(missing)}")  # fmt: skip
        for e in dict.fromkeys(r.get("examples", "all") for r in rows):
            mine = [r for r in rows if r.get("examples", "all") == e]
            p, f = group_measure(mine, m, "passing"), group_measure(mine, m, "failing")
            for key in dict.fromkeys([*p, *f]):
                label = ", ".join([m.label, *(f"{c} {v}" for c, v in zip(m.by, key))])
                out.setdefault(e, {})[label] = group_difference(p.get(key, []), f.get(key, []))
    return out


def fmt_difference(rec: dict) -> str:
    """A `group_difference` as one line: each side's mean and n, the difference and
    its interval; "empty (n = 0)" for a side with no model (and then no difference),
    no interval from one model."""
    side = lambda s: ("empty (n = 0)" if rec[f"n_{s}"] == 0  # noqa: E731
                      else f"{rec[s]:+.3f} (n = {rec[f'n_{s}']})")  # fmt: skip
    head = f"passing {side('passing')}, failing {side('failing')}: "
    if min(rec["n_passing"], rec["n_failing"]) == 0:
        return head + "no difference (a side has no model)"
    if min(rec["n_passing"], rec["n_failing"]) == 1:
        return head + f"{rec['difference']:+.3f}, no interval (one model on a side)"
    return head + f"{rec['difference']:+.3f} [{rec['ci_low']:+.3f},{rec['ci_high']:+.3f}]"


def print_comparison(comparison: dict, log, words: dict | None = None) -> None:
    """Logs a `compare_groups` result as one block: the method, then one line per
    measure under each question set (`words` names the sets)."""
    log(f"\n--- {COMPARED}:")
    for e, recs in comparison.items():
        log(f"  {(words or {}).get(e, e)}:")
        width = max(map(len, recs))
        for label, rec in recs.items():
            log(f"    {label:<{width}}  {fmt_difference(rec)}")
