"""The mechanism report of a results folder: ablation table, head roles, EP gradients.

Writes into `RUN/mechanism/`:
  ablations.csv  model, ablation, single_acc, seen_acc, unseen_acc, labelset_acc
  heads.csv      model, head, role, delta_label, delta_pe, ep_gradient (Spearman of the
                 CLS-row EP over key positions), ep_slope (logit / pixel), ep_range,
                 qp_gradient, qp_slope
  shares.csv     model, head, term, share of the CLS-row logit variance (unseen pairs)
  summary.json   per-ablation means and the ablation table's wall time
  figures: terms.png, cls_profiles.png, ablations.png, ep_gradient.png
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
from jaxmech.analysis.ablate import DEFAULT_ABLATIONS, ablation_table
from jaxmech.analysis.decompose import decompose, row_variance_shares
from jaxmech.analysis.heads import head_table
from jaxmech.evaluate import METRICS
from jaxmech.results import load_run
from jaxmech.train import build_data

SHARE_TERMS = ("EE", "EP", "PE", "PP", "BE", "BP", "XX", "BX", "QP")


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _stats(v):
    v = np.asarray(v, float)
    v = v[np.isfinite(v)]
    return (v.mean(), v.std(), v.min(), v.max()) if len(v) else (np.nan,) * 4


def strongest_heads(heads: dict) -> dict:
    """Per model, the head with the largest |CLS-row EP slope|: index, slope, Spearman."""
    slope = np.asarray(heads["ep_slope"])
    h = np.abs(slope).argmax(1)
    k = np.arange(slope.shape[0])
    return {
        "head": h,
        "ep_slope": slope[k, h],
        "ep_gradient": np.asarray(heads["ep_spearman"])[k, h],
        "qp_slope": np.asarray(heads["qp_slope"])[k, h],
    }


def analyse_run(
    path: str, ablations=DEFAULT_ABLATIONS, heads=None, threshold: float = 0.9, log=print
) -> dict:
    """Computes and writes the mechanism report of one results folder (module doc)."""
    run = load_run(path)
    cfg = run.config
    out = plots.ensure_dir(os.path.join(path, "mechanism"))
    data = build_data(cfg)
    k = len(run.results)
    params = jax.tree_util.tree_map(jnp.asarray, run.params)
    settings = jax.tree_util.tree_map(jnp.asarray, run.settings)

    t0 = time.perf_counter()
    table = jax.block_until_ready(
        ablation_table(
            params, settings, data, tuple(ablations), heads=heads, causal_text=cfg.model.causal_text
        )
    )
    wall = time.perf_counter() - t0
    abl_rows = [
        {"model": i, "ablation": a, **{m: float(table[m][i, j]) for m in METRICS}}
        for i in range(k)
        for j, a in enumerate(ablations)
    ]
    _write_csv(os.path.join(out, "ablations.csv"), abl_rows)

    ht = jax.device_get(head_table(params, cfg.task.n_labels, cfg.task.image_len))
    n_heads = ht["delta_pe"].shape[1]
    head_rows = [
        {
            "model": i,
            "head": h,
            "role": "relational" if ht["relational"][i, h] else "label-specific",
            "delta_label": float(ht["delta_label"][i, h]),
            "delta_pe": float(ht["delta_pe"][i, h]),
            "ep_gradient": float(ht["ep_spearman"][i, h]),
            "ep_slope": float(ht["ep_slope"][i, h]),
            "ep_range": float(ht["ep_range"][i, h]),
            "qp_gradient": float(ht["qp_spearman"][i, h]),
            "qp_slope": float(ht["qp_slope"][i, h]),
        }
        for i in range(k)
        for h in range(n_heads)
    ]
    _write_csv(os.path.join(out, "heads.csv"), head_rows)

    images = jnp.asarray(data.evals.unseen_images)
    shares = jax.device_get(
        jax.lax.map(lambda p: row_variance_shares(decompose(p, images), SHARE_TERMS), params)
    )
    share_rows = [
        {"model": i, "head": h, "term": t, "share": float(shares[t][i, h])}
        for i in range(k)
        for h in range(n_heads)
        for t in SHARE_TERMS
    ]
    _write_csv(os.path.join(out, "shares.csv"), share_rows)

    # ---- printed tables
    log(
        f"ablation table: {k} model(s) x {len(ablations)} ablations x 4 sets, one compiled "
        f"call, {wall:.1f} s (compile included)"
    )
    log(f"{'ablation':>12} " + " ".join(f"{m:>24}" for m in METRICS))
    summary = {"ablation_wall_s": wall, "models": k, "ablations": {}}
    for j, a in enumerate(ablations):
        cells, s = [], {}
        for m in METRICS:
            mean, std, lo, hi = _stats(table[m][:, j])
            cells.append(f"{mean:6.3f} +-{std:5.3f} [{lo:.2f},{hi:.2f}]")
            s[m] = {"mean": mean, "std": std, "min": lo, "max": hi}
        summary["ablations"][a] = s
        log(f"{a:>12} " + " ".join(f"{c:>24}" for c in cells))
    strong = strongest_heads(ht)
    unseen = np.asarray([r["unseen_acc"] for r in run.results], float)
    log("\nheads (per model): role of each head; strongest CLS-row EP head: slope, Spearman")
    for i in range(k):
        roles = "".join("R" if ht["relational"][i, h] else "l" for h in range(n_heads))
        log(
            f"  model {i:3d} unseen {unseen[i]:.3f}  roles {roles}  strongest head "
            f"{strong['head'][i]}: EP slope {strong['ep_slope'][i]:+.3f}/px, "
            f"Spearman {strong['ep_gradient'][i]:+.2f}"
        )
    mean_shares = {t: float(np.mean(shares[t])) for t in SHARE_TERMS}
    log(
        "mean share of CLS-row logit variance (over models and heads): "
        + ", ".join(f"{t} {v:.2f}" for t, v in mean_shares.items())
    )
    summary["mean_shares"] = mean_shares
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)

    # ---- figures
    figs = []
    i0 = 0
    h0 = int(strong["head"][i0])
    terms = decompose(jax.tree_util.tree_map(lambda x: x[i0], params), images[:1])
    labels = ["CLS"] + [str(int(t)) if t else "." for t in np.asarray(images[0])]
    figs.append(
        plots.term_heatmaps(
            {n: terms[n][0, h0] for n in ("EE", "EP", "PE", "PP", "BP")},
            os.path.join(out, "terms.png"),
            f"model {i0}, head {h0}: logit terms on an unseen-pair image",
            labels,
        )
    )
    figs.append(
        plots.head_profiles(
            {"EP": ht["ep_profile"][i0], "BP": ht["bp_profile"][i0], "QP": ht["qp_profile"][i0]},
            os.path.join(out, "cls_profiles.png"),
            f"model {i0}: CLS-row terms per head",
        )
    )
    figs.append(
        plots.ablation_bars(
            abl_rows,
            list(ablations),
            os.path.join(out, "ablations.png"),
            f"term ablations, all vision heads ({k} models)",
        )
    )
    gen = unseen >= threshold
    figs.append(
        plots.groups_strip(
            {
                f"unseen >= {threshold}": np.abs(strong["ep_slope"][gen]),
                f"unseen < {threshold}": np.abs(strong["ep_slope"][~gen]),
            },
            os.path.join(out, "ep_gradient.png"),
            "|CLS-row EP slope| of strongest head (logit/px)",
            "EP gradient: generalising vs not",
        )
    )
    log(
        "mechanism results: "
        + os.path.join(out, "ablations.csv")
        + "  "
        + os.path.join(out, "heads.csv")
        + "  "
        + os.path.join(out, "shares.csv")
    )
    log("figures: " + "  ".join(figs))
    return {"summary": summary, "strong": strong, "unseen": unseen, "ablation_rows": abl_rows}


def compare_runs(results: dict, out: str, threshold: float = 0.9, log=print) -> str:
    """EP gradient of generalising vs non-generalising models pooled over several runs."""
    slopes = np.concatenate([np.abs(r["strong"]["ep_slope"]) for r in results.values()])
    spear = np.concatenate([np.abs(r["strong"]["ep_gradient"]) for r in results.values()])
    unseen = np.concatenate([r["unseen"] for r in results.values()])
    gen = unseen >= threshold
    for name, sel in ((f"unseen >= {threshold}", gen), (f"unseen < {threshold}", ~gen)):
        if sel.any():
            log(
                f"{name}: n={sel.sum()}, |EP slope| mean {slopes[sel].mean():.3f} "
                f"[{slopes[sel].min():.3f}, {slopes[sel].max():.3f}], |Spearman| mean "
                f"{spear[sel].mean():.2f} [{spear[sel].min():.2f}, {spear[sel].max():.2f}]"
            )
    plots.ensure_dir(out)
    return plots.groups_strip(
        {f"unseen >= {threshold}": slopes[gen], f"unseen < {threshold}": slopes[~gen]},
        os.path.join(out, "ep_gradient_compare.png"),
        "|CLS-row EP slope| of strongest head (logit/px)",
        "EP gradient, pooled runs: " + ", ".join(os.path.basename(p.rstrip("/")) for p in results),
    )
