"""Seed 003's diagnostics on a results folder of VLMs (issue 13, part 4).

On the questions of both relations (the seen-pair questions first and the unseen-pair ones beside them, each summarised
over the generalising models and then the others (`common.analyse`)), per model and LM site after the first
block (`analysis.diagnostics`), with the universal IDs of the training-pair labels:

* the signed ID deviation of right vs wrong answers, with a Mann-Whitney U test per
  model and over the pooled examples (the paper: wrong answers deviate negatively);
* where the errors sit: the share of wrong answers whose believed X-minus-Y
  displacement already has the wrong sign ("ID wrong": the ViT or the binding into the
  word failed) vs the right sign ("ID right": a later stage failed), beside the same
  share among right answers (how often the ID is wrong without hurting the answer);
* occlusion: |change of the answer margin| when X's, Y's or a random free cell is
  blanked, for right and wrong answers.

Writes into `RUN/diagnostics/` (every row also names its `examples` and `model_group`):
  deviation.csv  model, site, n_right, n_wrong, median_right, median_wrong, u, p, auc
                 (P(a wrong answer's deviation > a right one's)), id_wrong_among_wrong,
                 id_wrong_among_right, readout_corr (the believed against the true
                 X-minus-Y displacement along the asked axis, over the examples: how
                 well one example's ID says where its objects are)
  occlusion.csv  model, occlusion, answers (right / wrong), sensitivity, flip_rate, n
  summary.json   means over models with 95% intervals; figure diagnostics.png
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import diagnostics as dg
from jaxmech.analysis import spatial_ids as si
from jaxmech.families.vlm_view import over_models
from jaxmech.reports.common import (
    EXAMPLE_WORDS,
    EXAMPLES,
    LoadedRun,
    Report,
    analyse,
    analyse_loaded,
    compiled_call,
    declared,
    fmt_ci,
    id_labels,
    plots_dir,
    probe_rows,
    relation_questions,
    view_of,
)
from jaxmech.stats import correlation_ci, mann_whitney_u, mean_ci

MIN_WRONG = 5  # fewer wrong answers than this: no per-model test


diagnostics_refusal = declared(
    "diagnostics"
)  # why the report does not apply to a run (None: it does)


def compute(run: LoadedRun, seed: int = 0) -> dict:
    """`diagnostics.diagnose` of every model, stacked [K, ...], with the relations."""
    view = view_of(run)
    labels = id_labels(run)  # the universal IDs: training-pair labels
    # per relation (0 horizontal, 1 vertical), X and Y probes in its own template
    probes = [
        [si.probe(view, labels, named_first=first, relation=r) for first in (True, False)]
        for r in (0, 1)
    ]
    ex = relation_questions(run)
    keys = jax.random.split(jax.random.PRNGKey(seed), run.k)
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731

    # X's and Y's occlusions are the same for every model: rendered once
    fixed = [view.render(s)[0] for s in dg.occlusions(ex.spec, keys[0], view.grid.cells)[:2]]

    def occluded(key):
        rand = dg.occlusions(ex.spec, key, view.grid.cells)[2]
        return jax.tree_util.tree_map(stack, *fixed, view.render(rand)[0])

    occ = jax.tree_util.tree_map(stack, *(occluded(k) for k in keys))  # [K, O, ...]

    batch = probe_rows(run)

    # the rendered inputs are arguments, not constants folded into the program
    inputs = (ex.inputs, [[pr.inputs for pr in pair] for pair in probes])

    def one_model(args, inputs):
        p, o = args
        own = [
            [pr._replace(inputs=x) for pr, x in zip(pair, xs)]
            for pair, xs in zip(probes, inputs[1])
        ]
        return dg.diagnose(view, p, ex._replace(inputs=inputs[0]), own, o, batch)

    models = lambda a, x: over_models(lambda m: one_model(m, x), a)  # noqa: E731
    n_probes = sum(len(np.asarray(pr.label_N)) for pair in probes for pr in pair)
    what = f"diagnostics ({n_probes} probe scenes, {len(ex.answer_B)} questions x 4)"
    out = compiled_call(models, ((run.params, occ), inputs), what)
    return out | {"relation": np.asarray(ex.spec.relation_B)}


def deviation_rows(res: dict, models) -> list[dict]:
    right = res["margin"] > 0  # [K, B]
    k, n_sites = res["deviation"].shape[:2]
    rows = []
    for i in range(k):
        for y in range(n_sites):
            dev = res["deviation"][i, y]
            r, w = dev[right[i]], dev[~right[i]]
            u, p = mann_whitney_u(w, r) if len(w) >= MIN_WRONG else (np.nan, np.nan)
            along = np.arange(dev.shape[0]), res["relation"]
            believed, true = res["believed"][i, y][along], res["true"][i, y][along]
            id_wrong = believed * true <= 0
            rows.append(
                {
                    "model": models[i],
                    "site": y + 1,
                    "n_right": int(right[i].sum()),
                    "n_wrong": int((~right[i]).sum()),
                    "median_right": float(np.median(r)) if len(r) else np.nan,
                    "median_wrong": float(np.median(w)) if len(w) else np.nan,
                    "u": u,
                    "p": p,
                    "auc": u / (len(w) * len(r)) if len(w) >= MIN_WRONG and len(r) else np.nan,
                    "id_wrong_among_wrong": float(id_wrong[~right[i]].mean()) if len(w) else np.nan,
                    "id_wrong_among_right": float(id_wrong[right[i]].mean()) if len(r) else np.nan,
                    "readout_corr": correlation_ci(believed, true)[0],
                }
            )
    return rows


def occlusion_rows(res: dict, models) -> list[dict]:
    right = res["margin"] > 0
    rows = []
    for i in range(len(models)):
        for o, name in enumerate(dg.OCCLUSIONS):
            change = np.abs(res["occluded"][i, o] - res["margin"][i])
            flipped = (res["occluded"][i, o] > 0) != right[i]
            for answers, w in (("right", right[i]), ("wrong", ~right[i])):
                rows.append(
                    {
                        "model": models[i],
                        "occlusion": name,
                        "answers": answers,
                        "sensitivity": float(change[w].mean()) if w.any() else np.nan,
                        "flip_rate": float(flipped[w].mean()) if w.any() else np.nan,
                        "n": int(w.sum()),
                    }
                )
    return rows


def summarise(res: dict, dev_rows: list[dict], occ_rows: list[dict], log) -> dict:
    out = {}
    right = res["margin"] > 0
    for y in range(res["deviation"].shape[1]):
        site = f"resid_pre.{y + 1}" if y + 1 < res["deviation"].shape[1] else "final"
        rows = [r for r in dev_rows if r["site"] == y + 1]
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        pooled_w = res["deviation"][:, y][~right]
        pooled_r = res["deviation"][:, y][right]
        u, p = mann_whitney_u(pooled_w, pooled_r)
        out[site] = {
            key: mean_ci(col(key), None, None)
            for key in (
                "median_right",
                "median_wrong",
                "auc",
                "id_wrong_among_wrong",
                "id_wrong_among_right",
                "readout_corr",
            )
        } | {
            "pooled_u": u,
            "pooled_p": p,
            "pooled_auc": u / max(len(pooled_w) * len(pooled_r), 1),
            "n_wrong": int(len(pooled_w)),
            "n_right": int(len(pooled_r)),
            "models_tested": int(np.isfinite(col("p")).sum()),
            "models_p_below_0.05": int(np.sum(np.asarray(col("p")) < 0.05)),
        }
        s = out[site]
        log(
            f"\nsite {y + 1}: signed ID deviation (cells; > 0 towards the right answer), "
            f"median per model, 95% CI over models:\n  right answers "
            f"{fmt_ci(col('median_right'), None, None)}\n  wrong answers "
            f"{fmt_ci(col('median_wrong'), None, None)}\n  pooled Mann-Whitney "
            f"({s['n_wrong']} wrong vs {s['n_right']} right): P(wrong > right) "
            f"{s['pooled_auc']:.3f}, p = {p:.2g}; per model p < 0.05 in "
            f"{s['models_p_below_0.05']} of {s['models_tested']} tested (>= {MIN_WRONG} wrong)"
            f"; per model P(wrong > right) {fmt_ci(col('auc'), 0.0, 1.0)}"
            f"\n  per-example readout: corr(believed, true displacement) "
            f"{fmt_ci(col('readout_corr'), None, None)}"
            f"\n  ID sign wrong among wrong answers "
            f"{fmt_ci(col('id_wrong_among_wrong'), 0.0, 1.0)}; among right answers "
            f"{fmt_ci(col('id_wrong_among_right'), 0.0, 1.0)}"
        )
    log("\nocclusion: |change of the answer margin| (logits), 95% CI over models")
    for name in dg.OCCLUSIONS:
        for answers in ("right", "wrong"):
            v = [r["sensitivity"] for r in occ_rows if (r["occlusion"], r["answers"]) == (name, answers)]  # fmt: skip
            f = [r["flip_rate"] for r in occ_rows if (r["occlusion"], r["answers"]) == (name, answers)]  # fmt: skip
            out[f"occlusion/{name}/{answers}"] = {
                "sensitivity": mean_ci(v, None, None),
                "flip_rate": mean_ci(f),
            }
            log(
                f"  {name:>6} cell, {answers:>5} answers: {fmt_ci(v, None, None)}; "
                f"answer flips {fmt_ci(f, 0.0, 1.0)}"
            )
    return out


def plot(res: dict, occ_rows: list[dict], path: str) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    right = res["margin"] > 0
    n_sites = res["deviation"].shape[1]
    fig, axes = plt.subplots(1, n_sites + 1, figsize=(4 * (n_sites + 1), 3))
    for y in range(n_sites):
        d = res["deviation"][:, y]
        lo, hi = np.percentile(d, [1, 99])
        bins = np.linspace(lo, hi, 40)
        axes[y].hist(d[right], bins, density=True, alpha=0.5, color="C0", label="right")
        axes[y].hist(d[~right], bins, density=True, alpha=0.5, color="C3", label="wrong")
        axes[y].axvline(0, color="k", lw=0.5)
        axes[y].set_xlabel("signed ID deviation (cells)")
        axes[y].set_title(f"site {y + 1}", fontsize=9)
        axes[y].legend(fontsize=7)
    ax = axes[-1]
    for j, answers in enumerate(("right", "wrong")):
        means = [
            np.nanmean(
                [
                    r["sensitivity"]
                    for r in occ_rows
                    if (r["occlusion"], r["answers"]) == (o, answers)
                ]
            )  # fmt: skip
            for o in dg.OCCLUSIONS
        ]
        ax.bar(np.arange(len(dg.OCCLUSIONS)) + 0.4 * j, means, 0.4, label=f"{answers} answers")
    ax.set_xticks(np.arange(len(dg.OCCLUSIONS)) + 0.2, [f"{o} cell" for o in dg.OCCLUSIONS])
    ax.set_ylabel("|margin change| (logits)")
    ax.set_title("occlusion", fontsize=9)
    ax.legend(fontsize=7)
    return plots.save(fig, path)


def _tables(res: dict, run: LoadedRun) -> dict:
    return {
        "deviation": deviation_rows(res, run.models),
        "occlusion": occlusion_rows(res, run.models),
    }


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    log(
        f"{run.k} models; {EXAMPLE_WORDS.get(run.examples, 'pair questions')} of both relations; IDs of the "
        f"training-pair labels"
    )
    summary = summarise(res, tables["deviation"], tables["occlusion"], log)
    return summary | {"excluded": list(run.excluded)}


REPORT = Report(
    folder="diagnostics",
    refusal=diagnostics_refusal,
    compute=compute,
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: plot(res, tables["occlusion"], path),
    figure="diagnostics.png",
    examples=EXAMPLES,
    per_model=("margin", "deviation", "believed", "true", "occluded"),
)


def analyse_diagnostics_run(path: str, log=print) -> dict:
    """The diagnostics report of one results folder (`common.analyse`)."""
    return analyse(REPORT, path, log)


def analyse_diagnostics_checkpoint(run: LoadedRun, out: str, log=print) -> dict:
    """The diagnostics report of a checkpoint (`common.open_checkpoint`) into `out`."""
    return analyse_loaded(REPORT, run, plots_dir(out, REPORT.folder), log)
