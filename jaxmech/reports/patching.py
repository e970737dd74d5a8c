"""Paper 003's mirror-swap patching on a results folder of VLMs.

On the questions of the task's first relation (scenes: left/right; video: before/after,
whose mirror twin is the time-reversed video), every model x LM layer x token group x
example is patched with the mirrored twin's residual stream, and with the recolour
twin's as the control, in one compiled call (`analysis.patching.patch_logp`). The
seen-pair questions are the main set, the unseen-pair ones beside them; each is
summarised over the generalising models, then the others (`common.analyse`). An
example counts when the model answers it and its mirror right (the mirror must move
the belief for a shift to mean anything); shifts are means over those examples, per
answer word of the original (left / right; before / after) and over both.

Writes into `RUN/patching/`:
  shifts.csv    model, examples (seen / unseen), model_group (generalising / others), twin
                (mirror / recolour), layer, group, word, shift_logp, shift_p, n
  summary.json  per question set and model group ("seen/generalising", ...), twin,
                layer and token group (word "both"): mean over models and 95%
                interval of shift_logp and shift_p; figure shifts.png (the main part)
"""

from __future__ import annotations

import time

import numpy as np

from jaxmech.analysis.patching import (
    GROUPS,
    belief_shift,
    patch_table,
    resume_plan,
    table_call_for,
    table_compile_at,
    token_groups,
)
from jaxmech.memory import remembered
from jaxmech.reports.common import (
    EXAMPLE_WORDS,
    EXAMPLES,
    LoadedRun,
    Report,
    cell_interval,
    chunk_progress,
    declared,
    fmt_interval,
    joined,
    log_estimate,
    protocol_of,
    question_batches,
    rows_per_call,
    table_store,
)
from jaxmech.reports.questions import (
    GROUP_WORDS,
    PAPER_GROUPS,
    authors_groups,
    patched_relation,
    report_view,
)
from jaxmech.reports.tables import Measure

TWINS = ("mirror", "recolour")


patching_refusal = declared("patching")  # why the report does not apply to a run (None: it does)


def compute(run: LoadedRun, log=print) -> dict:
    """{twin: patch_logp over K models} on the questions of `run.examples` of the
    patched relation (`patched_relation`), the answer words [B], the word names, the
    patched LM blocks and the wall time, over the subject's batches of one shape
    (`common.question_batches`: drawn scenes are one; a dataset's photographs one per
    image size, their twins the flipped and the rainbow-recoloured photograph). Each
    batch runs `batch` questions at a time (a checkpoint's `common.rows_per_call`; a
    run's all at once) through one compiled call (`analysis.patching.patch_table`),
    with progress per chunk, a checkpoint's finished chunks kept and resumed
    (`common.table_store`). Under the authors' protocol the questions are rendered in
    the family's wording for this report where it has one (`questions.report_view`:
    LLaVA's is `mirror_swapping.py`'s prompt and read pieces) and the "text" group is
    theirs (`authors_groups`)."""
    view = report_view(run, "patching")  # LLaVA's under the authors' protocol: their prompt
    batches = question_batches(run, (patched_relation(run, view)[0],), TWINS, view)
    out = [_batch_logp(run, b, log) for b in batches]
    return joined(out, ("logp", "answer"))


def _batch_logp(run: LoadedRun, batch, log) -> dict:
    view, ex = batch.view, batch.examples
    twins = {t: batch.twins[t].inputs for t in TWINS}
    n, n_blocks = len(ex.answer_B), view.n_lm_blocks(run.params)
    layers = run.subject.layers or tuple(range(n_blocks))
    if max(layers) >= n_blocks:
        raise ValueError(
            f"layers = {list(layers)}: layer {n_blocks} (the last block's output) is not "
            f"patched, as only the final norm reads it; expected layers in [0, {n_blocks - 1}]"
        )
    groups, shared = token_groups(ex.spans), np.asarray(ex.spans.image_BxI).min(1)
    if protocol_of(run) == "authors":
        groups = authors_groups(groups, ex.spans)
    call = table_call_for(view, run.params, twins, groups, layers, shared)
    # a patched run: the LM from its layer on, over the rows from its resume start
    # (`resume_plan`; every row without one), counted as that share of a whole
    # forward (an over-count by the ViT's share: the ViT does not run)
    S = np.asarray(groups).shape[-1]
    plan = resume_plan(view, groups, shared) or [(0, False)] * len(groups)
    rows = sum((S - s0) / S for s0, _ in plan)
    tail = sum((n_blocks - y) / n_blocks for y in layers) * rows
    secs = log_estimate(run, view, ex.inputs, n * len(twins) * (1 + tail) + n,
                        f"{len(layers)} layers x {len(groups)} groups x {len(twins)} twins x {n} "
                        "questions (a patched run counted as the share of LM blocks and rows it "
                        "runs)", log)  # fmt: skip
    t0 = time.perf_counter()
    # the plan's sizing compile is kept: where its rows are the chunk's, the table's own
    at = remembered(table_compile_at(call, run.params, ex.inputs, twins, groups, ex.answer_B,
                                     ex.other_B))  # fmt: skip
    batch_rows, plan = rows_per_call(run, at, n, log, secs)
    store = table_store(run, "patching", layers=layers, **batch.key)
    logp = patch_table(view, run.params, ex.inputs, twins, groups, ex.answer_B, ex.other_B,
                       batch=batch_rows, progress=chunk_progress(log, batch_rows), call=call,
                       store=store, plan=plan, compiled=at.program)  # fmt: skip
    return {
        "protocol": protocol_of(run),
        "logp": logp,
        "answer": np.asarray(ex.answer_B),
        "words": patched_relation(run, view)[1],
        "layers": layers,
        "wall_s": time.perf_counter() - t0,
    }


def shifts(res: dict, protocol: str = "jaxmech") -> dict:
    """{(twin, word, kind): [K, Y, G, B]} each example's belief shift (kind "logp" / "p";
    NaN where the example is not counted), {(twin, word, kind, "mean"): [K, Y, G]} the
    means over the counted examples (NaN: none counted) and {("n", word): [K]} their
    counts.

    jaxmech: the shift of the answer word's belief; counted: right on the example and
    its mirror (the mirror's answer is the other word: its log p is `twin_other`);
    words: the examples whose answer is left / right / both; the denominator is the
    mirror's for both twins (a recolour leaves the answer, so its own is ~0).
    authors (`mirror_swapping.py`, `attribute_swapping.py`, `fig4.ipynb`): the change of
    each read word "left" / "right" ("both": their mean) over every example, each twin
    over its own denominator, NaN and inf counted as 0."""
    out = {}
    if protocol == "authors":
        lp, names = _word_logps(res), list(res["words"])[:2] + ["both"]
        for twin in TWINS:
            for kind, f in (("logp", lambda x: x), ("p", np.exp)):
                per_word = [_authors_shift(lp, twin, w, f) for w in (0, 1)]
                for word, v in zip(names, per_word + [sum(per_word) / 2]):
                    out[(twin, word, kind)] = v
        k, b = lp[("mirror", "orig")][0].shape  # every example counts
        out |= {("n", w): np.full(k, b) for w in names}
    else:
        m = res["logp"]["mirror"]
        kept_KxB = (m["orig"] > m["orig_other"]) & (m["twin_other"] > m["twin"])
        for word, token in res["words"].items():
            w_KxB = kept_KxB & (True if token is None else res["answer"][None] == token)
            out[("n", word)] = w_KxB.sum(1)
            for twin in TWINS:
                d = res["logp"][twin]
                for kind, f in (("logp", lambda x: x), ("p", np.exp)):
                    s = np.asarray(belief_shift(f(m["orig"])[:, None, None], f(d["patched"]),
                                                f(m["twin"])[:, None, None]))  # fmt: skip
                    w = w_KxB[:, None, None, :]
                    out[(twin, word, kind)] = np.where(w, np.nan_to_num(s), np.nan)
    for key in [k for k in out if k[0] != "n"]:
        v = out[key]
        n = np.isfinite(v).sum(-1)
        out[key + ("mean",)] = np.where(n > 0, np.nansum(v, -1) / np.maximum(n, 1), np.nan)
    return out


def _word_logps(res: dict) -> dict:
    """{(twin, run): ([K, ..., B] log p of the relation's first word, of its second)}
    for the runs "orig", "twin" and "patched" of each twin, from the answer / other
    word's."""
    first = res["answer"] == next(iter(res["words"].values()))  # the answer is "left"
    out = {}
    for twin in TWINS:
        d = res["logp"][twin]
        for run, own, other in (("orig", "orig", "orig_other"), ("twin", "twin", "twin_other"),
                                ("patched", "patched", "patched_other")):  # fmt: skip
            out[(twin, run)] = (
                np.where(first, d[own], d[other]),
                np.where(first, d[other], d[own]),
            )
    return out


def _authors_shift(lp: dict, twin: str, w: int, f) -> np.ndarray:
    """[K, Y, G, B] the authors' shift of read word w (0 left, 1 right) under `twin`:
    (orig - patched) / (orig - twin) over the twin's own run, NaN / inf set to 0."""
    o, t = f(lp[(twin, "orig")][w]), f(lp[(twin, "twin")][w])
    patched = f(lp[(twin, "patched")][w])
    with np.errstate(divide="ignore", invalid="ignore"):
        s = (o[:, None, None] - patched) / (o - t)[:, None, None]
    return np.where(np.isfinite(s), s, 0.0)


def shift_rows(sh: dict, models, layers) -> list[dict]:
    k, n_layers, n_groups = sh[("mirror", "both", "logp", "mean")].shape
    words = [key[1] for key in sh if key[0] == "n"]
    return [
        {
            "model": models[i],
            "twin": twin,
            "layer": layers[y],
            "group": GROUPS[g],
            "word": word,
            "shift_logp": float(sh[(twin, word, "logp", "mean")][i, y, g]),
            "shift_p": float(sh[(twin, word, "p", "mean")][i, y, g]),
            "n": int(sh[("n", word)][i]),
        }
        for i in range(k)
        for twin in TWINS
        for word in words
        for y in range(n_layers)
        for g in range(n_groups)
    ]


def summarise(sh: dict, log, layers, protocol: str = "jaxmech") -> dict:
    out = {}
    n_layers = sh[("mirror", "both", "logp", "mean")].shape[1]
    one = sh[("mirror", "both", "logp")].shape[0] == 1
    over = "questions (bootstrap)" if one else "models"
    words = [k[1] for k in sh if k[0] == "n"] if protocol == "authors" else ["both"]
    what = ("change of each word's belief (log-prob), every question, each twin's own "
            "denominator" if protocol == "authors" else "belief shift of the answer word "
            "(log-prob), questions right on the example and its mirror")  # fmt: skip
    for twin in TWINS:
        log(f"\n{twin} patch, {what}; mean [95% CI over {over}] n:")
        groups = GROUPS[: sh[(twin, "both", "logp")].shape[2]]
        log(f"{'layer':>5} {'word':>5} " + " ".join(f"{g:>34}" for g in groups))
        for y in range(n_layers):
            for word in words:
                cells = []
                for g, group in enumerate(groups):
                    lp = cell_interval(sh[(twin, word, "logp")][:, y, g])
                    p = cell_interval(sh[(twin, word, "p")][:, y, g])
                    key = f"{twin}/{layers[y]}/{group}" + ("" if word == "both" else f"/{word}")
                    out[key] = {"shift_logp": lp, "shift_p": p}
                    cells.append(fmt_interval(lp))
                log(f"{layers[y]:>5} {word:>5} " + " ".join(f"{c:>34}" for c in cells))
    return out


def plot_shifts(sh: dict, path: str, k: int, layers) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    fig, axes = plt.subplots(1, len(TWINS), figsize=(4.6 * len(TWINS), 2.8), squeeze=False)
    for ax, twin in zip(axes[0], TWINS):
        s = sh[(twin, "both", "logp")]
        cells = [[cell_interval(s[:, y, g]) for g in range(s.shape[2])] for y in range(s.shape[1])]
        mean = np.asarray([[c[0] for c in row] for row in cells])
        ax.imshow(mean, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
        for y, row in enumerate(cells):
            for g, (m, lo, hi, n) in enumerate(row):
                text = "n = 0" if n == 0 else f"{m:.2f}\n[{lo:.2f},{hi:.2f}]"
                ax.text(g, y, text, ha="center", va="center", fontsize=7,
                        color="white" if abs(np.nan_to_num(m)) > 0.6 else "black")  # fmt: skip
        ax.set_xticks(range(len(GROUPS)), GROUPS)
        ax.set_yticks(range(mean.shape[0]), [f"layer {y}" for y in layers])
        over = "questions" if k == 1 else f"{k} models"
        ax.set_title(f"{twin} patch (95% CI over {over})", fontsize=9)
    fig.suptitle("belief shift (log-prob), mean [95% CI]; layer L: the residual after L "
                 "blocks", fontsize=9)  # fmt: skip
    return plots.save(fig, path)


# Fig. 4's panels: the twin ((A) the mirror, (B) its control), in the paper's words
PAPER_TWINS = {"mirror": "(A) Mirror Swapping", "recolour": "(B) Attribute Swapping (recolour)"}


def plot_paper(sh: dict, path: str, k: int, layers, protocol: str = "jaxmech") -> str:
    """Fig. 4 as the paper draws it: belief shift (log-prob) against layer, one curve
    per token group with its 95% interval (over questions for a checkpoint, over
    models for a run) as a band; a column per twin, a row per read word (the authors'
    protocol: Delta "left", Delta "right"; jaxmech's: the answer word)."""
    from jaxmech import plots

    n_groups = sh[("mirror", "both", "logp")].shape[2]
    groups = [g for g in GROUPS[:n_groups] if protocol != "authors" or g in PAPER_GROUPS]
    words = [key[1] for key in sh if key[0] == "n"][:2] if protocol == "authors" else ["both"]
    panels = [
        [(f"{PAPER_TWINS[twin]}: " + (f'\u0394"{w}"' if w != "both" else "answer word"),
          {GROUP_WORDS[g]: _curve(sh[(twin, w, "logp")][:, :, GROUPS.index(g)]) for g in groups})
         for twin in TWINS]
        for w in words
    ]  # fmt: skip
    over = "questions (bootstrap)" if k == 1 else f"{k} models"
    fig = plots.shift_curves_figure(
        panels, layers, f"belief shift per token group; band: 95% CI over {over}; layer L: "
        "the residual after L blocks")  # fmt: skip
    return plots.save(fig, path)


def _curve(per_example_KxYxB) -> np.ndarray:
    """[Y, 4] each layer's (mean, ci_low, ci_high, n) (`cell_interval`)."""
    v = np.asarray(per_example_KxYxB)
    return np.asarray([cell_interval(v[:, y]) for y in range(v.shape[1])], float)


def _plot(res: dict, tables: dict, run: LoadedRun, path: str) -> list[str]:
    """The table figure (`plot_shifts`) and Fig. 4 beside it (`plot_paper`)."""
    sh, layers = res["shifts"], res["layers"]
    paper = path.replace(".png", "_paper.png")
    return [plot_shifts(sh, path, run.k, layers),
            plot_paper(sh, paper, run.k, layers, res["protocol"])]  # fmt: skip


def with_shifts(res: dict) -> dict:
    return res | {"shifts": shifts(res, res["protocol"])}


def _tables(res: dict, run: LoadedRun) -> dict:
    return {"shifts": shift_rows(res["shifts"], run.models, res["layers"])}


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    n = res["shifts"][("n", "both")]
    sets = EXAMPLE_WORDS.get(run.examples, "pair questions")
    if res["protocol"] == "authors":
        log(f"{run.k} model(s); {sets}: every question counts (the authors' protocol), "
            f"{int(n.min())} per model; {res['wall_s']:.1f} s")  # fmt: skip
    else:
        log(f"{run.k} model(s); {sets}, {'/'.join(list(res['words'])[:2])} ones kept (right on "
            f"the example and its mirror): {int(n.min())}-{int(n.max())} per model; "
            f"{res['wall_s']:.1f} s")  # fmt: skip
    return {
        "protocol": res["protocol"],
        "patches": summarise(res["shifts"], log, res["layers"], res["protocol"]),
        "kept": n.tolist(),
        "excluded": list(run.excluded),
    }


REPORT = Report(
    folder="patching",
    refusal=patching_refusal,
    compute=lambda run: with_shifts(compute(run)),
    tables=_tables,
    summarise=_summary,
    plot=_plot,
    figure="shifts.png",
    examples=EXAMPLES,
    per_model=("logp", "shifts"),
    photos=True,
    compare=(
        Measure(
            "mirror patch: belief shift (log-prob)",
            "shifts",
            "shift_logp",
            (
                ("twin", "mirror"),
                ("word", "both"),
                ("group", ("image", "question", "objects", "last")),
            ),
            ("layer", "group"),
        ),
    ),
)
