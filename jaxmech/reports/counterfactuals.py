"""Paper 004's counterfactual table on a results folder of VLMs.

On the questions of both relations (the seen-pair questions first and the unseen-pair ones beside them, each summarised
over the generalising models and then the others (`common.analyse`)), every model answers every example
under every counterfactual of `analysis.counterfactuals` (with a rope2d ViT, also the
ViT mirrors in one block at a time: always for a results folder, with `--per_block`
for a checkpoint) in one compiled call. Per
model, relation and counterfactual:

* agree_mirror: the share of answers equal to the model's own answer on the mirrored
  image (width mirror for left/right, height mirror for above/below): the paper's
  "reproduces the flipped-image answer" (with two options, also the flip rate when the
  mirror flips the answer);
* changed: the share of answers that differ from the plain run's;
* among the plain run's errors, binding failures: the same relation word whichever
  object is asked about.

Writes into `RUN/counterfactuals/` (every row also names its `examples` and `model_group`):
  table.csv     model, counterfactual, relation, agree_mirror, changed, n
  errors.csv    model, relation, errors, binding_failures, share
  summary.json  means with 95% intervals (mean, ci_low, ci_high, n): over models for a
                results folder, a checkpoint's (one model) bootstrapped over its
                questions (n: the questions); figure counterfactuals.png
"""

from __future__ import annotations

import jax
import numpy as np

from jaxmech.analysis import counterfactuals as cfa
from jaxmech.chunks import run_chunks
from jaxmech.data.spec import RELATIONS
from jaxmech.families.vlm_view import model_outline, over_models
from jaxmech.reports.common import (
    EXAMPLE_WORDS,
    EXAMPLES,
    LoadedRun,
    Report,
    chunk_progress,
    declared,
    fmt_ci,
    fmt_question_ci,
    joined,
    log_estimate,
    protocol_of,
    question_batches,
    question_ci,
    rows_per_call,
    table_store,
    view_of,
)
from jaxmech.stats import mean_ci

counterfactuals_refusal = declared(
    "counterfactuals"
)  # why the report does not apply (None: it does)
MIRROR_OF = {"horizontal": "image_w", "vertical": "image_h"}


def notes(view, params, config=None) -> dict[str, str]:
    """{counterfactual: why it is an exact no-op for this model (one model's params;
    `config` a run's, None for a checkpoint)}, printed beside its row: under rotary ViT
    positions (set per block) a uniform column shift cancels in q . k (so the offset
    mirror is the plain mirror); a ViT that sees
    each frame alone has one row per frame, so mirroring rows changes nothing. With a
    position table beside the rotary (Qwen3-VL) the shifts are changes: the table is
    read between its cells."""
    out = {}
    if view.vit_blocks(params) and view.vit_table:  # the table reads between its cells
        out["vit_half"] = "the rotary part cancels in q.k: the table's shift acts"
    elif view.vit_blocks(params):
        out["vit_half"] = "exact no-op: a uniform shift cancels in rotary q.k"
        # W - 1 - col + 0.5 is vit_w's W - 1 - col shifted uniformly: not a candidate there
        out["vit_half_mirror"] = "identical to vit_w: a uniform shift cancels in rotary q.k"
    if config is not None and getattr(config.model, "vit_frames", False):
        out["vit_h"] = "exact no-op: the ViT sees one row (a frame) at a time"
    return out


def compute(run: LoadedRun, log=print) -> dict:
    """{"margins": [K, C, B], "swapped": [K, B] (the plain run, objects swapped),
    "relation": [B], "names"} over the questions of both relations, in the subject's
    batches of one shape (`common.question_batches`: drawn scenes are one; a dataset's
    photographs one per image size, whose scene versions are the plain image and its
    width and height flips only, so the counterfactuals that need a scene version a
    photograph has not (positions without facings, facings alone) are left out and
    named). Each batch runs `batch` at a time through one compiled call
    (`common.rows_per_call`; finished chunks kept and resumed: `common.table_store`),
    its counterfactuals one after another on a checkpoint (memory)."""
    first = model_outline(run.params)
    twins = ("swap",) + tuple(f"scene:{i}" for i in range(len(cfa.SCENES)))
    batches = question_batches(run, (0, 1), twins)
    names = cfa.names_for(batches[0].view, first, run.subject.per_block)
    n_blocks = batches[0].view.vit_blocks(first)
    if n_blocks and not run.subject.per_block:
        log(f"  the ViT mirrors per block ({2 * n_blocks} more conditions) left out: --per_block")
    scenes = set(batches[0].scenes)
    kept = tuple(n for n in names if cfa.scene_of(n) in scenes)
    if kept != names:
        log(f"  no scene version for {', '.join(n for n in names if n not in kept)} "
            "(photographs: plain, width and height flips only): left out")  # fmt: skip
    if run.subject.layers is not None:  # every counterfactual edits the inputs, no layer
        log(f"layers {list(run.subject.layers)}: not used by the counterfactual table")
    out = [_batch_margins(run, b, kept, log) for b in batches]
    return joined(out, ("margins", "swapped", "relation")) | {"names": kept}


def _batch_margins(run: LoadedRun, batch, names, log) -> dict:
    view, ex, first = batch.view, batch.examples, model_outline(run.params)
    cfs = cfa.build(view, first, ex.spans, names)  # the positions are static: one for all
    # the swapped question is its own length where a photograph's is reworded
    sw_cf = cfa.build(view, first, batch.twins["swap"].spans, ("plain",))
    stack = lambda *xs: np.stack(xs)  # noqa: E731
    rendered = [batch.twins[f"scene:{i}"].inputs for i in range(len(cfa.SCENES))]
    versions = jax.tree_util.tree_map(stack, *rendered)  # [versions, B, ...]
    swapped = batch.twins["swap"]
    n = len(ex.answer_B)
    one_at_a_time = run.subject.question_chunk
    log_estimate(run, view, ex.inputs, n * (len(names) + 1),
                 f"{len(names)} conditions x {n} questions + the swapped question", log)  # fmt: skip

    @jax.jit
    def chunk(params_K, versions, answer, other, sw_inputs, sw_answer, sw_other, ids, sw_ids):
        c, plain = cfs._replace(lm_ids=ids), sw_cf._replace(lm_ids=sw_ids)
        sw = jax.tree_util.tree_map(lambda x: x[None], sw_inputs)

        def one_model(p):
            m = cfa.margins(view, p, versions, answer, other, c, one_at_a_time)
            return {
                "margins": m,
                "swapped": cfa.margins(view, p, sw, sw_answer, sw_other, plain)[0],
            }

        return over_models(one_model, params_K)

    def args(rows):
        take_b = lambda tree, axis=0: jax.tree_util.tree_map(  # noqa: E731
            lambda x: np.take(np.asarray(x), rows, axis=axis), tree
        )
        # [C, B, 3, S]: left-padded rows have ids per row
        ids = [take_b(c.lm_ids, 1) if np.ndim(c.lm_ids) == 4 else c.lm_ids for c in (cfs, sw_cf)]
        return (run.params, take_b(versions, 1), take_b(ex.answer_B), take_b(ex.other_B),
                take_b(swapped.inputs), take_b(swapped.answer_B), take_b(swapped.other_B), *ids)  # fmt: skip

    batch_rows, plan = rows_per_call(
        run, lambda b: chunk.lower(*args(np.arange(b) % n)).compile(), n, log
    )
    store = table_store(run, "counterfactuals", names=names, **batch.key)
    out = run_chunks(lambda rows: jax.device_get(chunk(*args(rows))), n, batch_rows,
                     chunk_progress(log, batch_rows), store, plan, log)  # fmt: skip
    return out | {"relation": np.asarray(ex.spec.relation_B)}


def table_rows(res: dict, models) -> list[dict]:
    says = res["margins"] > 0  # [K, C, B]: chose the example's own answer word
    names = res["names"]
    rows = []
    for i in range(says.shape[0]):
        for r, rel in enumerate(RELATIONS):
            w = res["relation"] == r
            ref = says[i, names.index(MIRROR_OF[rel])][w]
            plain = says[i, 0][w]
            for c, name in enumerate(names):
                x = says[i, c][w]
                rows.append(
                    {
                        "model": models[i],
                        "counterfactual": name,
                        "relation": rel,
                        "agree_mirror": _share(x == ref),
                        "changed": _share(x != plain),
                        "n": int(w.sum()),
                    }
                )
    return rows


def _share(hits) -> float:
    """The share of True in `hits`; NaN for none (a relation the questions lack: n = 0)."""
    return float(hits.mean()) if hits.size else float("nan")


def error_rows(res: dict, models) -> list[dict]:
    plain = res["margins"][:, 0]
    bind = np.asarray(cfa.binding_failures(plain, res["swapped"]))
    rows = []
    for i in range(plain.shape[0]):
        for r, rel in enumerate(RELATIONS):
            err = (plain[i] <= 0) & (res["relation"] == r)
            n = int(err.sum())
            rows.append(
                {
                    "model": models[i],
                    "relation": rel,
                    "errors": n,
                    "binding_failures": int((bind[i] & err).sum()),
                    "share": float((bind[i] & err).sum() / n) if n else np.nan,
                }
            )
    return rows


def question_values(res: dict) -> dict:
    """One model's (a checkpoint's) per-question numbers, keyed as `model_values`: 1.0 /
    0.0 per question of the relation (agree with the mirrored image's answer, changed
    from the plain run's), and per plain-run error whether it is a binding failure."""
    says = res["margins"][0] > 0  # [C, B]
    names, plain = res["names"], res["margins"][0, 0]
    bind = np.asarray(cfa.binding_failures(plain, res["swapped"][0]))
    out = {}
    for r, rel in enumerate(RELATIONS):
        w = res["relation"] == r
        ref = says[names.index(MIRROR_OF[rel])][w]
        for c, name in enumerate(names):
            x = says[c][w]
            out[name, rel] = {"agree_mirror": (x == ref) * 1.0, "changed": (x != says[0][w]) * 1.0}
        err = (plain <= 0) & w
        out["binding", rel] = {"share": bind[err] * 1.0, "errors": int(err.sum())}
    return out


def model_values(rows: list[dict], errors: list[dict]) -> dict:
    """The table's per-model numbers: {(counterfactual, relation): {"agree_mirror",
    "changed": [K]}, ("binding", relation): {"share": [K], "errors": over the models}}."""
    out = {}
    for x in rows:
        cell = out.setdefault((x["counterfactual"], x["relation"]), {})
        for k in ("agree_mirror", "changed"):
            cell.setdefault(k, []).append(x[k])
    for rel in RELATIONS:
        sel = [e for e in errors if e["relation"] == rel]
        share, n = [e["share"] for e in sel], sum(e["errors"] for e in sel)
        out["binding", rel] = {"share": share, "errors": n}
    return out


def summarise(values: dict, names, log, note=None, per_question: bool = False) -> dict:
    """summary.json's cells (mean, ci_low, ci_high, n) and the printed table of `values`
    (`model_values`: the 95% interval over models; `question_values` with `per_question`:
    one checkpoint's seeded bootstrap interval over questions, n the questions)."""
    ci, cell, width = (question_ci, fmt_question_ci, 34) if per_question else (mean_ci, fmt_ci, 31)
    over = "bootstrap over questions" if per_question else "over models"
    log("share of answers equal to the mirrored image's (agree) and different from the "
        f"plain run's (changed), 95% CI {over}:")  # fmt: skip
    log(f"{'counterfactual':>20} " + " ".join(f"{r + ' agree':>{width}} {r + ' changed':>{width}}" for r in RELATIONS))  # fmt: skip
    out = {}
    for name in names:
        cells = []
        for rel in RELATIONS:
            v = values[name, rel]
            out[f"{name}/{rel}"] = {k: ci(v[k], 0.0, 1.0) for k in ("agree_mirror", "changed")}
            cells += [cell(v[k], 0.0, 1.0) for k in ("agree_mirror", "changed")]
        beside = f"  ({note[name.split('@')[0]]})" if name.split("@")[0] in (note or {}) else ""
        log(f"{name:>20} " + " ".join(f"{c:>{width}}" for c in cells) + beside)
    log("\nbinding failures among the plain run's errors (same word for X-Y and Y-X):")
    for rel in RELATIONS:
        v = values["binding", rel]
        out[f"binding/{rel}"] = {"share": ci(v["share"], 0.0, 1.0), "errors": v["errors"]}
        where = "" if per_question else " over the models"
        log(f"  {rel:>10}: {cell(v['share'], 0.0, 1.0)} ({v['errors']} errors{where})")
    return out | {"intervals": f"95% {over}"}


def plot(rows: list[dict], names, path: str, k: int) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    fig, axes = plt.subplots(1, 2, figsize=(9, 5.5))
    for ax, key in zip(axes, ("agree_mirror", "changed")):
        m = np.array(
            [
                [
                    np.mean(
                        [x[key] for x in rows if (x["counterfactual"], x["relation"]) == (n, r)]
                    )  # fmt: skip
                    for r in RELATIONS
                ]
                for n in names
            ]
        )
        ax.imshow(m, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        for a in range(m.shape[0]):
            for b in range(m.shape[1]):
                ax.text(b, a, f"{m[a, b]:.2f}", ha="center", va="center", fontsize=7, color="w" if m[a, b] < 0.6 else "k")  # fmt: skip
        ax.set_xticks(range(len(RELATIONS)), ["left/right", "above/below"])
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{key} (mean of {k} models)", fontsize=9)
    return plots.save(fig, path)


def _tables(res: dict, run: LoadedRun) -> dict:
    return {"table": table_rows(res, run.models), "errors": error_rows(res, run.models)}


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    ids = getattr(getattr(run.config, "model", None), "lm_pos_ids", "the family's")
    words = EXAMPLE_WORDS.get(run.examples, "pair questions")
    log(f"{run.k} models; {words}; lm_pos_ids {ids!r}")
    note = notes(view_of(run), model_outline(run.params), run.config)
    # a checkpoint is one model: an interval over models has n = 1 (NaN), so its cells
    # carry the bootstrap over its questions instead
    one = run.subject.over_questions
    if one:
        log(f"protocol: {protocol_of(run)}")
    values = question_values(res) if one else model_values(tables["table"], tables["errors"])
    summary = summarise(values, res["names"], log, note, per_question=one)
    summary |= {"notes": note} if note else {}
    summary |= {"protocol": protocol_of(run)} if one else {}
    return summary | {"excluded": list(run.excluded)}


REPORT = Report(
    folder="counterfactuals",
    refusal=counterfactuals_refusal,
    compute=compute,
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: plot(tables["table"], res["names"], path, run.k),
    figure="counterfactuals.png",
    examples=EXAMPLES,
    per_model=("margins", "swapped"),
    photos=True,
)
