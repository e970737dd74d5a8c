"""Paper 003's diagnostics on a results folder of VLMs.

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

A checkpoint is one model: its summary's cells are over its questions instead
(`checkpoint_site`, `checkpoint_occlusion`: seeded bootstrap 95% intervals, n the
questions a cell rests on), its signed deviations as means where a run's are per-model
medians ("deviation_right" / "deviation_wrong"), and its sites within `--layers` (layer L:
site L, the residual after L blocks; layer 0, before the first block, has no diagnostics).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import diagnostics as dg
from jaxmech.analysis import spatial_ids as si
from jaxmech.families.vlm_view import model_outline, over_models
from jaxmech.reports.common import (
    EXAMPLE_WORDS,
    EXAMPLES,
    LoadedRun,
    Report,
    compiled_call,
    declared,
    fmt_ci,
    fmt_interval,
    id_labels,
    joined,
    probe_rows,
    protocol_of,
    question_batches,
    question_ci,
    take_examples,
    view_of,
)
from jaxmech.reports.tables import Measure
from jaxmech.stats import BOOTSTRAP_DRAWS, correlation_ci, mann_whitney_u, mean_ci

MIN_WRONG = 5  # fewer wrong answers than this: no per-model test


diagnostics_refusal = declared(
    "diagnostics"
)  # why the report does not apply to a run (None: it does)


OCCLUSION_KIND = {"authors": "blur", "jaxmech": "fill"}  # a photograph's, by protocol
# the deviation's unit, by protocol (`analysis.diagnostics.COORDS`)
UNIT = {"jaxmech": "cells", "authors": "state units on the unit axes"}
# where each per-question result keeps its questions (`batches.joined`)
QUESTION_AXES = {"deviation": -1, "believed": -2, "true": -2, "occluded": -1, "margin": -1,
                 "relation": -1}  # fmt: skip


def compute(run: LoadedRun, seed: int = 0, log=print) -> dict:
    """`diagnostics.diagnose` of every model, stacked [K, ...], with the relations, over
    the subject's batches (`common.question_batches`). Drawn scenes: X's, Y's or a
    random free cell blanked. A dataset's photographs with both boxes (the others left
    out, said): X's box, Y's, or a box of X's size elsewhere blurred (the authors'
    protocol: radius 20 px as their `coco_blur.sh`, `image_twins.BLUR_RADIUS`) or
    filled with the image's mean colour (jaxmech's); the
    true IDs at the box centres, bilinear on the ID grid (`batches.box_weights`), each
    word centred on its state in the question asked without the image (the authors'
    text-only baseline: a photograph's object is no probed label)."""
    view = view_of(run)
    labels = id_labels(run)  # the universal IDs: training-pair labels
    # per relation (0 horizontal, 1 vertical), X and Y probes in its own template; the
    # authors': one universal ID, the first-named word's in the left / right question
    # with the other object at every other cell (`spatial_id_derivation/`), for both
    # words and relations
    probes = (
        [[si.probe(view, labels, named_first=True, relation=0, factorial=True)]]
        if protocol_of(run) == "authors"
        else [[si.probe(view, labels, named_first=first, relation=r) for first in (True, False)]
              for r in (0, 1)]
    )  # fmt: skip
    photos = run.subject.source != "drawn"
    kind = OCCLUSION_KIND[protocol_of(run)]
    occlusions = tuple(f"{kind}:{w}" for w in ("x", "y", "random"))
    twins = occlusions + ("text",) if photos else ()
    out = []
    for batch in question_batches(run, (0, 1), twins):
        if batch.cell_weights is not None:
            batch = _with_boxes(batch, log)
            if batch is None:
                continue
        out.append(_diagnose_batch(run, batch, probes, seed))
    if not out:
        raise ValueError("diagnostics: no question has both objects' boxes (n = 0)")
    out = joined(out, QUESTION_AXES)
    n_blocks = out["deviation"].shape[1]  # sites 1..n: after every block
    sites = report_sites(run, n_blocks)
    for k in ("deviation", "believed", "true"):
        out[k] = out[k][:, np.asarray(sites) - 1]
    return out | {"site": np.asarray(sites), "n_blocks": n_blocks, "unit": UNIT[protocol_of(run)]}


def _with_boxes(batch, log):
    """The batch's questions whose X and Y boxes are both known (None: none is)."""
    known = np.flatnonzero((batch.cell_weights.sum(-1) > 0).all(1))
    if len(known) < len(batch.index):
        log(f"  {len(batch.index) - len(known)} question(s) without both boxes: left out")
    if not len(known):
        return None
    twins = {k: take_examples(v, known) for k, v in batch.twins.items()}
    return batch._replace(examples=take_examples(batch.examples, known), twins=twins,
                          index=batch.index[known], cell_weights=batch.cell_weights[known])  # fmt: skip


def _diagnose_batch(run: LoadedRun, batch, probes, seed: int) -> dict:
    view, ex = batch.view, batch.examples
    keys = jax.random.split(jax.random.PRNGKey(seed), run.k)
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    if batch.cell_weights is None:
        # X's and Y's occlusions are the same for every model: rendered once
        fixed = [view.render(s)[0] for s in dg.occlusions(ex.spec, keys[0], view.grid.cells)[:2]]

        def occluded(key):
            rand = dg.occlusions(ex.spec, key, view.grid.cells)[2]
            return jax.tree_util.tree_map(stack, *fixed, view.render(rand)[0])

        occ = jax.tree_util.tree_map(stack, *(occluded(k) for k in keys))  # [K, O, ...]
    else:  # a photograph's occlusions are drawn once per question, for every model
        shown = [t.inputs for name, t in batch.twins.items() if name != "text"]
        one = jax.tree_util.tree_map(stack, *shown)
        occ = jax.tree_util.tree_map(lambda x: np.broadcast_to(x, (run.k,) + x.shape), one)

    batch_rows = probe_rows(run)
    # the rendered inputs are arguments, not constants folded into the program
    text = batch.twins.get("text")
    inputs = (ex.inputs, [[pr.inputs for pr in pair] for pair in probes],
              None if text is None else text.inputs)  # fmt: skip
    weights, protocol = batch.cell_weights, protocol_of(run)

    def one_model(args, inputs):
        p, o = args
        own = [
            [pr._replace(inputs=x) for pr, x in zip(pair, xs)]
            for pair, xs in zip(probes, inputs[1])
        ]
        t = None if text is None else text._replace(inputs=inputs[2])
        return dg.diagnose(view, p, ex._replace(inputs=inputs[0]), own, o, batch_rows, weights, t,
                           protocol)  # fmt: skip

    models = lambda a, x: over_models(lambda m: one_model(m, x), a)  # noqa: E731
    n_probes = sum(len(np.asarray(pr.label_N)) for pair in probes for pr in pair)
    what = f"diagnostics ({n_probes} probe scenes, {len(ex.answer_B)} questions x 4)"
    out = compiled_call(models, ((run.params, occ), inputs), what,
                        estimate=run.subject.estimates_time)  # fmt: skip
    return out | {"relation": np.asarray(ex.spec.relation_B)}


def report_sites(run: LoadedRun, n_blocks: int, log=None) -> list[int]:
    """The LM sites reported, 1..n_blocks (site y: the residual after y blocks, the
    authors' layer y; n_blocks: the last block's output), a checkpoint's within its
    `--layers`. Layer 0 has none (before the first block the object word has seen no
    image): left out (said to `log`); ValueError where no layer is left."""
    layers = run.subject.layers
    if layers is None:
        return list(range(1, n_blocks + 1))
    sites = sorted({y for y in layers if y >= 1})
    if not sites:
        raise ValueError(f"layers = {list(layers)}: the diagnostics need a layer in "
                         f"[1, {n_blocks}] (layer 0, before the first block, has no ID)")  # fmt: skip
    if log is not None and 0 in layers:
        log("layer 0 left out: before the first block the object word has seen no image")
    return sites


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
                    "site": int(_sites(res)[y]),
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


def _sites(res: dict) -> np.ndarray:
    """[Y'] the site of each of `res`'s site rows (`report_sites`; default 1..)."""
    return res.get("site", np.arange(1, res["deviation"].shape[1] + 1))


def _site_name(res: dict, site: int) -> str:
    n = res.get("n_blocks", res["deviation"].shape[1])
    return f"resid_pre.{site}" if site < n else "final"


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


# the per-model statistics a run's summary averages over models, and their printed bounds
MODEL_STATS = {"median_right": (None, None), "median_wrong": (None, None), "auc": (0.0, 1.0),
               "id_wrong_among_wrong": (0.0, 1.0), "id_wrong_among_right": (0.0, 1.0),
               "readout_corr": (None, None)}  # fmt: skip


def models_site(rows: list[dict]) -> tuple[dict, dict]:
    """({statistic: (mean, ci_low, ci_high, n)}, {statistic: printed cell}) of one site
    over a run's models (`deviation_rows` of that site; `stats.mean_ci`)."""
    col = lambda key: [r[key] for r in rows]  # noqa: E731
    cells = {key: mean_ci(col(key), None, None) for key in MODEL_STATS}
    text = {key: fmt_ci(col(key), *b) for key, b in MODEL_STATS.items()}
    return cells, text | {"right": text["median_right"], "wrong": text["median_wrong"],
                          "how": "median per model, 95% CI over models"}  # fmt: skip


def checkpoint_site(res: dict, y: int) -> tuple[dict, dict]:
    """`models_site` of one checkpoint (model 0) at site row `y`, over its questions:
    the mean signed deviation of right and wrong answers and the shares whose ID sign
    is wrong (`question_ci`: bootstrap), P(wrong > right) (`auc_ci`), the read-out
    correlation (`stats.correlation_ci`: Fisher z); n the questions each rests on."""
    right = res["margin"][0] > 0
    dev = res["deviation"][0, y]
    along = np.arange(dev.shape[0]), res["relation"]
    believed, true = res["believed"][0, y][along], res["true"][0, y][along]
    id_wrong = (believed * true <= 0).astype(float)
    cells = {
        "deviation_right": question_ci(dev[right]),
        "deviation_wrong": question_ci(dev[~right]),
        "auc": auc_ci(dev[~right], dev[right]),
        "id_wrong_among_wrong": question_ci(id_wrong[~right], 0.0, 1.0),
        "id_wrong_among_right": question_ci(id_wrong[right], 0.0, 1.0),
        "readout_corr": correlation_ci(believed, true),
    }
    text = {key: fmt_interval(ci) for key, ci in cells.items()}
    return cells, text | {"right": text["deviation_right"], "wrong": text["deviation_wrong"],
                          "how": "mean over questions, 95% bootstrap CI over questions"}  # fmt: skip


def auc_ci(wrong, right, seed: int = 0, draws: int = BOOTSTRAP_DRAWS):
    """(P(a wrong answer's deviation > a right one's), ci_low, ci_high, n): the
    Mann-Whitney AUC (ties count half) with a seeded bootstrap 95% interval that
    resamples the wrong and the right answers each; n both counted. Fewer than
    `MIN_WRONG` wrong answers or no right one: NaN and n = 0, as per model."""
    w, r = (np.asarray(v, float) for v in (wrong, right))
    w, r = w[np.isfinite(w)], r[np.isfinite(r)]
    if len(w) < MIN_WRONG or not len(r):
        return float("nan"), float("nan"), float("nan"), 0
    above = (w[:, None] > r[None]) + 0.5 * (w[:, None] == r[None])  # [W, R]
    rng = np.random.default_rng([seed, 96])
    cw = rng.multinomial(len(w), np.full(len(w), 1 / len(w)), draws)  # [draws, W] counts
    cr = rng.multinomial(len(r), np.full(len(r), 1 / len(r)), draws)
    boot = np.einsum("dw,wr,dr->d", cw, above, cr) / (len(w) * len(r))
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return float(above.mean()), float(lo), float(hi), len(w) + len(r)


def checkpoint_occlusion(res: dict, o: int, answers: str) -> dict:
    """{"sensitivity", "flip_rate": (mean, ci_low, ci_high, n)} of one checkpoint under
    occlusion `o` over its right or wrong answers (`question_ci`: bootstrap)."""
    right = res["margin"][0] > 0
    w = right if answers == "right" else ~right
    change = np.abs(res["occluded"][0, o] - res["margin"][0])
    flipped = ((res["occluded"][0, o] > 0) != right).astype(float)
    return {"sensitivity": question_ci(change[w]), "flip_rate": question_ci(flipped[w], 0.0, 1.0)}


def summarise(
    res: dict, dev_rows: list[dict], occ_rows: list[dict], log, one: bool = False
) -> dict:
    """summary.json's dict, printed: per site the deviation's cells over models
    (`models_site`), or over a checkpoint's questions where `one` (`checkpoint_site`),
    with the pooled Mann-Whitney test; then the occlusions' (`summarise_occlusion`)."""
    out = {}
    right = res["margin"] > 0
    for y, site in enumerate(_sites(res)):
        rows = [r for r in dev_rows if r["site"] == site]
        p_models = np.asarray([r["p"] for r in rows], float)
        pooled_w = res["deviation"][:, y][~right]
        pooled_r = res["deviation"][:, y][right]
        u, p = mann_whitney_u(pooled_w, pooled_r)
        cells, text = checkpoint_site(res, y) if one else models_site(rows)
        s = out[_site_name(res, site)] = cells | {
            "pooled_u": u,
            "pooled_p": p,
            "pooled_auc": u / max(len(pooled_w) * len(pooled_r), 1),
            "n_wrong": int(len(pooled_w)),
            "n_right": int(len(pooled_r)),
            "models_tested": int(np.isfinite(p_models).sum()),
            "models_p_below_0.05": int(np.sum(p_models < 0.05)),
        }
        # one model: its own test is the pooled one
        tested = f"{s['models_p_below_0.05']} of {s['models_tested']} tested (>= {MIN_WRONG} wrong)"
        per_model = "" if one else f"; per model p < 0.05 in {tested}"
        log(
            f"\nsite {site}: signed ID deviation ({res.get('unit', 'cells')}; > 0 towards "
            "the right answer), "
            f"{text['how']}:\n  right answers {text['right']}\n  wrong answers "
            f"{text['wrong']}\n  pooled Mann-Whitney "
            f"({s['n_wrong']} wrong vs {s['n_right']} right): P(wrong > right) "
            f"{s['pooled_auc']:.3f}, p = {p:.2g}{per_model}"
            f"; P(wrong > right) {text['auc']}"
            f"\n  per-example readout: corr(believed, true displacement) {text['readout_corr']}"
            f"\n  ID sign wrong among wrong answers {text['id_wrong_among_wrong']}; among "
            f"right answers {text['id_wrong_among_right']}"
        )
    return out | summarise_occlusion(res, occ_rows, log, one)


def summarise_occlusion(res: dict, occ_rows: list[dict], log, one: bool = False) -> dict:
    """{"occlusion/{name}/{answers}": {"sensitivity", "flip_rate": cell}}, printed: means
    over models with 95% intervals, or over a checkpoint's questions where `one`."""
    out = {}
    over = "bootstrap CI over questions" if one else "CI over models"
    log(f"\nocclusion: |change of the answer margin| (logits), 95% {over}")
    for o, name in enumerate(dg.OCCLUSIONS):
        for answers in ("right", "wrong"):
            if one:
                cells = checkpoint_occlusion(res, o, answers)
                v, f = fmt_interval(cells["sensitivity"]), fmt_interval(cells["flip_rate"])
            else:
                own = [r for r in occ_rows if (r["occlusion"], r["answers"]) == (name, answers)]
                sens, flips = [r["sensitivity"] for r in own], [r["flip_rate"] for r in own]
                cells = {"sensitivity": mean_ci(sens, None, None), "flip_rate": mean_ci(flips)}
                v, f = fmt_ci(sens, None, None), fmt_ci(flips, 0.0, 1.0)
            out[f"occlusion/{name}/{answers}"] = cells
            log(f"  {name:>6} cell, {answers:>5} answers: {v}; answer flips {f}")
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
        for v, colour, word in ((d[right], "C0", "right"), (d[~right], "C3", "wrong")):
            if len(v):  # an empty side has no density: named n = 0, not drawn as zeros
                axes[y].hist(v, bins, density=True, alpha=0.5, color=colour, label=word)
            else:
                axes[y].plot([], [], "s", color=colour, label=f"{word} (n = 0)")
        axes[y].axvline(0, color="k", lw=0.5)
        axes[y].set_xlabel(f"signed ID deviation ({res.get('unit', 'cells')})")
        axes[y].set_title(f"site {_sites(res)[y]}", fontsize=9)
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


def plot_paper(res: dict, path: str, k: int) -> str:
    """Fig. 8A as the paper draws it: per layer, the densities of the signed ID
    deviation (the margin relative to the ground truth, in cells) of right and of
    wrong answers (a run's pooled over its models), titled with the Mann-Whitney p of
    wrong against right."""
    from jaxmech import plots

    right = res["margin"] > 0  # [K, B]
    panels = []
    for y, site in enumerate(_sites(res)):
        d = res["deviation"][:, y]
        _, p = mann_whitney_u(d[~right], d[right])
        test = f"Mann-Whitney p = {p:.2g}" if np.isfinite(p) else "no test (a side is empty)"
        panels.append((f"Layer {site}: {test}", d[right], d[~right]))
    over = "one model" if k == 1 else f"{k} models pooled"
    fig = plots.deviation_histograms_figure(panels, f"ID deviation of right vs wrong "
                                            f"answers ({over}; > 0: towards the right answer)")  # fmt: skip
    return plots.save(fig, path)


def _tables(res: dict, run: LoadedRun) -> dict:
    return {
        "deviation": deviation_rows(res, run.models),
        "occlusion": occlusion_rows(res, run.models),
    }


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    one = run.subject.over_questions  # one model: intervals over its questions
    log(
        f"{'a checkpoint' if one else f'{run.k} models'}; "
        f"{EXAMPLE_WORDS.get(run.examples, 'pair questions')} of both relations; IDs of the "
        f"training-pair labels"
    )
    summary = summarise(res, tables["deviation"], tables["occlusion"], log, one)
    return summary | {"excluded": list(run.excluded)}


REPORT = Report(
    folder="diagnostics",
    refusal=diagnostics_refusal,
    compute=compute,
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: [
        plot(res, tables["occlusion"], path),
        plot_paper(res, path.replace(".png", "_paper.png"), run.k),
    ],
    figure="diagnostics.png",
    check=lambda run, log: check_layers(run, log),  # --layers, before any compute
    examples=EXAMPLES,
    per_model=("margin", "deviation", "believed", "true", "occluded"),
    photos=True,
    compare=(
        Measure("deviation AUC (wrong vs right)", "deviation", "auc", (), ("site",)),
        Measure("readout correlation", "deviation", "readout_corr", (), ("site",)),
        Measure(
            "occlusion flip rate, right answers",
            "occlusion",
            "flip_rate",
            (("answers", "right"),),
            ("occlusion",),
        ),
    ),
)


def check_layers(run: LoadedRun, log=None) -> None:
    """`report_sites` of a checkpoint before any compute: ValueError naming its
    `--layers` where none has diagnostics."""
    report_sites(run, view_of(run).n_lm_blocks(model_outline(run.params)), log)
