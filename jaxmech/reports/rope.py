"""The report of a results folder with a rotary vision tower (`vision_pos = "rope"`).

Writes into `RUN/rope/`:
  ablations.csv  model, ablation (rotation off in: none, all heads, head h, only h kept),
                 single_acc, seen_acc, unseen_acc, labelset_acc
  heads.csv      model, head, slope, spearman, sign_agree, delta_label, delta_pe,
                 content / position shares of the CLS-row logit variance, profile_0..L-1
  summary.json   per-ablation means, the excluded (diverged) models; figures
                 profiles.png, ablations.png

Diverged models are left out and named (`reports.common.open_run`); `model` is a
model's index in the run.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech import plots
from jaxmech.analysis.decompose import row_variance_shares
from jaxmech.analysis.rope import (
    cls_profiles,
    rope_ablation_table,
    rope_keep_masks,
    rope_logit_parts,
)
from jaxmech.families.dual_encoder.evaluate import METRICS
from jaxmech.reports.common import (
    LoadedRun,
    ablation_rows,
    ablation_summary,
    check_run,
    declared,
    fmt_spread,
    open_run,
    print_ablation_summary,
    write_csv,
    write_json,
)

ROPE_SHARES = ("content", "position", "content_E", "position_E", "position_B")


def rope_refusal(config, path: str) -> str | None:
    """Why the rotary report does not apply to a run (None when it does)."""
    # its profiles move one object along a line of pixels: the 1D task's image
    why = declared("rope")(config, path)
    if why:
        return why
    vision_pos = config.model.vision_pos
    if vision_pos != "rope":
        return (
            f"{path}: vision_pos = {vision_pos!r}: the rope report needs "
            "vision_pos = 'rope'; use experiments.mechanism"
        )
    return None


def compute_rope(run: LoadedRun) -> dict:
    """The report's numbers for K rotary models.

    Returns:
      profiles: `cls_profiles` per model ({name: [K, H]}, profile [K, H, L]);
      shares: {ROPE_SHARES name: [K, H]} of the CLS-row logit variance (unseen pairs);
      names, table: the rotation ablations' names (A) and {metric: [K, A]};
      wall_s: the ablation table's wall time (compile included).
    """
    t = run.config.task
    params = run.params
    prof = jax.device_get(
        jax.lax.map(jax.jit(lambda p: cls_profiles(p, t.n_labels, t.image_len)), params)
    )
    images = jnp.asarray(run.data.evals.unseen_images)
    shares = jax.device_get(
        jax.lax.map(lambda p: row_variance_shares(rope_logit_parts(p, images), ROPE_SHARES), params)
    )
    names, masks = rope_keep_masks(prof["slope"].shape[1])
    t0 = time.perf_counter()
    table = jax.block_until_ready(rope_ablation_table(params, run.settings, run.data, masks))
    wall = time.perf_counter() - t0
    return {"profiles": prof, "shares": shares, "names": names, "table": table, "wall_s": wall}


def head_rows(prof: dict, shares: dict, models) -> list[dict]:
    """heads.csv rows, model-major: profile statistics, variance shares, the profile;
    `models` [K] is each model's index in the run."""
    k, n_heads = prof["slope"].shape
    rows = []
    for i in range(k):
        for h in range(n_heads):
            p = prof["profile"][i, h]
            rows.append(
                {
                    "model": models[i],
                    "head": h,
                    "slope": float(prof["slope"][i, h]),
                    "spearman": float(prof["spearman"][i, h]),
                    "sign_agree": float(prof["sign_agree"][i, h]),
                    "delta_label": float(prof["delta_label"][i, h]),
                    "delta_pe": float(prof["delta_pe"][i, h]),
                    **{f"share_{n}": float(shares[n][i, h]) for n in ROPE_SHARES},
                    **{f"profile_{j}": float(p[j]) for j in range(len(p))},
                }
            )
    return rows


def print_heads(run: LoadedRun, prof: dict, rows: list[dict], log) -> None:
    """Logs the accuracies over models and each model's per-head profile line."""
    log(f"{run.k} model(s), vision_pos = 'rope', rope_base = {run.config.model.rope_base:g}")
    log("accuracies (mean +- std [min, max] over models):")
    for m in METRICS:
        log(f"  {m:>14} " + fmt_spread([r[m] for r in run.results]))
    n_heads = prof["slope"].shape[1]
    log(
        "\nCLS-row relative-position profile per head: the CLS logit to a lone object at "
        "pixel p (rotary offset p + 1), mean over the 20 labels, centred; slope in logit "
        "per pixel, Spearman with p, sign_agree = share of labels whose slope has the "
        "mean's sign; shares of the CLS-row logit variance (unseen-pair images)"
    )
    for i in range(run.k):
        log(f"  model {run.models[i]} (unseen {run.results[i]['unseen_acc']:.3f})")
        for h in range(n_heads):
            row, p = rows[i * n_heads + h], prof["profile"][i, h]
            log(
                f"    head {h}: slope {row['slope']:+.3f}/px  Spearman {row['spearman']:+.2f}"
                f"  sign_agree {row['sign_agree']:.2f}  d_pe {row['delta_pe']:.2f}"
                f" d_label {row['delta_label']:.2f}  share pos {row['share_position']:.2f}"
                f" (E {row['share_position_E']:.2f}, B {row['share_position_B']:.2f})"
                f"  profile [" + " ".join(f"{v:+.2f}" for v in p) + "]"
            )


def plot_rope(res: dict, abl_rows, out: str, models) -> list[str]:
    """profiles.png (every model's CLS-row profile per head; `models` [K]: the index in
    the run) and ablations.png."""
    k = len(models)
    return [
        plots.head_profiles(
            {f"model {m}": res["profiles"]["profile"][i] for i, m in enumerate(models)},
            os.path.join(out, "profiles.png"),
            "CLS-row logit to a lone object vs its pixel (mean over labels, centred)",
        ),
        plots.ablation_bars(
            abl_rows,
            list(res["names"]),
            os.path.join(out, "ablations.png"),
            f"rotation switched off ({k} models)",
        ),
    ]


def analyse_rope_run(path: str, log=print) -> dict:
    """Computes, writes, prints and plots the rotary report of one results folder.

    Raises ValueError for a folder whose vision tower is not rotary, of another task
    than 1D, or whose every model diverged; diverged models are left out and logged.
    Returns {"summary", "profiles", "shares", "ablation_rows"} over the finite models.
    """
    config = check_run(path)
    refusal = rope_refusal(config, path)
    if refusal:
        raise ValueError(refusal)
    out = plots.ensure_dir(os.path.join(path, "rope"))
    run = open_run(path, log=log)
    res = compute_rope(run)
    rows = head_rows(res["profiles"], res["shares"], run.models)
    print_heads(run, res["profiles"], rows, log)
    write_csv(os.path.join(out, "heads.csv"), rows)
    names, k = res["names"], run.k
    abl_rows = ablation_rows(res["table"], [{"ablation": a} for a in names], METRICS, run.models)
    write_csv(os.path.join(out, "ablations.csv"), abl_rows)
    log(
        f"\nrotation ablations ({k} models x {len(names)} masks, one compiled call, "
        f"{res['wall_s']:.1f} s): 'head h' = rotation off in head h, 'only h' = kept in head h only"
    )
    summary = {"ablation_wall_s": res["wall_s"], "models": k, "excluded": list(run.excluded)}
    summary["ablations"] = ablation_summary(res["table"], names, METRICS)
    print_ablation_summary(summary["ablations"], METRICS, log, "rotation off")
    summary["mean_shares"] = {n: float(np.mean(res["shares"][n])) for n in ROPE_SHARES}
    write_json(os.path.join(out, "summary.json"), summary)
    figs = plot_rope(res, abl_rows, out, run.models)
    log(
        "rope results: "
        + os.path.join(out, "ablations.csv")
        + "  "
        + os.path.join(out, "heads.csv")
    )
    log("figures: " + "  ".join(figs))
    return {
        "summary": summary,
        "profiles": res["profiles"],
        "shares": res["shares"],
        "ablation_rows": abl_rows,
    }
