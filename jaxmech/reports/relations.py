"""The report of a 2D or three-object run: per-relation ablations and CLS-row EP maps.

`analyse_relations_run(path)` writes into `RUN/relations/`:
  ablations.csv  model, ablation, heads (all / one head), every accuracy of the task
                 (the SPEC four and the per-group ones: `unseen_h_acc`, `unseen_zm_acc`)
  heads.csv      model, head, the CLS-row EP term's fit over the key positions:
                 2D: slope per column (`ep_col_slope`, + = rises to the right) and per
                 row (`ep_row_slope`, + = rises downwards), share of its variance the
                 plane a + b c + d r explains (`ep_plane_r2`), range; three objects:
                 slope and Spearman over pixels as in `jaxmech.reports.mechanism`
  summary.json   mean / std / min / max of every metric per ablation, the excluded
                 (diverged) models
  figures: ep_grid.png (2D: the CLS-row EP over the H x W keys, models x heads),
  cls_profiles.png (three objects: CLS-row EP / BP per head)

Ablations remove logit terms in all vision heads (`analysis.ablate`); with
`per_head` also in one head at a time, which says whether left/right and above/below
live in the same heads. Diverged models are left out and named
(`reports.common.open_run`); `model` is a model's index in the run.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from jaxmech import plots
from jaxmech.analysis.ablate import ablation_table
from jaxmech.analysis.heads import cls_row_profiles, gradient_stats
from jaxmech.reports.common import (
    COMPACT,
    LoadedRun,
    ablation_rows,
    ablation_summary,
    check_run,
    declared,
    open_run,
    print_ablation_summary,
    write_csv,
    write_json,
)

DEFAULT_ABLATIONS = ("none", "ep", "bp", "ep+bp", "pe", "pp")

# the metric columns of a grid task (left/right and above/below) and of a line with a
# distractor (the three-object task), by whether the task's config has a grid
COLUMNS = {
    True: (
        "single_h_acc",
        "single_v_acc",
        "seen_h_acc",
        "seen_v_acc",
        "unseen_h_acc",
        "unseen_v_acc",
        "labelset_h_acc",
        "labelset_v_acc",
    ),
    False: (
        "single_acc",
        "seen_acc",
        "unseen_acc",
        "unseen_zl_acc",
        "unseen_zm_acc",
        "unseen_zr_acc",
        "labelset_acc",
    ),
}


def plane_fit(grid_HxRxC) -> dict:
    """Per head, least-squares plane a + b c + d r over an [R, C] grid of values.

    Returns dict of [H]: `col_slope` (b, per column), `row_slope` (d, per row), `r2`
    (variance share the plane explains), `range` (max - min).
    """
    g = np.asarray(grid_HxRxC, np.float64)
    _, R, C = g.shape
    r = np.arange(R, dtype=np.float64)[:, None] - (R - 1) / 2
    c = np.arange(C, dtype=np.float64)[None, :] - (C - 1) / 2
    rr, cc = np.broadcast_to(r, (R, C)), np.broadcast_to(c, (R, C))
    centred = g - g.mean((1, 2), keepdims=True)
    col = (centred * cc).sum((1, 2)) / (cc * cc).sum()
    row = (centred * rr).sum((1, 2)) / (rr * rr).sum()
    fit = col[:, None, None] * cc + row[:, None, None] * rr
    var = (centred**2).sum((1, 2))
    r2 = 1.0 - ((centred - fit) ** 2).sum((1, 2)) / np.maximum(var, 1e-30)
    return {"col_slope": col, "row_slope": row, "r2": r2, "range": g.max((1, 2)) - g.min((1, 2))}


def relations_refusal(config, path: str) -> str | None:
    """Why this report does not apply to a run (None when it does)."""
    why = declared("relations", "1D runs: python -m experiments.mechanism")(config, path)
    if why:
        return why
    if config.model.vision_pos != "learned":
        return f"{path}: vision_pos = {config.model.vision_pos!r}: needs a learned P"
    return None


def compute_ablations(run: LoadedRun, ablations, per_head) -> dict:
    """Accuracies under ablations in all vision heads and, for `per_head`, in each head.

    Returns {"all": {metric: [K, A]}, "per_head": {name: {metric: [K, H]}}, "wall_s"
    (wall time of the all-heads table, compile included), "models" ([K] each model's
    index in the run)}.
    """
    n_heads = run.params["vision"]["block_0"]["W_Q"].shape[1]
    t0 = time.perf_counter()
    table = jax.device_get(ablation_table(run.params, run.settings, run.data, tuple(ablations)))
    wall = time.perf_counter() - t0
    per = {}
    for name in per_head:
        cols = {m: [] for m in table}
        for h in range(n_heads):
            t = jax.device_get(
                ablation_table(run.params, run.settings, run.data, (name,), heads=[h])
            )
            for m in table:
                cols[m].append(np.asarray(t[m])[:, 0])
        per[name] = {m: np.stack(v, 1) for m, v in cols.items()}
    return {"all": table, "per_head": per, "wall_s": wall, "models": run.models}


def ablation_csv_rows(abl: dict, ablations) -> list[dict]:
    """ablations.csv rows: the all-heads table, then each per-head table."""
    metrics, models = list(abl["all"]), abl["models"]
    cols = [{"ablation": a, "heads": "all"} for a in ablations]
    rows = ablation_rows(abl["all"], cols, metrics, models)
    for name, tab in abl["per_head"].items():
        n_heads = np.shape(tab[metrics[0]])[1]
        cols = [{"ablation": name, "heads": str(h)} for h in range(n_heads)]
        rows += ablation_rows(tab, cols, metrics, models)
    return rows


def on_grid(run: LoadedRun) -> bool:
    """Whether the run's task lays its images on a grid (`grid_h`, `grid_w`)."""
    return hasattr(run.config.task, "grid_h")


def print_ablations(run: LoadedRun, abl: dict, summary: dict, log) -> None:
    """Logs the all-heads table, each per-head table and (2D) per-model h / v accuracies."""
    kind, columns = run.config.task.task_kind, COLUMNS[on_grid(run)]
    n_heads = run.params["vision"]["block_0"]["W_Q"].shape[1]
    log(
        f"{kind} run {run.path}: {run.k} model(s); ablations in all {n_heads} vision heads "
        f"(mean +- std over models; {abl['wall_s']:.0f} s)"
    )
    print_ablation_summary(summary["ablations"], columns, log, style=COMPACT)
    for name, tab in abl["per_head"].items():
        log(f"\n{name} in one head at a time (name@head)")
        print_ablation_summary(summary["per_head"][name], columns, log, style=COMPACT)
        if on_grid(run):
            log("  per model (h = unseen left/right, v = unseen above/below) under " + name)
            for i in range(run.k):
                cells = " ".join(
                    f"@{h}: h {tab['unseen_h_acc'][i, h]:.2f} v {tab['unseen_v_acc'][i, h]:.2f}"
                    for h in range(n_heads)
                )
                log(f"    model {run.models[i]}: {cells}")


def row_profiles(run: LoadedRun) -> dict:
    """{term: [K, H, L]} the CLS-row terms (EP, BP, ...) over the key positions."""
    return jax.device_get(
        jax.lax.map(lambda p: cls_row_profiles(p, run.config.task.image_len), run.params)
    )


def grid_heads(run: LoadedRun, ep, out: str, log) -> tuple[list[dict], dict, str]:
    """2D: plane fits of each head's EP map; logs them, returns (rows, summary, figure)."""
    k, n_heads = ep.shape[:2]
    H_g, W_g = run.config.task.grid_h, run.config.task.grid_w
    grids = ep.reshape(k, n_heads, H_g, W_g)
    fits = [plane_fit(grids[i]) for i in range(k)]
    log(
        "\nCLS-row EP over the grid's keys, plane fit per head: column slope (+: larger "
        "to the right), row slope (+: larger downwards), R^2 of the plane, range"
    )
    rows, titles = [], []
    for i, f in enumerate(fits):
        titles.append(
            [
                f"h{h}: col {f['col_slope'][h]:+.2f} row {f['row_slope'][h]:+.2f}"
                for h in range(n_heads)
            ]
        )
        log(
            f"  model {run.models[i]} (unseen {run.results[i].get('unseen_acc', np.nan):.3f}): "
            + "  ".join(
                f"head {h}: col {f['col_slope'][h]:+.2f} row {f['row_slope'][h]:+.2f} "
                f"R2 {f['r2'][h]:.2f}"
                for h in range(n_heads)
            )
        )
        for h in range(n_heads):
            rows.append(
                {
                    "model": run.models[i],
                    "head": h,
                    "ep_col_slope": float(f["col_slope"][h]),
                    "ep_row_slope": float(f["row_slope"][h]),
                    "ep_plane_r2": float(f["r2"][h]),
                    "ep_range": float(f["range"][h]),
                    **{f"ep_{c}": float(ep[i, h, c]) for c in range(ep.shape[2])},
                }
            )
    col = np.abs(np.stack([f["col_slope"] for f in fits]))
    row = np.abs(np.stack([f["row_slope"] for f in fits]))
    same = int((col.argmax(1) == row.argmax(1)).sum())
    log(f"  strongest |column slope| and strongest |row slope| in the same head: {same}/{k} models")
    fig = plots.grid_heatmaps(
        grids,
        os.path.join(out, "ep_grid.png"),
        f"CLS-row EP over the {H_g}x{W_g} keys (rows: models, columns: heads)",
        row_labels=[f"model {m}" for m in run.models],
        panel_titles=titles,
    )
    return rows, {"same_head_h_v": same}, fig


def line_heads(prof: dict, models, out: str, log) -> tuple[list[dict], dict, str]:
    """Three objects: slope and Spearman of each head's EP over pixels (`models` [K]:
    each model's index in the run); logs them, returns (rows, summary, figure)."""
    ep = np.asarray(prof["EP"])
    k, n_heads = ep.shape[:2]
    g = {n: np.stack([gradient_stats(ep[i])[n] for i in range(k)]) for n in ("slope", "spearman")}
    log("\nCLS-row EP over pixels per head: slope (logit / px) and Spearman")
    rows = []
    for i in range(k):
        log(
            f"  model {models[i]}: "
            + "  ".join(
                f"head {h}: {g['slope'][i, h]:+.2f} ({g['spearman'][i, h]:+.2f})"
                for h in range(n_heads)
            )
        )
        for h in range(n_heads):
            rows.append(
                {
                    "model": models[i],
                    "head": h,
                    "ep_slope": float(g["slope"][i, h]),
                    "ep_spearman": float(g["spearman"][i, h]),
                    **{f"ep_{c}": float(ep[i, h, c]) for c in range(ep.shape[2])},
                }
            )
    fig = plots.head_profiles(
        {"EP": ep[0], "BP": np.asarray(prof["BP"])[0]},
        os.path.join(out, "cls_profiles.png"),
        f"model {models[0]}: CLS-row terms per head (three objects)",
    )
    return rows, {}, fig


def analyse_relations_run(
    path: str, ablations=DEFAULT_ABLATIONS, per_head: tuple[str, ...] = ("ep+bp",), log=print
) -> dict:
    """Computes, writes, prints and plots the report of a 2D or three-object results folder.

    Raises ValueError for another task kind, a vision tower without a learned P or a run
    whose every model diverged; diverged models are left out and logged.
    Returns {"summary": summary.json's dict, "table": {metric: [K, A]}, "heads": rows}
    over the K finite models.
    """
    refusal = relations_refusal(check_run(path), path)
    if refusal:
        raise ValueError(refusal)
    out = plots.ensure_dir(os.path.join(path, "relations"))
    run = open_run(path, log=log)
    kind, columns = run.config.task.task_kind, COLUMNS[on_grid(run)]
    abl = compute_ablations(run, ablations, per_head)
    summary = {
        "kind": kind,
        "models": run.k,
        "excluded": list(run.excluded),
        "ablations": ablation_summary(abl["all"], ablations, columns),
        "per_head": {
            name: ablation_summary(
                tab, [f"{name}@{h}" for h in range(tab[columns[0]].shape[1])], columns
            )
            for name, tab in abl["per_head"].items()
        },
    }
    print_ablations(run, abl, summary, log)
    write_csv(os.path.join(out, "ablations.csv"), ablation_csv_rows(abl, ablations))
    prof = row_profiles(run)
    if on_grid(run):
        head_rows, extra, fig = grid_heads(run, np.asarray(prof["EP"]), out, log)
    else:
        head_rows, extra, fig = line_heads(prof, run.models, out, log)
    summary.update(extra)
    write_csv(os.path.join(out, "heads.csv"), head_rows)
    write_json(os.path.join(out, "summary.json"), summary)
    log("results: " + os.path.join(out, "ablations.csv") + "  " + os.path.join(out, "heads.csv"))
    log("figures: " + fig)
    return {"summary": summary, "table": abl["all"], "heads": head_rows}
