"""Paper 004's counterfactual table on a results folder of VLMs.

On the questions of both relations (the seen-pair questions first and the unseen-pair ones beside them, each summarised
over the generalising models and then the others (`common.analyse`)), every model answers every example
under every counterfactual of `analysis.counterfactuals` (with a rope2d ViT, also the
ViT mirrors in one block at a time: always for a results folder, with `--per_block`
for a checkpoint) in one compiled call. Per
model, relation and counterfactual:

* agree_mirror: the share of answers equal to the model's own answer on the mirrored
  image (`analysis.counterfactuals.MIRROR_OF`: width mirror for left/right, height
  mirror for above/below and on/under): the paper's "reproduces the flipped-image
  answer" (with two options, also the flip rate when the mirror flips the answer);
  NaN (empty) for front/behind, which no image mirror swaps;
* changed: the share of answers that differ from the plain run's (front/behind's
  only number);
* among the plain run's errors, binding failures: the same relation word whichever
  object is asked about.

A dataset's photographs add rows for its relations no drawn scene has (What'sUp's
on_under, front_behind: `batches.PHOTO_RELATIONS`) after the two spatial ones; where
the view's tokenizer cannot tell their answer words apart, their questions are left
out (n = 0) and relations.csv says why. On photographs, paper 004's "content and token
order flipped, position codes not" is the flipped photograph with the ViT's codes
mirrored back (`cfa.PHOTO_CHANGES`): facing_order_w (on a drawn scene, facings flipped
and order_w: the same condition) and facing_order_h (on a drawn scene it is order_h).

On photographs, paper 004's post-hoc rows (`posthoc.csv`) read `cfa.RANDOM_ORDERS`, four
seeded random orders of the image tokens (rows in the table too), with the logits of
the relation words (left / right and the dataset's own: What'sUp's item captions) at
the answer: (a) of the answers a random order changed, the share on the mirror word
(chance 1 / (words - 1)); (b) the share changed where the order reads X's box cell and
Y's the other way round from the plain order vs the same way, and the difference
(boxes: COCO-Spatial, CV-Bench's `bbox`, a manifest's); (c) "back to the original
answer" (the paper: computed as a return to the original answer, What'sUp's contrast
between support relations and left / right is clear only in InternVL3-2B). Read here
as: per relation, of the questions whose answer its image mirror changed (image_w for
left / right, image_h for above / below and on / under; front / behind has none:
n = 0), the share whose answer under the same axis's content-and-order-flipped
condition (facing_order_w / facing_order_h: the flipped photograph, the ViT's codes
mirrored back) equals the plain photograph's again (chance 1/2, two answer words); and
each relation's share minus left / right's (`back_minus_left_right`). Where the codes
carry a relation the answer comes back; where content and token order do, it stays
flipped. Conditioning on the mirror's change is the reading of "back": over all
questions the share would be table.csv's 1 - changed of facing_order_*. Each row's
interval resamples questions (`cfa.pooled_ci`); n counts the questions (the orders'
answers for (a), (b)); nothing counted prints "empty (n = 0)" and writes NaN.

Writes into `RUN/counterfactuals/` (every row also names its `examples` and `model_group`):
  table.csv     model, counterfactual, relation, agree_mirror, changed, n
  errors.csv    model, relation, errors, binding_failures, share
  relations.csv model, relation, mirror (the reference's counterfactual, empty: none),
                reference (in words), n, left_out (why its questions were not asked)
  posthoc.csv   (photographs) model, relation, row (mirror_landing, flips_reversed,
                flips_kept, reversed_minus_kept, back_to_original, back_minus_left_right
                (not for left / right)), share, ci_low, ci_high, n, chance
  summary.json  means with 95% intervals (mean, ci_low, ci_high, n): over models for a
                results folder, a checkpoint's (one model) bootstrapped over its
                questions (n: the questions); figure counterfactuals.png
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import counterfactuals as cfa
from jaxmech.chunks import run_chunks
from jaxmech.data.spec import RELATIONS
from jaxmech.families.vlm_view import model_outline, over_models
from jaxmech.memory import remembered
from jaxmech.reports.common import (
    EXAMPLE_WORDS,
    EXAMPLES,
    LoadedRun,
    Report,
    chunk_progress,
    declared,
    fmt_ci,
    fmt_interval,
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
from jaxmech.reports.questions import PHOTO_RELATIONS, photo_relations
from jaxmech.reports.tables import Measure
from jaxmech.stats import mean_ci

counterfactuals_refusal = declared(
    "counterfactuals"
)  # why the report does not apply (None: it does)
MIRROR_OF = cfa.MIRROR_OF


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
    "relation": [B], "names", "left_out": {relation: why}, "words": None, or on
    photographs [K, C, W, B] the relation words' logits with "pair" [B] (each
    question's pair among them, -1: none) and "reversed" [R, B] (`cfa.order_reversed`
    of the random orders)} over the questions of both
    spatial relations and of a dataset's relations no drawn scene has whose answer
    words the view reads (`questions.photo_relations`; the others named in
    "left_out"), in the subject's batches of one shape (`common.question_batches`:
    drawn scenes are one; a dataset's photographs one per image size, whose scene
    versions are the plain image and its width and height flips only, so the
    counterfactuals that need a scene version a photograph has not (positions without
    facings, facings alone) are left out and named). Each batch runs `batch` at a time through one compiled call
    (`common.rows_per_call`; finished chunks kept and resumed: `common.table_store`),
    its counterfactuals one after another on a checkpoint (memory)."""
    first = model_outline(run.params)
    twins = ("swap",) + tuple(f"scene:{i}" for i in range(len(cfa.SCENES)))
    photo, unread = photo_relations(run)
    for rel, why in unread.items():
        log(f"  {rel}: its questions left out ({why})")
    batches = question_batches(run, (0, 1) + photo, twins)
    scenes = set(batches[0].scenes)
    # no facing-flipped version: photographs, whose content flips with the image
    pictures = cfa.SCENES.index((None, True)) not in scenes
    names = cfa.names_for(batches[0].view, first, run.subject.per_block, pictures)
    n_blocks = batches[0].view.vit_blocks(first)
    if n_blocks and not run.subject.per_block:
        log(f"  the ViT mirrors per block ({2 * n_blocks} more conditions) left out: --per_block")
    if pictures:
        log("  facing_order_w, facing_order_h: the flipped photograph with the ViT's codes "
            "mirrored back (content and token order flipped, position codes not)")  # fmt: skip
    kept = tuple(n for n in names if cfa.scene_of(n, pictures) in scenes)
    if kept != names:
        log(f"  no scene version for {', '.join(n for n in names if n not in kept)} "
            "(photographs: plain, width and height flips only): left out")  # fmt: skip
    if run.subject.layers is not None:  # every counterfactual edits the inputs, no layer
        log(f"layers {list(run.subject.layers)}: not used by the counterfactual table")
    # the post-hoc rows' relation words: left / right and the dataset's own relations
    # (What'sUp's item captions: left, right, on, under / front, behind), in pairs
    word_rows = (0,) + photo if pictures else None
    out = [_batch_margins(run, b, kept, log, word_rows) for b in batches]
    per_question = ("margins", "swapped", "relation") + (POSTHOC_KEYS if pictures else ())
    res = joined(out, per_question) | {"names": kept, "left_out": unread}
    return {"words": None} | res  # None: drawn scenes, no post-hoc rows


POSTHOC_KEYS = ("words", "reversed", "pair")  # a photograph's per-question post-hoc reads


def _batch_margins(run: LoadedRun, batch, names, log, word_rows=None) -> dict:
    view, ex, first = batch.view, batch.examples, model_outline(run.params)
    # the positions are static: one for all
    cfs = cfa.build(view, first, ex.spans, names, word_rows is not None)
    words = None if word_rows is None else np.asarray(view.answer_words)[list(word_rows)].ravel()
    # the swapped question is its own length where a photograph's is reworded
    sw_cf = cfa.build(view, first, batch.twins["swap"].spans, ("plain",))
    stack = lambda *xs: np.stack(xs)  # noqa: E731
    rendered = [batch.twins[f"scene:{i}"].inputs for i in range(len(cfa.SCENES))]
    versions = jax.tree_util.tree_map(stack, *rendered)  # [versions, B, ...]
    swapped = batch.twins["swap"]
    n = len(ex.answer_B)
    one_at_a_time = run.subject.question_chunk
    secs = log_estimate(run, view, ex.inputs, n * (len(names) + 1),
                        f"{len(names)} conditions x {n} questions + the swapped question",
                        log)  # fmt: skip

    @jax.jit
    def chunk(params_K, versions, answer, other, sw_inputs, sw_answer, sw_other, ids, sw_ids):
        c, plain = cfs._replace(lm_ids=ids), sw_cf._replace(lm_ids=sw_ids)
        sw = jax.tree_util.tree_map(lambda x: x[None], sw_inputs)

        def one_model(p):
            m = cfa.margins(view, p, versions, answer, other, c, one_at_a_time, words)
            # a photograph's: its relation words' logits too, [C, W, B] (rows last)
            read = {} if words is None else {"words": jnp.swapaxes(m[1], 1, 2)}
            return read | {
                "margins": m if words is None else m[0],
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

    # the plan's sizing compile is kept: where its rows are the chunk's, the table's own
    at = remembered(lambda b: chunk.lower(*args(np.arange(b) % n)).compile())
    batch_rows, plan = rows_per_call(run, at, n, log, secs)
    words_key = {} if words is None else {"words": [int(w) for w in words]}
    store = table_store(run, "counterfactuals", names=names, **batch.key, **words_key)

    def one_chunk(rows):
        done = at.program(len(rows))
        return jax.device_get((chunk if done is None else done)(*args(rows)))

    out = run_chunks(one_chunk, n, batch_rows, chunk_progress(log, batch_rows), store, plan,
                     log)  # fmt: skip
    out |= {"relation": np.asarray(ex.spec.relation_B)}
    return out if word_rows is None else out | _order_reads(ex, cfs, names, word_rows)


def _order_reads(ex, cfs, names, word_rows) -> dict:
    """A photograph batch's post-hoc reads beside its chunks: "pair" [B], each
    question's pair among the relation words `word_rows` (-1: none), and "reversed"
    [R, B] (`cfa.order_reversed` of the random orders on the questions' box cells)."""
    orders = np.asarray(cfs.order)[[names.index(x) for x in cfa.RANDOM_ORDERS]]
    rel = np.asarray(ex.spec.relation_B).tolist()
    pair = np.asarray([word_rows.index(r) if r in word_rows else -1 for r in rel])
    cells = np.asarray(ex.spec.cells_BxK)[:, :2]
    return {"reversed": cfa.order_reversed(ex.spans, cells, orders), "pair": pair}


def relations_of(res: dict) -> list[tuple[int, str]]:
    """(relation id, name) of the table's relations: the two spatial ones always (n = 0
    where the questions have none), then each photograph relation asked or left out
    (`compute`'s "left_out"), so a drawn run's table keeps its two."""
    asked = set(np.asarray(res["relation"]).tolist())
    left = res.get("left_out", {})
    extra = [(r, n) for r, n in PHOTO_RELATIONS.items() if r in asked or n in left]
    return list(enumerate(RELATIONS)) + extra


def _reference(says_CxB, names, rel: str, w):
    """[n] the answers of `rel`'s questions (mask `w`) on its mirror, or None: no mirror."""
    mirror = MIRROR_OF[rel]
    return None if mirror is None else says_CxB[names.index(mirror)][w]


def table_rows(res: dict, models) -> list[dict]:
    says = res["margins"] > 0  # [K, C, B]: chose the example's own answer word
    names = res["names"]
    rows = []
    for i in range(says.shape[0]):
        for r, rel in relations_of(res):
            w = res["relation"] == r
            ref = _reference(says[i], names, rel, w)
            plain = says[i, 0][w]
            for c, name in enumerate(names):
                x = says[i, c][w]
                rows.append(
                    {
                        "model": models[i],
                        "counterfactual": name,
                        "relation": rel,
                        "agree_mirror": float("nan") if ref is None else _share(x == ref),
                        "changed": _share(x != plain),
                        "n": int(w.sum()),
                    }
                )
    return rows


def _share(hits) -> float:
    """The share of True in `hits`; NaN for none (a relation the questions lack: n = 0)."""
    return float(hits.mean()) if hits.size else float("nan")


def relation_rows(res: dict, models) -> list[dict]:
    """relations.csv: per model and relation, its mirror (the counterfactual whose
    answers are the reference; empty: none swaps it), that in words, its questions and
    why they were left out (empty: asked)."""
    left = res.get("left_out", {})
    return [{"model": m, "relation": rel, "mirror": MIRROR_OF[rel] or "",
             "reference": cfa.MIRROR_WORDS[MIRROR_OF[rel]],
             "n": int((res["relation"] == r).sum()), "left_out": left.get(rel, "")}
            for m in models for r, rel in relations_of(res)]  # fmt: skip


def posthoc_rows(res: dict, models) -> list[dict]:
    """posthoc.csv (a photograph's table; paper 004's post-hoc rows) per model, relation
    and row: `mirror_landing`, of the answers a random order of the image tokens changed
    (read over the relation words, `compute`), the share on the mirror word of the plain
    answer (chance 1 / (words - 1)); `flips_reversed` / `flips_kept`, the share of
    answers a random order changed where it reads X's box cell after Y's the other way
    round from the plain order / the same way; `reversed_minus_kept`; `back_to_original`
    and `back_minus_left_right` (`_returns`, module docstring's (c)). Each with a 95%
    interval resampling questions (`cfa.pooled_ci`) and n the answers it counts."""
    random = [res["names"].index(x) for x in cfa.RANDOM_ORDERS]
    rows = []
    for i, m in enumerate(models):
        for r, rel in relations_of(res):
            w = res["relation"] == r
            for row, ci, chance in _posthoc(res, i, w, random) + _returns(res, i, rel):
                rows.append({"model": m, "relation": rel, "row": row, "share": ci[0],
                             "ci_low": ci[1], "ci_high": ci[2], "n": ci[3], "chance": chance})  # fmt: skip
    return rows


def _back(res: dict, i: int, rel: str):
    """([B], [B]) `cfa.back_to_original` of model i over every question (0 outside
    `rel`'s, or where the photograph's table lacks its mirror or flipped condition)."""
    says, names = res["margins"][i] > 0, res["names"]
    zeros = np.zeros(says.shape[1], int)
    r = {name: k for k, name in relations_of(res)}.get(rel)
    mirror, back = MIRROR_OF[rel], cfa.RETURN_OF[rel]
    if r is None or mirror not in names or back not in names:
        return zeros, zeros
    w = res["relation"] == r
    mirrored, flipped = says[names.index(mirror)], says[names.index(back)]
    hits, counted = cfa.back_to_original(says[0], mirrored, flipped)
    return hits * w, counted * w


def _returns(res: dict, i: int, rel: str) -> list[tuple]:
    """Post-hoc (c) rows of model i's relation `rel` (`posthoc_rows`): `back_to_original`
    (chance 1/2: two answer words) and, beside left / right, the relation's share minus
    left / right's (`back_minus_left_right`, resampling the questions of both)."""
    hits, counted = _back(res, i, rel)
    chance = 0.5 if counted.any() else float("nan")
    rows = [("back_to_original", cfa.pooled_ci(hits, counted), chance)]
    if rel != "horizontal":
        rows.append(("back_minus_left_right",
                     cfa.pooled_ci(hits, counted, minus=_back(res, i, "horizontal")),
                     float("nan")))  # fmt: skip
    return rows


def _posthoc(res: dict, i: int, w, random) -> list[tuple]:
    """(row, (share, lo, hi, n), chance) of model i's questions `w` (`posthoc_rows`)."""
    n_words = res["words"].shape[2]
    changed, landed = cfa.mirror_landing(res["words"][i][..., w], res["pair"][w], random)
    if n_words <= 2:  # two words: every change lands on the mirror, nothing to measure
        changed = landed = np.zeros_like(changed)
    says = res["margins"][i][:, w] > 0
    flip, rev = says[random] != says[0], res["reversed"][:, w]  # [R, b]
    kept, reversed_ = (((flip & (rev == g)).sum(0), (rev == g).sum(0)) for g in (0, 1))
    # chance only where the relation's own pair is among the words read
    paired = n_words > 2 and (res["pair"][w] >= 0).any()
    chance = 1 / (n_words - 1) if paired else float("nan")
    nan = float("nan")
    return [("mirror_landing", cfa.pooled_ci(landed, changed), chance),
            ("flips_reversed", cfa.pooled_ci(*reversed_), nan),
            ("flips_kept", cfa.pooled_ci(*kept), nan),
            ("reversed_minus_kept", cfa.pooled_ci(*reversed_, minus=kept), nan)]  # fmt: skip


POSTHOC_WORDS = {
    "mirror_landing": "changed answers on the mirror word",
    "flips_reversed": "changed, objects' order reversed",
    "flips_kept": "changed, objects' order kept",
    "reversed_minus_kept": "reversed - kept",
    "back_to_original": "mirror-changed, back under content+order",
    "back_minus_left_right": "back to original - left/right's",
}


def _posthoc_summary(rows: list[dict], log, words: int | None = None) -> dict:
    """summary.json's "posthoc" {model: {relation: {row: (share, lo, hi, n), "chance",
    "back_chance"}}}, logged (`words`: how many relation words were read); {} for drawn
    scenes (no rows)."""
    if not rows:
        return {}
    log(f"\npost-hoc (paper 004), {len(cfa.RANDOM_ORDERS)} seeded random orders of the "
        "image tokens; 95% CI resampling questions:")  # fmt: skip
    if words == 2:  # a changed answer can only be the other word: nothing to measure
        log("  answers read over 2 relation words (no dataset relation beside left / right): "
            "the mirror-word row is empty")  # fmt: skip
    log("  the objects' order needs both boxes (COCO-Spatial, CV-Bench's bbox, a manifest's; "
        "not What'sUp)")  # fmt: skip
    log("  back to the original answer: of the answers the image mirror changed, the share "
        "facing_order_w / _h (content and order flipped, codes not) brings back to the plain one")  # fmt: skip
    out = {}
    for x in rows:
        cell = out.setdefault(str(x["model"]), {}).setdefault(x["relation"], {})
        ci = (x["share"], x["ci_low"], x["ci_high"], x["n"])
        cell[x["row"]] = ci
        if x["row"] in ("mirror_landing", "back_to_original"):
            cell["chance" if x["row"] == "mirror_landing" else "back_chance"] = x["chance"]
        chance = f" (chance {x['chance']:.3f})" if np.isfinite(x["chance"]) else ""
        log(f"  {x['relation']:>12} {POSTHOC_WORDS[x['row']]:>36}: {fmt_interval(ci)}{chance}")
    return {"posthoc": out}


def error_rows(res: dict, models) -> list[dict]:
    plain = res["margins"][:, 0]
    bind = np.asarray(cfa.binding_failures(plain, res["swapped"]))
    rows = []
    for i in range(plain.shape[0]):
        for r, rel in relations_of(res):
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
    for r, rel in relations_of(res):
        w = res["relation"] == r
        ref = _reference(says, names, rel, w)
        for c, name in enumerate(names):
            x = says[c][w]
            agree = np.full(x.shape, np.nan) if ref is None else (x == ref) * 1.0
            out[name, rel] = {"agree_mirror": agree, "changed": (x != says[0][w]) * 1.0}
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
    for rel in dict.fromkeys(e["relation"] for e in errors):  # the table's, in its order
        sel = [e for e in errors if e["relation"] == rel]
        share, n = [e["share"] for e in sel], sum(e["errors"] for e in sel)
        out["binding", rel] = {"share": share, "errors": n}
    return out


def summarise(values: dict, names, log, note=None, per_question: bool = False,
              relations=RELATIONS) -> dict:  # fmt: skip
    """summary.json's cells (mean, ci_low, ci_high, n) and the printed table of `values`
    (`model_values`: the 95% interval over models; `question_values` with `per_question`:
    one checkpoint's seeded bootstrap interval over questions, n the questions), one
    column pair per relation of `relations` (names; `relations_of`)."""
    ci, cell, width = (question_ci, fmt_question_ci, 34) if per_question else (mean_ci, fmt_ci, 31)
    over = "bootstrap over questions" if per_question else "over models"
    log("share of answers equal to the mirrored image's (agree) and different from the "
        f"plain run's (changed), 95% CI {over}:")  # fmt: skip
    log(f"{'counterfactual':>20} " + " ".join(f"{r + ' agree':>{width}} {r + ' changed':>{width}}" for r in relations))  # fmt: skip
    out = {}
    for name in names:
        cells = []
        for rel in relations:
            v = values[name, rel]
            out[f"{name}/{rel}"] = {k: ci(v[k], 0.0, 1.0) for k in ("agree_mirror", "changed")}
            # no mirror swaps it: say so, not "n = 0", where its questions were asked
            agree = "no mirror" if MIRROR_OF[rel] is None else cell(v["agree_mirror"], 0.0, 1.0)
            cells += [agree, cell(v["changed"], 0.0, 1.0)]
        beside = f"  ({note[name.split('@')[0]]})" if name.split("@")[0] in (note or {}) else ""
        log(f"{name:>20} " + " ".join(f"{c:>{width}}" for c in cells) + beside)
    log("\nbinding failures among the plain run's errors (same word for X-Y and Y-X):")
    for rel in relations:
        v = values["binding", rel]
        out[f"binding/{rel}"] = {"share": ci(v["share"], 0.0, 1.0), "errors": v["errors"]}
        where = "" if per_question else " over the models"
        log(f"  {rel:>10}: {cell(v['share'], 0.0, 1.0)} ({v['errors']} errors{where})")
    return out | {"intervals": f"95% {over}"}


def plot(rows: list[dict], names, path: str, k: int) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    relations = list(dict.fromkeys(x["relation"] for x in rows))  # the table's, in order
    fig, axes = plt.subplots(1, 2, figsize=(9 + len(relations) - 2, 5.5))
    for ax, key in zip(axes, ("agree_mirror", "changed")):
        m = np.array(
            [
                [
                    np.mean(
                        [x[key] for x in rows if (x["counterfactual"], x["relation"]) == (n, r)]
                    )  # fmt: skip
                    for r in relations
                ]
                for n in names
            ]
        )
        ax.imshow(m, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        for a in range(m.shape[0]):
            for b in range(m.shape[1]):
                ax.text(b, a, f"{m[a, b]:.2f}", ha="center", va="center", fontsize=7, color="w" if m[a, b] < 0.6 else "k")  # fmt: skip
        ax.set_xticks(range(len(relations)), [AXIS_WORDS.get(r, r) for r in relations])
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{key} (mean of {k} models)", fontsize=9)
    return plots.save(fig, path)


AXIS_WORDS = {"horizontal": "left/right", "vertical": "above/below", "on_under": "on/under",
              "front_behind": "front/behind"}  # fmt: skip


def _tables(res: dict, run: LoadedRun) -> dict:
    own = {"table": table_rows(res, run.models), "errors": error_rows(res, run.models),
           "relations": relation_rows(res, run.models)}  # fmt: skip
    # photographs only: the post-hoc rows need the relation words and the random orders
    return own if res.get("words") is None else own | {"posthoc": posthoc_rows(res, run.models)}


def _relation_summary(res: dict, log) -> dict:
    """{relation: its mirror, reference, questions and why left out}, logged where a
    dataset adds relations to the two spatial ones."""
    out = {rel: {"mirror": MIRROR_OF[rel], "reference": cfa.MIRROR_WORDS[MIRROR_OF[rel]],
                 "n": int((res["relation"] == r).sum()), "left_out": res.get("left_out", {}).get(rel)}
           for r, rel in relations_of(res)}  # fmt: skip
    if len(out) > len(RELATIONS):
        log("relations and the answers each is compared with:")
        for rel, x in out.items():
            gone = f"; left out: {x['left_out']}" if x["left_out"] else ""
            log(f"  {rel:>12} (n = {x['n']}): {x['reference']}{gone}")
    return out


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
    relations = _relation_summary(res, log)
    summary = summarise(values, res["names"], log, note, per_question=one,
                        relations=tuple(relations))  # fmt: skip
    words = None if res.get("words") is None else res["words"].shape[2]
    summary |= {"relations": relations} | _posthoc_summary(tables.get("posthoc", []), log, words)
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
    per_model=("margins", "swapped", "words"),
    photos=True,
    compare=(
        Measure(
            "changed share",
            "table",
            "changed",
            (("counterfactual", ("vit_w", "vit_h", "order_w", "order_h")),),
            ("counterfactual", "relation"),
        ),
    ),
)
