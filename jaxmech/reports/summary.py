"""The sweep summary: what experiments.train / experiments.sweep print and write after a run.

Prints the per-model table and, per swept field, mean final accuracies with 95%
t-intervals over seeds; writes figures (training curves, accuracy vs each swept field)
and `OUT/summary.md`.
"""

from __future__ import annotations

import os

from jaxmech import plots
from jaxmech.config import Config, field_default
from jaxmech.families import family_for
from jaxmech.reports.common import excluded_lines, setting_text
from jaxmech.results import summary_table
from jaxmech.stats import mean_ci
from jaxmech.sweep import Grid


def metric_ci(values, metric: str):
    """`mean_ci` clipped to [0, 1] for accuracies and probabilities only (a
    log-probability or a loss is not in [0, 1])."""
    bounded = metric.endswith("_acc") or metric.endswith("_p")
    return mean_ci(values, *((0.0, 1.0) if bounded else (None, None)))


def _non_default(config: Config, swept=()) -> dict:
    """Fields that differ from the SPEC defaults (swept fields and seed excluded)."""
    skip = {"seed", *swept}
    return {k: v for k, v in config.flat().items() if field_default(k) != v and k not in skip}


def by_value(rows: list[dict], field: str, metrics: tuple[str, ...]) -> list[dict]:
    """Per value of `field`: n and mean with 95% CI of every metric (finite models)."""
    out = []
    for x in sorted({r[field] for r in rows}):
        sel = [r for r in rows if r[field] == x and r["diverged_step"] < 0]
        entry = {field: x, "n": len(sel)}
        for m in metrics:
            entry[m] = metric_ci([r[m] for r in sel], m)
        out.append(entry)
    return out


def markdown_summary(out: str, grid: Grid, run: dict, figures: list[str]) -> str:
    """A short Markdown page: settings, per-value means with 95% CIs, time, figures.

    `run` is `sweep.run_grid`'s result; `figures` are paths under `out` (linked
    relative to it). Returns the page's text (the caller writes it).
    """
    rows = run["rows"]
    metrics = family_for(grid.config).metrics(grid.config)
    lines = [f"# Sweep summary: `{out}`", ""]
    nd = _non_default(grid.config, grid.swept)
    lines.append(
        "Config differences from the SPEC defaults: "
        + (", ".join(f"`{k}={v}`" for k, v in nd.items()) if nd else "none")
        + "."
    )
    seeds = sorted({r["seed"] for r in rows})
    lines.append(
        f"{len(rows)} models; swept: {', '.join(grid.swept) or 'seeds only'}; "
        f"seeds {seeds[0]}..{seeds[-1]}. Intervals are 95% t-intervals over seeds."
    )
    if run["wall_s"]:
        lines.append(
            f"Training wall time {run['wall_s']:.0f} s "
            f"({len(rows) * 3600 / run['wall_s']:.0f} models/hour, compile and evaluation included)."
        )
    if run.get("program"):
        p = run["program"]
        lines.append(
            f"Program: chunks of {p['chunk_size']} models on {p['devices']} {p['backend']} "
            "device(s) (a model's numbers are bit-identical only in the same program)."
        )
    excluded = excluded_lines(rows)
    if excluded:
        lines.append(f"Diverged, excluded from every statistic: {len(excluded)} model(s):")
        lines += [f"- {line.removeprefix('excluded: ')}" for line in excluded]
    fields = list(grid.swept) or ["seed"]
    for field in fields:
        lines += ["", f"## By `{field}`", ""]
        lines.append(f"| {field} | n | " + " | ".join(metrics) + " |")
        lines.append("|---" * (len(metrics) + 2) + "|")
        entries = by_value(rows, field, metrics) if field != "seed" else [_all(rows, metrics)]
        for e in entries:
            cells = [f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi, _ in (e[k] for k in metrics)]
            value = setting_text(e[field]) if field in e else "all"
            lines.append(f"| {value} | {e['n']} | " + " | ".join(cells) + " |")
    lines += ["", "## Figures", ""]
    lines += [f"![{os.path.basename(p)}]({os.path.relpath(p, out)})" for p in figures]
    return "\n".join(lines) + "\n"


def _all(rows, metrics):
    sel = [r for r in rows if r["diverged_step"] < 0]
    return {"n": len(sel), **{m: metric_ci([r[m] for r in sel], m) for m in metrics}}


def report_run(out: str, grid: Grid, run: dict, log=print) -> None:
    """Prints the per-model table and per-value means; writes figures and summary.md.

    `run` is `sweep.run_grid`'s result ({"rows", "curves", "wall_s", "diverged", ...}).
    """
    rows = run["rows"]
    metrics = family_for(grid.config).metrics(grid.config)
    log(summary_table(rows, grid.swept, metrics))
    for line in excluded_lines(rows):
        log(line)
    figdir = plots.ensure_dir(os.path.join(out, "figures"))
    curves_png = os.path.join(figdir, "curves.png")
    paths = [plots.training_curves(run["curves"], curves_png, metrics=metrics)]
    for field in grid.swept:
        png = os.path.join(figdir, f"acc_vs_{field}.png")
        paths.append(plots.accuracy_vs(rows, field, png, metrics=metrics))
        log(f"\nmean final accuracy [95% CI] by {field}:")
        for e in by_value(rows, field, metrics):
            log(
                f"  {field}={setting_text(e[field])} (n={e['n']}): "
                + "  ".join(f"{m}={e[m][0]:.3f} [{e[m][1]:.3f},{e[m][2]:.3f}]" for m in metrics)
            )
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(markdown_summary(out, grid, run, paths))
    k = len(rows)
    if run["wall_s"]:
        log(f"\n{k} model(s) trained in {run['wall_s']:.1f} s (compile included)")
    log(f"results: {out}/results.csv  curves: {out}/curves.csv  params: {out}/params")
    log(f"summary: {out}/summary.md")
    log("figures: " + "  ".join(paths))
