"""The mechanism report of a results folder: ablation table, head roles, EP gradients.

Writes into `RUN/mechanism/`:
  ablations.csv  model, ablation, single_acc, seen_acc, unseen_acc, labelset_acc
  heads.csv      model, head, role, delta_label, delta_pe, ep_gradient (Spearman of the
                 CLS-row EP over key positions), ep_slope (logit / pixel), ep_range,
                 qp_gradient, qp_slope
  shares.csv     model, head, term, share of the CLS-row logit variance (unseen pairs)
  summary.json   per-ablation means and the ablation table's wall time
  figures: terms.png, cls_profiles.png, ablations.png, ep_gradient.png

The E/P report needs a vision tower with a learned `P`. For a rotary vision tower
(`vision_pos = "rope"`) `analyse_rope_run` writes `RUN/rope/` instead:
  ablations.csv  model, ablation (rotation off in: none, all heads, head h, only h kept),
                 single_acc, seen_acc, unseen_acc, labelset_acc
  heads.csv      model, head, slope, spearman, sign_agree, delta_label, delta_pe,
                 content / position shares of the CLS-row logit variance, profile_0..L-1
  summary.json   per-ablation means; figures profiles.png, ablations.png
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
from jaxmech.analysis.rope import (
    cls_profiles,
    rope_ablation_table,
    rope_keep_masks,
    rope_logit_parts,
)
from jaxmech.config import Config
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


def _ablation_summary(table: dict, names, header: str, log) -> dict:
    """Prints one row per ablation (mean +- std [min, max] over models per metric) and
    returns {ablation: {metric: {mean, std, min, max}}}; table[m] is [K, len(names)]."""
    log(f"{header:>12} " + " ".join(f"{m:>24}" for m in METRICS))
    out = {}
    for j, a in enumerate(names):
        cells, s = [], {}
        for m in METRICS:
            mean, std, lo, hi = _stats(table[m][:, j])
            cells.append(f"{mean:6.3f} +-{std:5.3f} [{lo:.2f},{hi:.2f}]")
            s[m] = {"mean": mean, "std": std, "min": lo, "max": hi}
        out[a] = s
        log(f"{a:>12} " + " ".join(f"{c:>24}" for c in cells))
    return out


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


def run_config(path: str) -> Config:
    """The config of a results folder (config.json only, no params)."""
    with open(os.path.join(path, "config.json")) as f:
        return Config.from_json(f.read())


def ep_report_refusal(config: Config, path: str) -> str | None:
    """Why the E/P mechanism report does not apply to a run (None when it does)."""
    if config.model.vision_pos != "learned":
        return (
            f"{path}: vision_pos = {config.model.vision_pos!r}: the vision tower has no "
            "learned P, so the E/P term decomposition and ablations do not apply; use "
            f"python -m experiments.rope --run={path}"
        )
    return None


def analyse_run(
    path: str, ablations=DEFAULT_ABLATIONS, heads=None, threshold: float = 0.9, log=print
) -> dict:
    """Computes and writes the mechanism report of one results folder (module doc)."""
    run = load_run(path)
    cfg = run.config
    refusal = ep_report_refusal(cfg, path)
    if refusal:
        raise ValueError(refusal)
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
    summary = {"ablation_wall_s": wall, "models": k}
    summary["ablations"] = _ablation_summary(table, ablations, "ablation", log)
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


ROPE_SHARES = ("content", "position", "content_E", "position_E", "position_B")


def _mean_std(v) -> str:
    mean, std, lo, hi = _stats(v)
    return f"{mean:6.3f} +-{std:5.3f} [{lo:.2f},{hi:.2f}]"


def analyse_rope_run(path: str, log=print) -> dict:
    """The report of a results folder with a rotary vision tower (module doc)."""
    run = load_run(path)
    cfg = run.config
    if cfg.model.vision_pos != "rope":
        raise ValueError(
            f"{path}: vision_pos = {cfg.model.vision_pos!r}: the rope report needs "
            "vision_pos = 'rope'; use experiments.mechanism"
        )
    out = plots.ensure_dir(os.path.join(path, "rope"))
    data = build_data(cfg)
    k = len(run.results)
    params = jax.tree_util.tree_map(jnp.asarray, run.params)
    settings = jax.tree_util.tree_map(jnp.asarray, run.settings)
    t = cfg.task

    log(f"{k} model(s), vision_pos = 'rope', rope_base = {cfg.model.rope_base:g}")
    log("accuracies (mean +- std [min, max] over models):")
    for m in METRICS:
        log(f"  {m:>14} " + _mean_std([r[m] for r in run.results]))

    prof = jax.device_get(
        jax.lax.map(jax.jit(lambda p: cls_profiles(p, t.n_labels, t.image_len)), params)
    )
    images = jnp.asarray(data.evals.unseen_images)
    shares = jax.device_get(
        jax.lax.map(lambda p: row_variance_shares(rope_logit_parts(p, images), ROPE_SHARES), params)
    )
    n_heads = prof["slope"].shape[1]
    log(
        "\nCLS-row relative-position profile per head: the CLS logit to a lone object at "
        "pixel p (rotary offset p + 1), mean over the 20 labels, centred; slope in logit "
        "per pixel, Spearman with p, sign_agree = share of labels whose slope has the "
        "mean's sign; shares of the CLS-row logit variance (unseen-pair images)"
    )
    head_rows = []
    for i in range(k):
        log(f"  model {i} (unseen {run.results[i]['unseen_acc']:.3f})")
        for h in range(n_heads):
            p = prof["profile"][i, h]
            row = {
                "model": i,
                "head": h,
                "slope": float(prof["slope"][i, h]),
                "spearman": float(prof["spearman"][i, h]),
                "sign_agree": float(prof["sign_agree"][i, h]),
                "delta_label": float(prof["delta_label"][i, h]),
                "delta_pe": float(prof["delta_pe"][i, h]),
                **{f"share_{n}": float(shares[n][i, h]) for n in ROPE_SHARES},
                **{f"profile_{j}": float(p[j]) for j in range(len(p))},
            }
            head_rows.append(row)
            log(
                f"    head {h}: slope {row['slope']:+.3f}/px  Spearman {row['spearman']:+.2f}"
                f"  sign_agree {row['sign_agree']:.2f}  d_pe {row['delta_pe']:.2f}"
                f" d_label {row['delta_label']:.2f}  share pos {row['share_position']:.2f}"
                f" (E {row['share_position_E']:.2f}, B {row['share_position_B']:.2f})"
                f"  profile [" + " ".join(f"{v:+.2f}" for v in p) + "]"
            )
    _write_csv(os.path.join(out, "heads.csv"), head_rows)

    names, masks = rope_keep_masks(n_heads)
    t0 = time.perf_counter()
    table = jax.block_until_ready(
        rope_ablation_table(params, settings, data, masks, causal_text=cfg.model.causal_text)
    )
    wall = time.perf_counter() - t0
    abl_rows = [
        {"model": i, "ablation": a, **{m: float(table[m][i, j]) for m in METRICS}}
        for i in range(k)
        for j, a in enumerate(names)
    ]
    _write_csv(os.path.join(out, "ablations.csv"), abl_rows)
    log(
        f"\nrotation ablations ({k} models x {len(names)} masks, one compiled call, "
        f"{wall:.1f} s): 'head h' = rotation off in head h, 'only h' = kept in head h only"
    )
    summary = {"ablation_wall_s": wall, "models": k}
    summary["ablations"] = _ablation_summary(table, names, "rotation off", log)
    summary["mean_shares"] = {n: float(np.mean(shares[n])) for n in ROPE_SHARES}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)

    figs = [
        plots.head_profiles(
            {f"model {i}": prof["profile"][i] for i in range(k)},
            os.path.join(out, "profiles.png"),
            "CLS-row logit to a lone object vs its pixel (mean over labels, centred)",
        ),
        plots.ablation_bars(
            abl_rows,
            list(names),
            os.path.join(out, "ablations.png"),
            f"rotation switched off ({k} models)",
        ),
    ]
    log(
        "rope results: "
        + os.path.join(out, "ablations.csv")
        + "  "
        + os.path.join(out, "heads.csv")
    )
    log("figures: " + "  ".join(figs))
    return {"summary": summary, "profiles": prof, "shares": shares, "ablation_rows": abl_rows}
