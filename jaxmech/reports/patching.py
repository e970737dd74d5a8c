"""Seed 003's mirror-swap patching on a results folder of VLMs (issue 13, part 1).

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
    table_call_for,
    table_compile_at,
    token_groups,
)
from jaxmech.data.spec import take
from jaxmech.data.tasks import get_task
from jaxmech.families.vlm_view import examples
from jaxmech.reports.common import (
    EXAMPLE_WORDS,
    EXAMPLES,
    LoadedRun,
    Report,
    analyse,
    analyse_loaded,
    checkpoint_data,
    chunk_progress,
    declared,
    fmt_ci,
    plots_dir,
    question_specs,
    rows_per_call,
    table_store,
    view_of,
)
from jaxmech.stats import mean_ci

TWINS = ("mirror", "recolour")


def patched_relation(run: LoadedRun, view) -> tuple[int, dict]:
    """(relation id, {word name: answer token, "both": None}) of the questions patched:
    the task's first relation (`Task.answer_relations`); a checkpoint's: left / right."""
    if run.task is None:
        first, second = (int(w) for w in np.asarray(view.answer_words)[0])
        return 0, {"left": first, "right": second, "both": None}
    rel = get_task(run.config.task.task_kind).answer_relations[0][1]
    first, second = (int(w) for w in np.asarray(view.answer_words)[rel])
    names = get_task(run.config.task.task_kind).words
    return rel, {names[first]: first, names[second]: second, "both": None}


patching_refusal = declared("patching")  # why the report does not apply to a run (None: it does)


def compute(run: LoadedRun, log=print) -> dict:
    """{twin: patch_logp over K models} on the questions of `run.examples`
    (`common.question_specs`) of the patched relation (`patched_relation`), the answer
    words [B], the word names, the patched LM blocks and the wall time. Every question
    is rendered at once (one length); they run `batch` at a time (a checkpoint's
    `common.rows_per_call`; a run's all at once) through one compiled call
    (`analysis.patching.patch_table`), with progress per chunk, a checkpoint's
    finished chunks kept and resumed (`common.table_store`)."""
    view, specs = view_of(run), question_specs(run)
    rel, words = patched_relation(run, view)
    asked = np.asarray(specs["examples"].relation_B) == rel
    ex = examples(view, take(specs["examples"], asked))
    twins = {t: view.render(take(specs[t], asked), ask=ex.spec)[0] for t in TWINS}
    ckpt, n = checkpoint_data(run), len(ex.answer_B)
    layers = ckpt.layers if ckpt and ckpt.layers else tuple(range(view.n_lm_blocks(run.params)))
    groups, shared = token_groups(ex.spans), np.asarray(ex.spans.image_BxI).min(1)
    call = table_call_for(view, run.params, twins, groups, layers, shared)
    t0 = time.perf_counter()
    at = table_compile_at(call, run.params, ex.inputs, twins, groups, ex.answer_B, ex.other_B)
    batch, plan = rows_per_call(run, at, n, log)
    store = table_store(run, "patching", layers=layers)
    logp = patch_table(view, run.params, ex.inputs, twins, groups, ex.answer_B, ex.other_B,
                       batch=batch, progress=chunk_progress(log, batch), call=call, store=store,
                       plan=plan)  # fmt: skip
    return {
        "logp": logp,
        "answer": np.asarray(ex.answer_B),
        "words": words,
        "layers": layers,
        "wall_s": time.perf_counter() - t0,
    }


def shifts(res: dict) -> dict:
    """{(twin, word, kind): [K, Y, G]} mean shifts (kind "logp" / "p") over the kept
    examples, and {(word,): [K]} their counts. Kept: right on the example and its mirror
    (the mirror's answer is the other word: its log p is `twin_other`)."""
    m = res["logp"]["mirror"]
    kept_KxB = (m["orig"] > m["orig_other"]) & (m["twin_other"] > m["twin"])
    out = {}
    for word, token in res["words"].items():
        w_KxB = kept_KxB & (True if token is None else res["answer"][None] == token)
        n_K = w_KxB.sum(1)
        out[("n", word)] = n_K
        for twin in TWINS:
            d = res["logp"][twin]
            for kind, f in (("logp", lambda x: x), ("p", np.exp)):
                # the denominator is the mirror's for both twins (module docstring)
                s = np.asarray(
                    belief_shift(
                        f(m["orig"])[:, None, None], f(d["patched"]), f(m["twin"])[:, None, None]
                    )
                )
                w = w_KxB[:, None, None, :]
                total = np.where(w, np.nan_to_num(s), 0.0).sum(-1)
                out[(twin, word, kind)] = total / np.maximum(n_K, 1)[:, None, None]
    return out


def shift_rows(sh: dict, models, layers) -> list[dict]:
    k, n_layers, n_groups = sh[("mirror", "both", "logp")].shape
    words = [key[1] for key in sh if key[0] == "n"]
    return [
        {
            "model": models[i],
            "twin": twin,
            "layer": layers[y],
            "group": GROUPS[g],
            "word": word,
            "shift_logp": float(sh[(twin, word, "logp")][i, y, g]),
            "shift_p": float(sh[(twin, word, "p")][i, y, g]),
            "n": int(sh[("n", word)][i]),
        }
        for i in range(k)
        for twin in TWINS
        for word in words
        for y in range(n_layers)
        for g in range(n_groups)
    ]


def summarise(sh: dict, log, layers) -> dict:
    out = {}
    n_layers = sh[("mirror", "both", "logp")].shape[1]
    for twin in TWINS:
        log(
            f"\n{twin} patch, belief shift of the answer word (log-prob; prob), 95% CI over models:"
        )
        log(f"{'layer':>5} " + " ".join(f"{g:>52}" for g in GROUPS))
        for y in range(n_layers):
            cells = []
            for g, group in enumerate(GROUPS):
                lp, p = sh[(twin, "both", "logp")][:, y, g], sh[(twin, "both", "p")][:, y, g]
                out[f"{twin}/{layers[y]}/{group}"] = {
                    "shift_logp": mean_ci(lp, None, None),
                    "shift_p": mean_ci(p, None, None),
                }
                cells.append(f"{fmt_ci(lp, None, None)}; {np.mean(p):+.2f}")
            log(f"{layers[y]:>5} " + " ".join(f"{c:>52}" for c in cells))
    return out


def plot_shifts(sh: dict, path: str, k: int, layers) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    fig, axes = plt.subplots(1, len(TWINS), figsize=(4.2 * len(TWINS), 2.8), squeeze=False)
    for ax, twin in zip(axes[0], TWINS):
        s = sh[(twin, "both", "logp")]
        mean = np.nanmean(s, 0)
        ax.imshow(mean, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
        for y in range(mean.shape[0]):
            for g in range(mean.shape[1]):
                lo, hi = mean_ci(s[:, y, g], None, None)[1:3]
                ax.text(
                    g,
                    y,
                    f"{mean[y, g]:.2f}\n[{lo:.2f},{hi:.2f}]",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if abs(mean[y, g]) > 0.6 else "black",
                )
        ax.set_xticks(range(len(GROUPS)), GROUPS)
        ax.set_yticks(range(mean.shape[0]), [f"resid_pre.{y}" for y in layers])
        ax.set_title(f"{twin} patch ({k} models)", fontsize=9)
    fig.suptitle("belief shift of the answer word (log-prob), mean [95% CI]", fontsize=9)
    return plots.save(fig, path)


def with_shifts(res: dict) -> dict:
    return res | {"shifts": shifts(res)}


def _tables(res: dict, run: LoadedRun) -> dict:
    return {"shifts": shift_rows(res["shifts"], run.models, res["layers"])}


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    n = res["shifts"][("n", "both")]
    log(
        f"{run.k} models; {EXAMPLE_WORDS.get(run.examples, 'pair questions')}, {'/'.join(list(res['words'])[:2])} ones kept (right on the example and "
        f"its mirror): {int(n.min())}-{int(n.max())} per model; one compiled call "
        f"{res['wall_s']:.1f} s"
    )
    return {
        "patches": summarise(res["shifts"], log, res["layers"]),
        "kept": n.tolist(),
        "excluded": list(run.excluded),
    }


REPORT = Report(
    folder="patching",
    refusal=patching_refusal,
    compute=lambda run: with_shifts(compute(run)),
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: plot_shifts(res["shifts"], path, run.k, res["layers"]),
    figure="shifts.png",
    examples=EXAMPLES,
    per_model=("logp", "shifts"),
)


def analyse_patching_run(path: str, log=print) -> dict:
    """The mirror-swap report of one results folder (`common.analyse`). Raises
    ValueError for a run it does not apply to or whose every model diverged."""
    return analyse(REPORT, path, log)


def analyse_patching_checkpoint(run: LoadedRun, out: str, log=print) -> dict:
    """The mirror-swap report of a checkpoint (`common.open_checkpoint`) into `out`."""
    return analyse_loaded(REPORT, run, plots_dir(out, REPORT.folder), log)
