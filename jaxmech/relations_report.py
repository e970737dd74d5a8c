"""The report of a 2D or three-object run: per-relation ablations and CLS-row EP maps.

`analyse_relations_run(path)` writes into `RUN/relations/`:
  ablations.csv  model, ablation, heads (all / one head), every accuracy of the task
                 (the SPEC four and the per-group ones: `unseen_h_acc`, `unseen_zm_acc`)
  heads.csv      model, head, the CLS-row EP term's fit over the key positions:
                 2D: slope per column (`ep_col_slope`, + = rises to the right) and per
                 row (`ep_row_slope`, + = rises downwards), share of its variance the
                 plane a + b c + d r explains (`ep_plane_r2`), range; three objects:
                 slope and Spearman over pixels as in `jaxmech.mechanism`
  summary.json   mean / std / min / max of every metric per ablation
  figures: ep_grid.png (2D: the CLS-row EP over the H x W keys, models x heads),
  cls_profiles.png (three objects: CLS-row EP / BP per head)

Ablations remove logit terms in all vision heads (`analysis.ablate`); with
`per_head` also in one head at a time, which says whether left/right and above/below
live in the same heads.
"""

from __future__ import annotations

import csv
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech import plots
from jaxmech.analysis.ablate import ablation_table
from jaxmech.analysis.heads import cls_row_profiles, gradient_stats
from jaxmech.results import load_run
from jaxmech.train import build_data

DEFAULT_ABLATIONS = ("none", "ep", "bp", "ep+bp", "pe", "pp")

COLUMNS = {
    "2d": (
        "single_h_acc",
        "single_v_acc",
        "seen_h_acc",
        "seen_v_acc",
        "unseen_h_acc",
        "unseen_v_acc",
        "labelset_h_acc",
        "labelset_v_acc",
    ),
    "three": (
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


def _stats(v):
    v = np.asarray(v, float)
    v = v[np.isfinite(v)]
    return (v.mean(), v.std(), v.min(), v.max()) if len(v) else (np.nan,) * 4


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _print_table(log, title, names, table, columns, k):
    log(title)
    log(f"{'ablation':>10} " + " ".join(f"{c.replace('_acc', ''):>15}" for c in columns))
    out = {}
    for j, a in enumerate(names):
        cells, s = [], {}
        for m in columns:
            mean, std, lo, hi = _stats(np.asarray(table[m])[:, j])
            cells.append(f"{mean:.3f} +-{std:.3f}")
            s[m] = {"mean": mean, "std": std, "min": lo, "max": hi}
        out[a] = s
        log(f"{a:>10} " + " ".join(f"{c:>15}" for c in cells))
    return out


def analyse_relations_run(
    path: str, ablations=DEFAULT_ABLATIONS, per_head: tuple[str, ...] = ("ep+bp",), log=print
) -> dict:
    """Computes and writes the report of a 2D or three-object results folder."""
    run = load_run(path)
    cfg = run.config
    kind = cfg.task.task_kind
    if kind not in COLUMNS:
        raise ValueError(
            f"{path}: task_kind = {kind!r}; this report is for '2d' and 'three' runs "
            "(1D runs: python -m experiments.mechanism)"
        )
    if cfg.model.vision_pos != "learned":
        raise ValueError(f"{path}: vision_pos = {cfg.model.vision_pos!r}: needs a learned P")
    out = plots.ensure_dir(os.path.join(path, "relations"))
    data = build_data(cfg)
    k = len(run.results)
    params = jax.tree_util.tree_map(jnp.asarray, run.params)
    settings = jax.tree_util.tree_map(jnp.asarray, run.settings)
    n_heads = params["vision"]["block_0"]["W_Q"].shape[1]
    columns = COLUMNS[kind]
    causal = cfg.model.causal_text
    summary = {"kind": kind, "models": k, "ablations": {}, "per_head": {}}

    t0 = time.perf_counter()
    table = jax.device_get(
        ablation_table(params, settings, data, tuple(ablations), causal_text=causal)
    )
    metrics = list(table)
    rows = [
        {"model": i, "ablation": a, "heads": "all", **{m: float(table[m][i, j]) for m in metrics}}
        for i in range(k)
        for j, a in enumerate(ablations)
    ]
    summary["ablations"] = _print_table(
        log,
        f"{kind} run {path}: {k} model(s); ablations in all {n_heads} vision heads "
        f"(mean +- std over models; {time.perf_counter() - t0:.0f} s)",
        ablations,
        table,
        columns,
        k,
    )
    for name in per_head:
        names = [f"{name}@{h}" for h in range(n_heads)]
        cols = {m: [] for m in metrics}
        for h in range(n_heads):
            t = jax.device_get(
                ablation_table(params, settings, data, (name,), heads=[h], causal_text=causal)
            )
            for m in metrics:
                cols[m].append(np.asarray(t[m])[:, 0])
        tab = {m: np.stack(v, 1) for m, v in cols.items()}
        rows += [
            {
                "model": i,
                "ablation": name,
                "heads": str(h),
                **{m: float(tab[m][i, h]) for m in metrics},
            }
            for i in range(k)
            for h in range(n_heads)
        ]
        summary["per_head"][name] = _print_table(
            log, f"\n{name} in one head at a time (name@head)", names, tab, columns, k
        )
        if kind == "2d":
            log("  per model (h = unseen left/right, v = unseen above/below) under " + name)
            for i in range(k):
                cells = " ".join(
                    f"@{h}: h {tab['unseen_h_acc'][i, h]:.2f} v {tab['unseen_v_acc'][i, h]:.2f}"
                    for h in range(n_heads)
                )
                log(f"    model {i}: {cells}")
    _write_csv(os.path.join(out, "ablations.csv"), rows)

    prof = jax.device_get(jax.lax.map(lambda p: cls_row_profiles(p, cfg.task.image_len), params))
    ep = np.asarray(prof["EP"])  # [K, H, L]
    head_rows = []
    figs = []
    if kind == "2d":
        H_g, W_g = cfg.task.grid_h, cfg.task.grid_w
        grids = ep.reshape(k, n_heads, H_g, W_g)
        fits = [plane_fit(grids[i]) for i in range(k)]
        log(
            "\nCLS-row EP over the grid's keys, plane fit per head: column slope (+: larger "
            "to the right), row slope (+: larger downwards), R^2 of the plane, range"
        )
        titles = []
        for i in range(k):
            f = fits[i]
            titles.append(
                [
                    f"h{h}: col {f['col_slope'][h]:+.2f} row {f['row_slope'][h]:+.2f}"
                    for h in range(n_heads)
                ]
            )
            log(
                f"  model {i} (unseen {run.results[i].get('unseen_acc', np.nan):.3f}): "
                + "  ".join(
                    f"head {h}: col {f['col_slope'][h]:+.2f} row {f['row_slope'][h]:+.2f} "
                    f"R2 {f['r2'][h]:.2f}"
                    for h in range(n_heads)
                )
            )
            for h in range(n_heads):
                head_rows.append(
                    {
                        "model": i,
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
        log(
            f"  strongest |column slope| and strongest |row slope| in the same head: "
            f"{same}/{k} models"
        )
        summary["same_head_h_v"] = same
        figs.append(
            plots.grid_heatmaps(
                grids,
                os.path.join(out, "ep_grid.png"),
                f"CLS-row EP over the {H_g}x{W_g} keys (rows: models, columns: heads)",
                row_labels=[f"model {i}" for i in range(k)],
                panel_titles=titles,
            )
        )
    else:
        g = {
            n: np.stack([gradient_stats(ep[i])[n] for i in range(k)]) for n in ("slope", "spearman")
        }
        log("\nCLS-row EP over pixels per head: slope (logit / px) and Spearman")
        for i in range(k):
            log(
                f"  model {i}: "
                + "  ".join(
                    f"head {h}: {g['slope'][i, h]:+.2f} ({g['spearman'][i, h]:+.2f})"
                    for h in range(n_heads)
                )
            )
            for h in range(n_heads):
                head_rows.append(
                    {
                        "model": i,
                        "head": h,
                        "ep_slope": float(g["slope"][i, h]),
                        "ep_spearman": float(g["spearman"][i, h]),
                        **{f"ep_{c}": float(ep[i, h, c]) for c in range(ep.shape[2])},
                    }
                )
        figs.append(
            plots.head_profiles(
                {"EP": ep[0], "BP": np.asarray(prof["BP"])[0]},
                os.path.join(out, "cls_profiles.png"),
                "model 0: CLS-row terms per head (three objects)",
            )
        )
    _write_csv(os.path.join(out, "heads.csv"), head_rows)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    log("results: " + os.path.join(out, "ablations.csv") + "  " + os.path.join(out, "heads.csv"))
    log("figures: " + "  ".join(figs))
    return {"summary": summary, "table": table, "heads": head_rows}
