"""Text table and figures for a finished run (what the entry points print)."""

from __future__ import annotations

import os

import numpy as np

from jaxmech import plots
from jaxmech.results import summary_table
from jaxmech.sweep import Grid


def report_run(out: str, grid: Grid, run: dict, log=print) -> None:
    """Prints the per-model table, writes figures under out/figures, prints their paths."""
    rows = run["rows"]
    log(summary_table(rows, grid.swept))
    figdir = plots.ensure_dir(os.path.join(out, "figures"))
    paths = [plots.training_curves(run["curves"], os.path.join(figdir, "curves.png"))]
    for field in grid.swept:
        paths.append(plots.accuracy_vs(rows, field, os.path.join(figdir, f"acc_vs_{field}.png")))
        log(f"\nmean final accuracies by {field}:")
        for x in sorted({r[field] for r in rows}):
            sel = [r for r in rows if r[field] == x and r["diverged_step"] < 0]
            means = {
                k: np.nanmean([r[k] for r in sel])
                for k in ("single_acc", "seen_acc", "unseen_acc", "labelset_acc")
            }
            log(f"  {field}={x}: " + "  ".join(f"{k}={v:.3f}" for k, v in means.items()))
    k = len(rows)
    log(f"\n{k} model(s) trained in {run['wall_s']:.1f} s (compile included)")
    log(f"results: {out}/results.csv  curves: {out}/curves.csv  params: {out}/params")
    log("figures: " + "  ".join(paths))
