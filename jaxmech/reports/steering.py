"""Paper 003's steering with spatial IDs on a results folder of VLMs.

For every model, its IDs `Delta_y` from probe scenes (`analysis.spatial_ids`), then at
every LM site after the first block (`lm/resid_pre.{y}`, y >= 1: before that the object
word has seen no image) on the questions of both relations, the seen-pair ones first
and the unseen-pair ones beside them, each summarised over the generalising models and
then the others (`common.analyse`); the IDs are the universal ones of the training-pair
labels (`common.id_labels`):

* adversarial steering: X's word moved by `alpha * (Delta(target) - Delta(source))`
  from its own cell to the far edge on the other side of Y (same row for left/right,
  same column for above/below), for every alpha in ALPHAS; the flip rate (answers right
  before, wrong after) against norm-matched Gaussian noise and a norm-matched direction
  orthogonal to the ID subspace (`analysis.steering`);
* arbitrary-ID curves: X steered to every cell in turn (alpha CURVE_ALPHA): the belief
  logit(right) - logit(left) on left/right questions, logit(below) - logit(above) on
  above/below ones, per target cell;
* steerability vs accuracy: the ID flip rate at REF_ALPHA against each model's
  unseen-pair accuracy, Pearson and Spearman r over models.
* the authors' protocol beside it (`analysis.steering.authors_margins`): the unit ID
  difference at AUTHORS_SCALE x the token's own norm, added to X's word and the other
  way to Y's, each site on its own, a flip any sign change over all examples; the mean
  of the TOP_LAYERS best sites, the controls at the same sites.

Writes into `RUN/steering/` (every row also names its `examples` and `model_group`):
  flips.csv     model, site, relation, kind, alpha, flip_rate, n_right, rel_norm
  curves.csv    model, site, relation, target_row, target_col, belief
  curves_paper.csv  the same at the paper's alpha (PAPER_CURVE_ALPHA = 5)
  authors.csv   model, site, relation, kind, flip_rate (the authors' protocol, every site)
  summary.json  means over models with 95% intervals; figure steering.png
"""

from __future__ import annotations

import numpy as np

from jaxmech.analysis import steering as st
from jaxmech.analysis.steering import (
    ALPHAS,
    CURVE_ALPHA,
    REF_ALPHA,
    flip_rates,
)
from jaxmech.data.spec import RELATIONS
from jaxmech.reports.common import (
    EXAMPLE_WORDS,
    EXAMPLES,
    LoadedRun,
    Report,
    cell_interval,
    compiled_call,
    declared,
    fmt_ci,
    fmt_interval,
    id_labels,
    joined,
    needs_depth,
    probe_rows,
    protocol_of,
    question_batches,
    steered_sites,
    steering_examples,
    view_of,
)
from jaxmech.stats import correlation_ci, mean_ci


def steering_refusal(config, path: str) -> str | None:
    """Why this report does not apply to a run (None when it does)."""
    return declared("steering")(config, path) or needs_depth(config, path)


# where each per-question result keeps its questions (`batches.joined`)
QUESTION_AXES = {"flips": -1, "curves": -2, "curves_paper": -2, "authors": -1, "relation": -1}


def compute(run: LoadedRun, seed: int = 0, log=print) -> dict:
    """`analysis.steering.steer_models` on the relation questions of `run.examples`,
    with the universal IDs of the training-pair labels (`common.id_labels`), at every
    site y >= 1 (a checkpoint's: its `--layers` from 1 on), and the sites; a dataset's
    photographs per image size (`common.question_batches`), those whose X and Y boxes
    are both known (their centres' cells: where X is steered from, and which side Y is
    on), the IDs from drawn probes as the paper's (the same in every batch)."""
    sites, protocol, out = steered_sites(run), protocol_of(run), []
    for batch in question_batches(run, (0, 1)):
        ex, source, target = steering_examples(run, batch)
        if len(ex.answer_B) < len(batch.index):
            log(f"  {len(batch.index) - len(ex.answer_B)} question(s) without both boxes: "
                "left out (no cell to steer from)")  # fmt: skip
        if not len(ex.answer_B):
            continue
        what = f"steering ({len(ex.answer_B)} questions, {len(sites)} sites)"
        out.append(st.steer_models(
            batch.view, run.params, ex, source, target, seed, id_labels(run), sites,
            probe_rows(run), lambda fn, args: compiled_call(fn, args, what),
            against="answer" if protocol == "authors" else "truth",
            factorial=protocol == "authors"))  # fmt: skip
    if not out:
        raise ValueError("steering: no question has both objects' boxes (n = 0); "
                         "COCO-Spatial and a manifest with boxes have them")  # fmt: skip
    return joined(out, QUESTION_AXES) | {"sites": sites, "protocol": protocol}


def curve_beliefs(res: dict, grid_h: int, grid_w: int, key: str = "curves") -> dict:
    """{relation: [K, Y', H, W]} mean belief per target cell over the relation's
    examples: logit(right) - logit(left), logit(below) - logit(above); `key`: "curves"
    (alpha CURVE_ALPHA) or "curves_paper" (the paper's alpha)."""
    c = res[key]  # [K, Y', L, B, 4]
    out = {}
    for r, name in enumerate(RELATIONS):
        w = res["relation"] == r
        belief = c[..., 2 * r + 1] - c[..., 2 * r]
        m = belief[..., w].sum(-1) / w.sum() if w.any() else np.full(belief.shape[:-1], np.nan)
        out[name] = m.reshape(m.shape[:2] + (grid_h, grid_w))
    return out


def accuracy(run: LoadedRun) -> np.ndarray:
    """[K] unseen-pair accuracy, the mean of the two relations."""
    nan = float("nan")  # a checkpoint has no accuracies
    return np.asarray(
        [(float(r.get("unseen_h_acc", nan)) + float(r.get("unseen_v_acc", nan))) / 2
         for r in run.results]
    )  # fmt: skip


def flip_rows(fr: dict, models, sites) -> list[dict]:
    k, n_sites, _ = fr[("id", "horizontal")].shape
    return [
        {
            "model": models[i],
            "site": sites[y],
            "relation": rel,
            "kind": kind,
            "alpha": a,
            "flip_rate": float(fr[(kind, rel)][i, y, j]),
            "n_right": int(fr[("n", rel)][i, y]),
            "rel_norm": float(fr[("rel_norm", rel)][i, y, j]),
        }
        for i in range(k)
        for y in range(n_sites)
        for rel in RELATIONS
        for kind in st.KINDS
        for j, a in enumerate(ALPHAS)
    ]


def curve_rows(cb: dict, models, grid_w: int, sites) -> list[dict]:
    k, n_sites = cb["horizontal"].shape[:2]
    return [
        {
            "model": models[i],
            "site": sites[y],
            "relation": rel,
            "target_row": c // grid_w,
            "target_col": c % grid_w,
            "belief": float(cb[rel][i, y].ravel()[c]),
        }
        for i in range(k)
        for y in range(n_sites)
        for rel in RELATIONS
        for c in range(cb[rel][i, y].size)
    ]


def _edge_gap(cb: dict) -> dict:
    """{relation: [K, Y']} the curve's belief at the far edge minus the near edge
    (last column minus first for left/right, last row minus first for above/below)."""
    return {
        "horizontal": cb["horizontal"][..., :, -1].mean(-1) - cb["horizontal"][..., :, 0].mean(-1),
        "vertical": cb["vertical"][..., -1, :].mean(-1) - cb["vertical"][..., 0, :].mean(-1),
    }


def authors_rows(ar: dict, models, sites) -> list[dict]:
    k, n_sites = ar[("id", "horizontal")].shape
    return [
        {"model": models[i], "site": sites[y], "relation": rel, "kind": kind,
         "flip_rate": float(ar[(kind, rel)][i, y]), "n": int(ar[("n", rel)][i, y])}
        for i in range(k)
        for y in range(n_sites)
        for rel in RELATIONS
        for kind in st.KINDS
    ]  # fmt: skip


def summarise_paper_curves(cb: dict, log, sites) -> dict:
    """The ID curves' far-minus-near edge gap at the paper's alpha, per site."""
    gap, out = _edge_gap(cb), {}
    for y in range(cb["horizontal"].shape[1]):
        for rel in RELATIONS:
            g = gap[rel][:, y]
            out[f"resid_pre.{sites[y]}/{rel}/curve_edge_gap_alpha{st.PAPER_CURVE_ALPHA:g}"] = (
                mean_ci(g, None, None)
            )
            log(
                f"ID curve at resid_pre.{sites[y]} ({rel}, alpha {st.PAPER_CURVE_ALPHA:g}, the "
                f"paper's): far edge minus near edge {fmt_ci(g, None, None)} logits"
            )
    return out


def summarise_authors(ar: dict, log, sites, against: str = "truth") -> dict:
    """The authors' steering: per site the flip rates with their intervals (over
    questions for a checkpoint) and the top-site mean per relation, 95% CI over
    models."""
    how = ("against the model's own answer, corner IDs, unambiguous answers counted"
           if against == "answer" else "X towards the far edge beyond Y, every example")  # fmt: skip
    log(f"\nthe authors' steering: {st.AUTHORS_SCALE:g} x |h| at both object words, each "
        f"site alone, {how}; a flip: the answer changed")  # fmt: skip
    out = {}
    for y, site in enumerate(sites):
        for rel in RELATIONS:
            cells = {k: cell_interval(ar[("flips", k, rel)][:, y], 0.0, 1.0) for k in st.KINDS}
            out[f"authors/layer {site}/{rel}"] = cells
            log(
                f"layer {site:>3} {rel:>10} "
                + " ".join(f"{k} {fmt_interval(c, signed=False)}" for k, c in cells.items())
            )
    for rel in RELATIONS:
        top = ar[("top", rel)]
        out[f"authors/{rel}"] = {k: mean_ci(v) for k, v in top.items()}
        log(f"mean of the {st.TOP_LAYERS} best layers per model, 95% CI over models: {rel:>10} "
            + " ".join(f"{k} {fmt_ci(v, 0.0, 1.0)}" for k, v in top.items()))  # fmt: skip
    return out


def summarise(fr: dict, cb: dict, acc: np.ndarray, log, sites) -> dict:
    out = {}
    j = ALPHAS.index(REF_ALPHA)
    n_sites = fr[("id", "horizontal")].shape[1]
    gap = _edge_gap(cb)
    for y in range(n_sites):
        site = f"resid_pre.{sites[y]}"
        log(f"\nsteering X's word at {site}: flip rate (answers right before), 95% CI over "
            "models (one checkpoint: over its questions, bootstrap) and n")  # fmt: skip
        log(
            f"{'relation':>10} {'alpha':>5} {'|added|/|x|':>11} "
            + " ".join(f"{k:>22}" for k in st.KINDS)
        )
        for rel in RELATIONS:
            for a, alpha in enumerate(ALPHAS):
                cells = {k: cell_interval(fr[("flips", k, rel)][:, y, a], 0.0, 1.0)
                         for k in st.KINDS}  # fmt: skip
                norm = float(np.mean(fr[("rel_norm", rel)][:, y, a]))
                out[f"{site}/{rel}/{alpha}"] = cells | {"rel_norm": norm}
                log(
                    f"{rel:>10} {alpha:>5} {norm:>11.2f} "
                    + " ".join(f"{fmt_interval(c, signed=False):>30}" for c in cells.values())
                )
        for rel in RELATIONS:
            g = gap[rel][:, y]
            out[f"{site}/{rel}/curve_edge_gap"] = mean_ci(g, None, None)
            log(
                f"ID curve ({rel}, alpha {CURVE_ALPHA}): belief at the far edge minus the "
                f"near edge {fmt_ci(g, None, None)} logits"
            )
        steer = (fr[("id", "horizontal")][:, y, j] + fr[("id", "vertical")][:, y, j]) / 2
        pearson, spearman = correlation_ci(steer, acc), correlation_ci(steer, acc, rank=True)
        out[f"{site}/steerability_vs_accuracy"] = {"pearson": pearson, "spearman": spearman}
        log(
            f"steerability (ID flip rate at alpha {REF_ALPHA}) vs unseen-pair accuracy over "
            f"{pearson[3]} models: Pearson r {pearson[0]:+.2f} [{pearson[1]:+.2f}, "
            f"{pearson[2]:+.2f}], Spearman {spearman[0]:+.2f}"
        )
    return out


def plot(fr: dict, cb: dict, acc: np.ndarray, path: str, sites) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    y = fr[("id", "horizontal")].shape[1] - 1  # the last site
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    for rel, ls in zip(RELATIONS, ("-", "--")):
        for kind, colour in zip(st.KINDS, ("C3", "C0", "C2")):
            v = fr[(kind, rel)][:, y]
            lo_hi = np.array([mean_ci(v[:, a])[1:3] for a in range(len(ALPHAS))])
            axes[0].plot(ALPHAS, v.mean(0), ls, color=colour, label=f"{kind} ({rel[0]})")
            axes[0].fill_between(ALPHAS, lo_hi[:, 0], lo_hi[:, 1], color=colour, alpha=0.12)
    axes[0].set_xscale("log")
    axes[0].set_xlim(min(ALPHAS), max(ALPHAS))  # every rate empty (n = 0): no data limits
    axes[0].set_xlabel("alpha")
    axes[0].set_ylabel("flip rate")
    axes[0].legend(fontsize=6)
    axes[0].set_title(f"adversarial steering at resid_pre.{sites[y]}", fontsize=9)
    for ax, rel, word in zip(axes[1:3], RELATIONS, ("right - left", "below - above")):
        im = ax.imshow(cb[rel][:, y].mean(0), cmap="RdBu_r")
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_title(f"{rel} questions: logit {word}\nvs X's steered-to cell", fontsize=9)
    j = ALPHAS.index(REF_ALPHA)
    steer = (fr[("id", "horizontal")][:, y, j] + fr[("id", "vertical")][:, y, j]) / 2
    axes[3].scatter(acc, steer)
    axes[3].set_xlabel("unseen-pair accuracy")
    axes[3].set_ylabel(f"ID flip rate (alpha {REF_ALPHA})")
    axes[3].set_title("steerability vs accuracy", fontsize=9)
    return plots.save(fig, path)


def _compute(run: LoadedRun) -> dict:
    res = compute(run)
    grid = view_of(run).grid
    cb = curve_beliefs(res, grid.h, grid.w)
    cb_paper = curve_beliefs(res, grid.h, grid.w, "curves_paper")
    return res | {
        "flip_rates": flip_rates(res),
        "authors_rates": st.authors_flip_rates(res),
        "beliefs": cb,
        "beliefs_paper": cb_paper,
        "accuracy": accuracy(run),
    }


def _tables(res: dict, run: LoadedRun) -> dict:
    w, sites = view_of(run).grid.w, res["sites"]
    return {
        "flips": flip_rows(res["flip_rates"], run.models, sites),
        "curves": curve_rows(res["beliefs"], run.models, w, sites),
        "curves_paper": curve_rows(res["beliefs_paper"], run.models, w, sites),
        "authors": authors_rows(res["authors_rates"], run.models, sites),
    }


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    labels = id_labels(run)
    log(
        f"{run.k} models; {EXAMPLE_WORDS.get(run.examples, 'pair questions')}, X's word "
        f"steered; IDs of the labels {labels.start}-{labels.stop - 1}"
    )
    sites = res["sites"]
    summary = summarise(res["flip_rates"], res["beliefs"], res["accuracy"], log, sites)
    against = "answer" if res["protocol"] == "authors" else "truth"
    summary |= summarise_authors(res["authors_rates"], log, sites, against)
    summary |= summarise_paper_curves(res["beliefs_paper"], log, sites)
    return summary | {"alphas": list(ALPHAS), "excluded": list(run.excluded),
                      "protocol": res["protocol"]}  # fmt: skip


REPORT = Report(
    folder="steering",
    refusal=steering_refusal,
    compute=_compute,
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: plot(
        res["flip_rates"], res["beliefs"], res["accuracy"], path, res["sites"]
    ),
    figure="steering.png",
    examples=EXAMPLES,
    per_model=("flip_rates", "authors_rates", "beliefs", "beliefs_paper", "accuracy"),
    photos=True,
)
