"""The mechanism report of a results folder: ablation table, head roles, EP gradients.

Writes into `RUN/mechanism/`:
  ablations.csv  model, ablation, single_acc, seen_acc, unseen_acc, labelset_acc
  heads.csv      model, head, role, delta_label, delta_pe, ep_gradient (Spearman of the
                 CLS-row EP over key positions), ep_slope (logit / pixel), ep_range,
                 qp_gradient, qp_slope
  shares.csv     model, head, term, share of the CLS-row logit variance (unseen pairs)
  summary.json   per-ablation means, the ablation table's wall time, the excluded
                 (diverged) models
  figures: terms.png, cls_profiles.png, ablations.png, ep_gradient.png

The E/P report needs the 1D task and a vision tower with a learned `P`; a rotary
vision tower (`vision_pos = "rope"`) has its own report, `jaxmech.reports.rope`, and
so do 2D and three-object runs, `jaxmech.reports.relations`. Diverged models are left
out of every table, statistic and figure, and named (`reports.common.open_run`).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech import plots
from jaxmech.analysis.ablate import DEFAULT_ABLATIONS, ablation_table
from jaxmech.analysis.decompose import decompose, row_variance_shares
from jaxmech.analysis.heads import head_table, strongest_heads
from jaxmech.config import Config
from jaxmech.families.dual_encoder.evaluate import METRICS
from jaxmech.reports.common import (
    LoadedRun,
    Report,
    ablation_rows,
    ablation_summary,
    analyse,
    declared,
    print_ablation_summary,
)

SHARE_TERMS = ("EE", "EP", "PE", "PP", "BE", "BP", "XX", "BX", "QP")


def ep_report_refusal(config: Config, path: str) -> str | None:
    """Why the E/P mechanism report does not apply to a run (None when it does)."""
    # its EP slope and Spearman are over a line of pixels: on a 2D grid they would be
    # read over the flattened cells, and a third object changes the task
    why = declared(
        "mechanism", "2D / three-object runs: python -m experiments.relations --run={path}"
    )
    if why(config, path):
        return why(config, path)
    if config.model.vision_pos != "learned":
        return (
            f"{path}: vision_pos = {config.model.vision_pos!r}: the vision tower has no "
            "learned P, so the E/P term decomposition and ablations do not apply; use "
            f"python -m experiments.rope --run={path}"
        )
    return None


def compute_mechanism(run: LoadedRun, ablations, heads=None) -> dict:
    """The report's numbers for K models with a learned P.

    Returns:
      table: {metric: [K, A]} accuracies under each ablation (all heads or `heads`);
      wall_s: the ablation table's wall time (compile included);
      heads: `head_table`, {name: [K, H]} (profiles [K, H, L]);
      shares: {term: [K, H]} share of the CLS-row logit variance on unseen-pair images.
    """
    cfg = run.config
    t0 = time.perf_counter()
    table = jax.block_until_ready(
        ablation_table(
            run.params,
            run.settings,
            run.data,
            tuple(ablations),
            heads=heads,
        )
    )
    wall = time.perf_counter() - t0
    ht = jax.device_get(head_table(run.params, cfg.task.n_labels, cfg.task.image_len))
    images = jnp.asarray(run.data.evals.unseen_images)
    shares = jax.device_get(
        jax.lax.map(lambda p: row_variance_shares(decompose(p, images), SHARE_TERMS), run.params)
    )
    return {"table": table, "wall_s": wall, "heads": ht, "shares": shares}


def head_rows(ht: dict, models) -> list[dict]:
    """heads.csv rows from a `head_table` ({name: [K, H]}), model-major; `models` [K]
    is each model's index in the run."""
    k, n_heads = ht["delta_pe"].shape
    return [
        {
            "model": models[i],
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


def share_rows(shares: dict, models) -> list[dict]:
    """shares.csv rows from {term: [K, H]}, model-major then head then term; `models`
    [K] is each model's index in the run."""
    k, n_heads = shares[SHARE_TERMS[0]].shape
    return [
        {"model": models[i], "head": h, "term": t, "share": float(shares[t][i, h])}
        for i in range(k)
        for h in range(n_heads)
        for t in SHARE_TERMS
    ]


def print_mechanism(res: dict, summary: dict, unseen, models, log) -> None:
    """Logs the ablation table, each model's head roles and strongest head (`models`
    [K]: its index in the run), mean shares."""
    k, n_ablations = np.shape(res["table"][METRICS[0]])
    log(
        f"ablation table: {k} model(s) x {n_ablations} ablations x 4 sets, one compiled "
        f"call, {res['wall_s']:.1f} s (compile included)"
    )
    print_ablation_summary(summary["ablations"], METRICS, log, "ablation")
    ht, strong = res["heads"], res["strong"]
    n_heads = ht["delta_pe"].shape[1]
    log("\nheads (per model): role of each head; strongest CLS-row EP head: slope, Spearman")
    for i in range(k):
        roles = "".join("R" if ht["relational"][i, h] else "l" for h in range(n_heads))
        log(
            f"  model {models[i]:3d} unseen {unseen[i]:.3f}  roles {roles}  strongest head "
            f"{strong['head'][i]}: EP slope {strong['ep_slope'][i]:+.3f}/px, "
            f"Spearman {strong['ep_gradient'][i]:+.2f}"
        )
    log(
        "mean share of CLS-row logit variance (over models and heads): "
        + ", ".join(f"{t} {v:.2f}" for t, v in summary["mean_shares"].items())
    )


def plot_mechanism(run: LoadedRun, res: dict, abl_rows, ablations, out, unseen, threshold):
    """The report's four figures (module doc); returns their paths."""
    ht, strong = res["heads"], res["strong"]
    i0 = 0
    h0 = int(strong["head"][i0])
    images = jnp.asarray(run.data.evals.unseen_images)
    terms = decompose(jax.tree_util.tree_map(lambda x: x[i0], run.params), images[:1])
    labels = ["CLS"] + [str(int(t)) if t else "." for t in np.asarray(images[0])]
    gen = unseen >= threshold
    return [
        plots.term_heatmaps(
            {n: terms[n][0, h0] for n in ("EE", "EP", "PE", "PP", "BP")},
            os.path.join(out, "terms.png"),
            f"model {run.models[i0]}, head {h0}: logit terms on an unseen-pair image",
            labels,
        ),
        plots.head_profiles(
            {"EP": ht["ep_profile"][i0], "BP": ht["bp_profile"][i0], "QP": ht["qp_profile"][i0]},
            os.path.join(out, "cls_profiles.png"),
            f"model {run.models[i0]}: CLS-row terms per head",
        ),
        plots.ablation_bars(
            abl_rows,
            list(ablations),
            os.path.join(out, "ablations.png"),
            f"term ablations, all vision heads ({run.k} models)",
        ),
        plots.groups_strip(
            {
                f"unseen >= {threshold}": np.abs(strong["ep_slope"][gen]),
                f"unseen < {threshold}": np.abs(strong["ep_slope"][~gen]),
            },
            os.path.join(out, "ep_gradient.png"),
            "|CLS-row EP slope| of strongest head (logit/px)",
            "EP gradient: generalising vs not",
        ),
    ]


def mechanism_report(ablations=DEFAULT_ABLATIONS, heads=None, threshold: float = 0.9) -> Report:
    """The mechanism report (`common.Report`) for the given ablations, heads and the
    unseen-pair accuracy that counts as generalising (the figures' groups)."""

    def compute(run: LoadedRun) -> dict:
        res = compute_mechanism(run, ablations, heads)
        strong = strongest_heads(res["heads"])
        return res | {"strong": strong, "unseen": run.unseen_acc(), "models": run.models}

    def tables(res: dict, run: LoadedRun) -> dict:
        columns = [{"ablation": a} for a in ablations]
        return {
            "ablations": ablation_rows(res["table"], columns, METRICS, run.models),
            "heads": head_rows(res["heads"], run.models),
            "shares": share_rows(res["shares"], run.models),
        }

    def summarise(res: dict, tables: dict, run: LoadedRun, log) -> dict:
        summary = {
            "ablation_wall_s": res["wall_s"],
            "models": run.k,
            "excluded": list(run.excluded),
            "ablations": ablation_summary(res["table"], ablations, METRICS),
            "mean_shares": {t: float(np.mean(res["shares"][t])) for t in SHARE_TERMS},
        }
        print_mechanism(res, summary, res["unseen"], run.models, log)
        return summary

    def plot(res: dict, tables: dict, run: LoadedRun, path: str) -> list[str]:
        out = os.path.dirname(path)
        return plot_mechanism(run, res, tables["ablations"], ablations, out, res["unseen"], threshold)  # fmt: skip

    return Report("mechanism", ep_report_refusal, compute, tables, summarise, plot, "terms.png")


def analyse_run(
    path: str, ablations=DEFAULT_ABLATIONS, heads=None, threshold: float = 0.9, log=print
) -> dict:
    """Computes, writes, prints and plots the mechanism report of one results folder
    (`mechanism_report`, `common.analyse`).

    Args:
      path: a finished 1D results folder with a learned-P vision tower (else ValueError),
        with at least one finite model; diverged models are left out and logged.
      ablations: names (`analysis.ablate.parse_ablation`), "none" first by convention.
      heads: vision heads to ablate in (default all).
      threshold: unseen-pair accuracy that counts as generalising (figure groups).
      log: where the tables go, one line a call.

    Returns:
      {"summary": summary.json's dict, "strong": `strongest_heads` ({name: [K]}),
      "unseen": [K] unseen-pair accuracies, "ablation_rows": ablations.csv's rows,
      "models": [K] each model's index in the run}, over the K finite models.
    """
    out = analyse(mechanism_report(ablations, heads, threshold), path, log)
    res = out["res"]
    return {
        "summary": out["summary"],
        "strong": res["strong"],
        "unseen": res["unseen"],
        "ablation_rows": out["tables"]["ablations"],
        "models": res["models"],
    }


def compare_runs(results: dict, out: str, threshold: float = 0.9, log=print) -> str:
    """EP gradient of generalising vs non-generalising models pooled over several runs.

    `results`: {path: `analyse_run`'s return}. Logs per group n, mean and range of the
    strongest head's |EP slope| and |Spearman|; returns the figure's path.
    """
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
