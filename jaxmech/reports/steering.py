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
  of the TOP_LAYERS best sites, the controls at the same sites; per relation and both
  pooled ("both": their `fig2.ipynb` rate, over every row of the file).

Under `--protocol=authors` on a checkpoint: every question is steered, boxes or not
(their corner steering reads no box; the box-based tables above keep the questions
with both boxes, n = 0 where none has them), and without `--layers` the sites are the
authors' window for the model (`AUTHORS_WINDOWS`, `adversarial_steering.sh`'s CONFIG),
else every site, said in the log. Their population is every row of
`coco_qa_two_obj.json`, both relations: `--questions_from=coco_spatial_all`. The
answer is their reply test (a "left" to an above / below question steers along x) on a
greedy reply of `--max_new_tokens` tokens (default theirs, 250) where the view offers
`generate` (`Replies`: the ID steering's flip is a change of their verdict, correct /
wrong / nonsense, `compute_coco_stats.py`; the noise / orthogonal controls stay sign
changes of the margin), else on the top next token (`vocabulary_directions`); the
summary's `answer_read` says which. With generated replies each word's steering norm is
theirs (`reply_norms`: its control states over every occurrence of its token in the
prompt and the reply); with the top next token, the prompt state's.

Writes into `RUN/steering/` (every row also names its `examples` and `model_group`):
  flips.csv     model, site, relation, kind, alpha, flip_rate, n_right, rel_norm
  curves.csv    model, site, relation, target_row, target_col, belief
  curves_paper.csv  the same at the paper's alpha (PAPER_CURVE_ALPHA = 5)
  authors.csv   model, site, relation (horizontal, vertical, both), kind, flip_rate, n
                (the authors' protocol, every site)
  summary.json  means over models with 95% intervals; figures steering.png, steering_paper.png
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from jaxmech.analysis import steering as st
from jaxmech.analysis.steering import (
    ALPHAS,
    CURVE_ALPHA,
    REF_ALPHA,
    adversarial_targets,
    flip_rates,
)
from jaxmech.data.spec import RELATIONS
from jaxmech.families.registry import FAMILIES
from jaxmech.families.vlm_view import with_reply
from jaxmech.models.generate import reply_text, sequences, text_verdict
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
    question_ci,
    steered_sites,
    steering_examples,
    view_of,
)
from jaxmech.reports.questions import first_answer, take_examples
from jaxmech.reports.tables import Measure
from jaxmech.stats import correlation_ci, mean_ci


def steering_refusal(config, path: str) -> str | None:
    """Why this report does not apply to a run (None when it does)."""
    return declared("steering")(config, path) or needs_depth(config, path)


# where each per-question result keeps its questions (`batches.joined`)
QUESTION_AXES = {"flips": -1, "curves": -2, "curves_paper": -2, "authors": -1, "relation": -1,
                 "boxed": -1}  # fmt: skip
MAX_NEW_TOKENS = 250  # the authors' reply length (adversarial_steering.py's num_generate)
BOX_TABLES = ("flips", "curves", "curves_paper", "relation")  # need X's cell: boxed questions

# The authors' steered layers per model (`adversarial_steering.sh` CONFIG, `seq START
# END`: both ends; layer L the residual after L blocks), keyed by what identifies a
# checkpoint whatever its folder is called: its config.json `model_type` and its LM's
# depth and width -> (their name, the Hub checkpoint, (first, last) layer). Each family
# declares its own models' windows (`CheckpointFamily.authors_windows`); llava-cot has
# none there, gemma-12b's depth and width are not checked here.
AUTHORS_WINDOWS = {
    key: window for family in FAMILIES.values()
    for key, window in getattr(family, "authors_windows", ())
}  # fmt: skip


def checkpoint_identity(folder: str) -> tuple[str, int, int]:
    """(config.json's `model_type`, the LM's blocks, its width) of checkpoint `folder`,
    as its family reads them (defaults a config leaves out included, e.g. LLaVA-1.5-7B's
    Llama text config); the weights are not read."""
    from jaxmech.families.registry import read_checkpoint_config

    _, config = read_checkpoint_config(folder)
    with open(os.path.join(folder, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    return model_type, int(config.lm_layers), int(config.lm_width)


def authors_sites(sites, identity, log=print) -> list[int]:
    """The sites the authors' protocol steers when `--layers` is not given: `sites`
    within the authors' window of the model `identity` (`checkpoint_identity`), or all
    of `sites` where their table has no such model, each said in the log."""
    found = AUTHORS_WINDOWS.get(tuple(identity))
    model_type, blocks, width = identity
    if found is None:
        log(f"the authors' steering window: none for model_type {model_type!r} with "
            f"{blocks} LM blocks of width {width} (not a model of their "
            "adversarial_steering.sh); every layer, as jaxmech (--layers chooses)")  # fmt: skip
        return list(sites)
    name, hub, (lo, hi) = found
    log(f"the authors' steering window for {name} ({hub}): layers {lo}:{hi} "
        "(adversarial_steering.sh; --layers overrides)")  # fmt: skip
    return [y for y in sites if lo <= y <= hi]


def steering_sites(run: LoadedRun, log=print) -> list[int]:
    """The LM sites steered (`common.steered_sites`); under the authors' protocol on a
    checkpoint without `--layers`, the authors' window for it (`authors_sites`)."""
    sites = steered_sites(run)
    subject = run.subject
    if protocol_of(run) != "authors" or subject.layers is not None:
        return sites
    return authors_sites(sites, checkpoint_identity(subject.key["checkpoint"]), log)


def steered_questions(run: LoadedRun, batch, protocol: str):
    """(Examples, source cells, target cells, boxed [B] bool) of a batch
    (`common.steering_examples`). jaxmech's protocol: the questions whose X and Y cells
    are known (a photograph's: both boxes), all boxed. The authors': every question
    (their corner steering reads no box), X's cell and its target 0 where one is not
    known, `boxed` saying which the box-based tables may read (a drawn scene's: all)."""
    if batch is None or protocol != "authors":
        ex, source, target = steering_examples(run, batch)
        return ex, source, target, np.ones(len(ex.answer_B), bool)
    ex, grid = batch.examples, batch.view.grid
    cells = np.asarray(ex.spec.cells_BxK)
    named = np.asarray(ex.spec.labels_BxK)[:, :2] > 0  # as `steering_examples` reads them
    boxed = ((cells[:, :2] >= 0) | ~named).all(1)
    known = np.where(boxed[:, None], cells, 0)
    target = adversarial_targets(known, np.asarray(ex.spec.relation_B), grid.h, grid.w,
                                 first_answer(view_of(run), ex))  # fmt: skip
    return ex, known[:, 0], np.where(boxed, target, 0).astype(np.int32), boxed


def compute(run: LoadedRun, seed: int = 0, log=print,
            max_new_tokens: int = MAX_NEW_TOKENS) -> dict:  # fmt: skip
    """`analysis.steering.steer_models` on the relation questions of `run.examples`,
    with the universal IDs of the training-pair labels (`common.id_labels`), at every
    site y >= 1 (a checkpoint's: its `--layers` from 1 on; under the authors' protocol
    without them, their window: `steering_sites`), and the sites; a dataset's
    photographs per image size (`common.question_batches`), those whose X and Y boxes
    are both known (their centres' cells: where X is steered from, and which side Y is
    on; the authors' protocol: every one, `steered_questions`), the IDs from drawn
    probes as the paper's (the same in every batch). Under the authors' protocol where
    the view offers `generate` (one checkpoint), the answer is a greedy reply of
    `max_new_tokens` tokens judged as theirs (`Replies`), else the top next token."""
    check_max_new_tokens(max_new_tokens)
    sites, protocol, out = steering_sites(run, log), protocol_of(run), []
    if not sites:
        raise ValueError("steering: no LM site to steer (n = 0): --layers chooses them")
    source_name = getattr(run.subject, "source", None)
    if protocol == "authors" and isinstance(source_name, dict):
        if source_name.get("source") == "coco_spatial":
            log("  the authors' steering asks every row of coco_qa_two_obj.json, left / right "
                "and above / below (adversarial_steering.sh): --questions_from=coco_spatial_all; "
                "here coco_spatial's left / right sample")  # fmt: skip
    generated = generates(run)
    directions = vocabulary_directions(run) if protocol == "authors" and not generated else None
    for batch in question_batches(run, (0, 1)):
        ex, source, target, boxed = steered_questions(run, batch, protocol)
        if not boxed.all():
            log(f"  {int((~boxed).sum())} question(s) without both boxes: steered as the "
                "authors (corner IDs), left out of the box-based tables")  # fmt: skip
        if len(ex.answer_B) < len(batch.index):
            log(f"  {len(batch.index) - len(ex.answer_B)} question(s) without both boxes: "
                "left out (no cell to steer from)")  # fmt: skip
        if not len(ex.answer_B):
            continue
        what = f"steering ({len(ex.answer_B)} questions, {len(sites)} sites)"
        view = batch.view if batch is not None else view_of(run)
        replies = Replies(run, view, ex, max_new_tokens) if generated else None
        res = st.steer_models(
            view, run.params, ex, source, target, seed, id_labels(run), sites,
            probe_rows(run),
            lambda fn, args: compiled_call(fn, args, what, estimate=run.subject.estimates_time),
            against="given" if generated else "reply" if protocol == "authors" else "truth",
            factorial=protocol == "authors", directions=directions,
            corners=replies.corners if generated else None)  # fmt: skip
        if generated:
            res["authors"] |= replies.steered(sites, res["delta"][0], log)
        out.append(res | {"boxed": boxed})
    if not out:
        raise ValueError("steering: no question has both objects' boxes (n = 0); "
                         "COCO-Spatial and a manifest with boxes have them, and "
                         "--protocol=authors steers without them")  # fmt: skip
    read = (f"a greedy reply of {max_new_tokens} tokens, their verdict (correct / wrong / "
            "nonsense); a flip: the verdict changed" if generated else
            "the top next token" + (", through their reply test" if protocol == "authors" else ""))  # fmt: skip
    return joined(out, QUESTION_AXES) | {"sites": sites, "protocol": protocol, "answer_read": read}


def check_max_new_tokens(n) -> None:
    """Refuses (ValueError naming --max_new_tokens) anything but an int >= 1."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"--max_new_tokens = {n!r}: expected an int >= 1 (the authors' "
                         f"replies: {MAX_NEW_TOKENS})")  # fmt: skip


def generates(run: LoadedRun) -> bool:
    """Whether the authors' protocol reads generated replies here: one checkpoint whose
    view offers `generate` (else the top next token, `vocabulary_directions`)."""
    return protocol_of(run) == "authors" and run.k == 1 and view_of(run).generate is not None


def checkpoint_tokenizer(run: LoadedRun):
    family, folder = run.family, run.path
    return family.tokenizer(family.processor(folder, family.read_config(folder)))


class Replies:
    """The authors' steering judged by generated replies (`adversarial_steering.py` +
    `compute_coco_stats.py`) on one checkpoint: the control reply of each question
    (greedy, `max_new_tokens`), the direction their response test reads in it
    (`corners`: `analysis.steering.direction_corners`), and `steered`: the replies
    with the ID steering at each site, each word moved by `st.AUTHORS_SCALE` x its norm
    over prompt and control reply (`reply_norms`), a flip where the verdict
    (`judge_reply`: correct / wrong / nonsense) differs from the control's. Generated
    `probe_rows` questions at a time."""

    def __init__(self, run: LoadedRun, view, ex, max_new_tokens: int):
        self.view, self.n = view, max_new_tokens
        # the run's params stacked over its one model [1, ...], model 0 read inside each
        # compiled call (`generate`, `reply_states`: model=0): an eager `x[0]` would
        # copy every weight (4.1 GB at Qwen2-VL-2B)
        self.params_K = run.params
        self.tok = checkpoint_tokenizer(run)
        B, size = len(ex.answer_B), probe_rows(run) or len(ex.answer_B)
        self.chunks = [take_examples(ex, np.arange(i, min(i + size, B))) for i in range(0, B, size)]  # fmt: skip
        first = first_answer(view, ex)
        rel = np.asarray(ex.spec.relation_B)
        pairs = [st.REPLY_WORDS[2 * int(r) : 2 * int(r) + 2] for r in rel]
        self.words = [p if f else p[::-1] for p, f in zip(pairs, first)]  # (correct, wrong)
        texts, self.generations = [], []
        for c in self.chunks:
            g = view.generate(self.params_K, c.inputs, max_new_tokens=self.n, model=0)
            texts += [reply_text(self.tok, q) for q in self.sequences(c, g)]
            self.generations.append(g)
        self.texts, self.control = texts, self.verdicts(texts)
        self.corners = st.direction_corners(st.token_directions(texts), *view.grid)

    @staticmethod
    def sequences(ex, generation) -> list:
        import types

        return sequences(types.SimpleNamespace(inputs=ex.inputs), generation)

    def verdicts(self, texts) -> np.ndarray:
        """[B] their verdict on each reply text (`compute_coco_stats.py` 44-58)."""
        return np.asarray([text_verdict(t, c, w) for t, (c, w) in zip(texts, self.words)])

    def steered(self, sites, delta_YxLxD, log=print) -> dict:
        """{"reply_flip": [1, Y', B] bool, "verdict": [1, 1 + Y', B] str (the control's,
        then each site's)} of the replies steered at each site."""
        src, dst, _ = (np.asarray(x) for x in self.corners)
        rows = np.cumsum([0] + [len(c.answer_B) for c in self.chunks])
        texts = {y: [] for y in sites}
        states = reply_states(self.view, sites, model=0)
        for c, control, lo, hi in zip(self.chunks, self.generations, rows[:-1], rows[1:]):
            norms = reply_norms(states, self.params_K, c, control)
            for y in sites:  # their norms given: no clean forward of the prompt needed
                g = st.steered_replies(self.view, self.params_K, c, y, delta_YxLxD[y],
                                       src[lo:hi], dst[lo:hi], self.n, None, norms=norms[y],
                                       model=0)  # fmt: skip
                texts[y] += [reply_text(self.tok, q) for q in self.sequences(c, g)]
        verdicts = [self.control] + [self.verdicts(texts[y]) for y in sites]
        for y, v in zip(sites, verdicts[1:]):
            log(f"  layer {y}: {int((v != self.control).sum())} of {len(v)} steered replies "
                "changed verdict")  # fmt: skip
        v = np.stack(verdicts)
        return {"reply_flip": (v[1:] != v[:1])[None], "verdict": v[None]}


def reply_states(view, sites, model: int | None = None):
    """A compiled (params, inputs, fed_BxN) -> {y: [B, S + N, D] `lm/resid_pre.{y}`} for
    each site y: the residual of the prompts `inputs` with the tokens `fed_BxN`
    appended (`vlm_view.with_reply`), rows causal, as a cached generation of them
    computed it. `model`: an index into params stacked over models, read inside the
    compiled call (no eager copy of the weights). One program per shape: the report's
    chunks share it."""
    import jax

    # these sites only: every block's states over a 250-token reply are GBs at 7B
    names = tuple(f"lm/resid_pre.{y}" for y in sites)

    def states(params, inputs, fed_BxN):
        params = params if model is None else jax.tree_util.tree_map(lambda x: x[model], params)
        aux = view.forward(params, with_reply(inputs, fed_BxN), capture=names)[1]
        return {y: aux[name] for y, name in zip(sites, names)}

    return jax.jit(states)


def reply_norms(states, params, ex, control) -> dict:
    """{y: ([B] X's, [B] Y's norm)} the authors' steering norms at each site y of
    `states` (`reply_states`), `adversarial_steering.py` 126-133 over `extract_embeds`'
    states: the Frobenius norm of the control run's `lm/resid_pre.{y}` over every
    occurrence of the word's token (its last sub-token, `spans.x_B` / `y_B`) in the
    prompt and the reply `control` (a `Generation`) up to its end, each reply token but
    the last (their generation's states stop there: it is never fed back)."""
    tokens_BxN, n_B = np.asarray(control.tokens_BxN), np.asarray(control.n_B)
    fed = tokens_BxN[:, :-1]  # the tokens whose states their generation has
    read = np.concatenate([np.asarray(ex.inputs.valid_BxS, bool),
                           np.arange(fed.shape[1])[None] < n_B[:, None] - 1], 1)  # fmt: skip
    tokens = np.concatenate([np.asarray(ex.inputs.tokens_BxS), fed], 1)
    resid = states(params, ex.inputs, fed)
    return {y: tuple(occurrence_norms(r, tokens, read, w) for w in (ex.spans.x_B, ex.spans.y_B))
            for y, r in resid.items()}  # fmt: skip


def occurrence_norms(resid_BxTxD, tokens_BxT, read_BxT, word_B) -> np.ndarray:
    """[B] float32 sqrt(sum of |resid[b, t]|^2 over the rows t read (`read_BxT`) whose
    token is the token at word_B[b]): the norm of a word's states stacked over its every
    occurrence, as the authors' `.norm(p=2)` of an [occurrences, D] stack."""
    tokens = np.asarray(tokens_BxT)
    word = tokens[np.arange(len(tokens)), np.asarray(word_B)]
    hit = np.asarray(read_BxT, bool) & (tokens == word[:, None])
    sq = np.sum(np.square(np.asarray(resid_BxTxD, np.float32)), -1)
    return np.sqrt(np.sum(np.where(hit, sq, 0.0), 1)).astype(np.float32)


def vocabulary_directions(run: LoadedRun) -> np.ndarray:
    """[V] the authors' steering direction of a one-token reply, per token of the
    checkpoint's tokenizer (`analysis.steering.token_directions` of each id decoded, as
    their script decodes a reply: special tokens kept)."""
    tok = checkpoint_tokenizer(run)
    ids = [[i] for i in range(tok.get_vocab_size(with_added_tokens=True))]
    return st.token_directions(tok.decode_batch(ids, skip_special_tokens=False))


def boxed_only(res: dict) -> dict:
    """`res` with the box-based tables' per-question results (`BOX_TABLES`) of the
    boxed questions only (`steered_questions`)."""
    keep = np.flatnonzero(np.asarray(res["boxed"], bool))
    if len(keep) == len(res["boxed"]):
        return res
    import jax

    take = lambda axis: lambda x: np.take(np.asarray(x), keep, axis=axis)  # noqa: E731
    return res | {k: jax.tree_util.tree_map(take(QUESTION_AXES[k]), res[k]) for k in BOX_TABLES}


def pooled_authors(ar: dict, relation_B) -> dict:
    """`ar` (`analysis.steering.authors_flip_rates`) with both relations pooled under
    "both": per example its own relation's flip (NaN: not counted), the rate over every
    counted example and the top-sites mean of that rate (the authors' `fig2.ipynb`
    counts every row of the file in one rate)."""
    rel = np.asarray(relation_B)
    out = dict(ar)
    for kind in st.KINDS:
        f = np.where(rel == 0, ar[("flips", kind, RELATIONS[0])], ar[("flips", kind, RELATIONS[1])])
        n = np.isfinite(f).sum(-1)
        out[("flips", kind, "both")] = f
        out[(kind, "both")] = np.where(n > 0, np.nansum(f, -1) / np.maximum(n, 1), np.nan)
    out[("n", "both")] = ar[("n", RELATIONS[0])] + ar[("n", RELATIONS[1])]
    controls = {k: out[(k, "both")] for k in st.KINDS if k != "id"}
    out[("top", "both")] = st.top_sites_mean(out[("id", "both")], controls)
    return out


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


AUTHORS_RELATIONS = (*RELATIONS, "both")  # the authors' rates: each relation, and pooled


def authors_rows(ar: dict, models, sites) -> list[dict]:
    k, n_sites = ar[("id", "horizontal")].shape
    return [
        {"model": models[i], "site": sites[y], "relation": rel, "kind": kind,
         "flip_rate": float(ar[(kind, rel)][i, y]), "n": int(ar[("n", rel)][i, y])}
        for i in range(k)
        for y in range(n_sites)
        for rel in AUTHORS_RELATIONS
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
    how = ("against the model's own answer (read by their reply test: right / left / above "
           "/ below, whatever the relation; the line after says what it read), corner IDs, "
           "decisive ones counted" if against == "answer" else
           "X towards the far edge beyond Y, every example")  # fmt: skip
    log(f"\nthe authors' steering: {st.AUTHORS_SCALE:g} x |h| at both object words, each "
        f"site alone, {how}; a flip: the answer changed")  # fmt: skip
    out = {}
    for y, site in enumerate(sites):
        for rel in AUTHORS_RELATIONS:
            cells = {k: cell_interval(ar[("flips", k, rel)][:, y], 0.0, 1.0) for k in st.KINDS}
            out[f"authors/layer {site}/{rel}"] = cells
            log(
                f"layer {site:>3} {rel:>10} "
                + " ".join(f"{k} {fmt_interval(c, signed=False)}" for k, c in cells.items())
            )
    for rel in AUTHORS_RELATIONS:
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


def top_site_flips(ar: dict, rel: str = "both") -> dict:
    """{kind: [K, B]} each question's flip under the authors' steering, averaged over
    its model's `TOP_LAYERS` sites of highest ID flip rate (NaN: not counted), so the
    mean over questions is Fig. 2's number (`top_sites_mean`) and its bootstrap over
    questions that number's interval."""
    rate = np.nan_to_num(np.asarray(ar[("id", rel)], float), nan=-1.0)  # empty sites last
    top = np.argsort(-rate, axis=1, kind="stable")[:, : st.TOP_LAYERS]  # [K, T]
    out = {}
    for kind in st.KINDS:
        f = np.take_along_axis(np.asarray(ar[("flips", kind, rel)], float), top[..., None], 1)
        n = np.isfinite(f).sum(1)  # counted at every site alike: the unsteered answer's
        out[kind] = np.where(n > 0, np.nansum(f, 1) / np.maximum(n, 1), np.nan)
    return out


def model_names(run: LoadedRun) -> list[str]:
    """How a figure names each model: a checkpoint by its folder, a run's by index."""
    key = getattr(run.subject, "key", None)
    folder = key.get("checkpoint") if isinstance(key, dict) else None
    if folder and run.k == 1:
        return [os.path.basename(os.path.normpath(folder))]
    return [f"model {m}" for m in run.models]


def plot_paper(ar: dict, path: str, names) -> str:
    """Fig. 2 as the paper draws it: per model, bars of the share of beliefs swapped
    by ID steering at `AUTHORS_SCALE` x the token's norm and by its norm-matched
    controls (noise, orthogonal), each the mean of the model's `TOP_LAYERS` best
    sites over both relations, with its per-question bootstrap 95% interval; a run
    of several models adds their mean (95% CI over models)."""
    from jaxmech import plots

    flips = top_site_flips(ar)
    bars = {name: {k: question_ci(flips[k][i], 0.0, 1.0) for k in st.KINDS}
            for i, name in enumerate(names)}  # fmt: skip
    if len(names) > 1:
        top = ar[("top", "both")]
        bars = {f"mean over {len(names)} models": {k: mean_ci(top[k]) for k in st.KINDS}} | bars
    title = (f"{st.AUTHORS_SCALE:g}x steered - Spatial ID Steering by Model - % Belief "
             f"Swapped\n(mean of the {st.TOP_LAYERS} best layers, both relations)")  # fmt: skip
    return plots.save(plots.flip_bars_figure(bars, title), path)


def steerability(res: dict) -> dict:
    """One checkpoint's point of Fig. 9 (model 0), each a (mean, ci_low, ci_high, n)
    over its questions (bootstrap): "accuracy", the unsteered answer right (its word's
    logit above the other's) on every question steered, and the flip rates of Fig. 2
    (`top_site_flips`: "id_flip_rate", and the controls')."""
    a = res["authors"]
    right = (np.asarray(a["plain"])[0, 0] > 0).astype(float)  # the same at every site
    flips = top_site_flips(res["authors_rates"])
    return {"accuracy": question_ci(right, 0.0, 1.0)} | {
        f"{k}_flip_rate": question_ci(flips[k][0], 0.0, 1.0) for k in st.KINDS
    }


def correlation_cell(x, y, rank: bool = False) -> dict:
    """{"r", "ci_low", "ci_high", "n", "words"}: the correlation across models
    (`stats.correlation_ci`: Pearson, Spearman's with `rank`) with its Fisher-z 95%
    interval; where a number is not defined (fewer than 3 models for r, than 4 for the
    interval: z's standard error is 1 / sqrt(n - 3)) it is None and `words` says why."""
    r, lo, hi, n = correlation_ci(x, y, rank)
    name = "Spearman" if rank else "Pearson"
    if n < 3 or not np.isfinite(r):
        why = f"n = {n} models" if n < 3 else "one side is constant"
        return {"r": None, "ci_low": None, "ci_high": None, "n": n,
                "words": f"{name} r not defined ({why})"}  # fmt: skip
    if not np.isfinite(lo):
        return {"r": r, "ci_low": None, "ci_high": None, "n": n,
                "words": f"{name} r {r:+.2f}, 95% CI not defined (n = {n} < 4 models)"}  # fmt: skip
    return {"r": r, "ci_low": lo, "ci_high": hi, "n": n,
            "words": f"{name} r {r:+.2f} [{lo:+.2f}, {hi:+.2f}] (n = {n} models)"}  # fmt: skip


ACROSS_FIGURE = "accuracy_vs_steerability.png"


def across_steerability(summaries: dict, out: str) -> dict:
    """`--checkpoint=A,B,...`'s Fig. 9: {"accuracy_vs_steerability": per checkpoint
    its accuracy and flip rates (each summary's "steerability": `steerability`),
    Pearson and Spearman r of accuracy against the ID flip rate across them
    (`correlation_cell`) and the figure, one point per model, written into `out`}."""
    from jaxmech import plots

    names = [n for n, s in summaries.items() if "steerability" in s]
    points = [summaries[n]["steerability"] for n in names]
    col = lambda key: np.asarray([p[key] for p in points], float).reshape(-1, 4)  # noqa: E731
    acc, steer = col("accuracy"), col("id_flip_rate")
    ok = (acc[:, 3] > 0) & (steer[:, 3] > 0)  # an empty number is no point
    x, y = np.where(ok, steer[:, 0], np.nan), np.where(ok, acc[:, 0], np.nan)
    pearson, spearman = correlation_cell(x, y), correlation_cell(x, y, rank=True)
    fig = plots.accuracy_vs_steerability_figure(names, acc, steer, pearson["words"])
    path = plots.save(fig, os.path.join(plots.ensure_dir(out), ACROSS_FIGURE))
    record = {"checkpoints": names, "pearson": pearson, "spearman": spearman, "figure": path}
    record |= {key: [p[key] for p in points] for key in points[0]} if points else {}
    return {"accuracy_vs_steerability": record}


def _compute(run: LoadedRun, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    res = compute(run, max_new_tokens=max_new_tokens)
    grid = view_of(run).grid
    boxed = boxed_only(res)  # the box-based tables; the authors' steering reads every one
    cb = curve_beliefs(boxed, grid.h, grid.w)
    cb_paper = curve_beliefs(boxed, grid.h, grid.w, "curves_paper")
    return res | {
        "flip_rates": flip_rates(boxed),
        "authors_rates": pooled_authors(st.authors_flip_rates(res), res["relation"]),
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
    log(f"the authors' steering read the answer as {res['answer_read']}")
    summary |= summarise_paper_curves(res["beliefs_paper"], log, sites)
    if run.subject.over_questions:  # a checkpoint: its point of Fig. 9 across checkpoints
        summary["steerability"] = point = steerability(res)
        log("Fig. 9's point, over every question steered: "
            + "; ".join(f"{k} {fmt_interval(c, signed=False)}" for k, c in point.items()))  # fmt: skip
    return summary | {"alphas": list(ALPHAS), "excluded": list(run.excluded),
                      "protocol": res["protocol"], "answer_read": res["answer_read"]}  # fmt: skip


REPORT = Report(
    folder="steering",
    refusal=steering_refusal,
    compute=_compute,
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: [
        plot(res["flip_rates"], res["beliefs"], res["accuracy"], path, res["sites"]),
        plot_paper(res["authors_rates"], path.replace(".png", "_paper.png"), model_names(run)),
    ],
    figure="steering.png",
    examples=EXAMPLES,
    per_model=("flip_rates", "authors_rates", "beliefs", "beliefs_paper", "accuracy"),
    photos=True,
    across=across_steerability,
    compare=(
        Measure(
            "authors' steering: flip rate",
            "authors",
            "flip_rate",
            (("kind", ("id", "noise")),),
            ("site", "relation", "kind"),
        ),
        Measure(
            "jaxmech's alpha 5: flip rate",
            "flips",
            "flip_rate",
            (("alpha", 5.0), ("kind", ("id", "noise"))),
            ("site", "relation", "kind"),
        ),
        Measure(
            "authors' steering: ID less noise flip rate",
            "authors",
            "flip_rate",
            (("kind", "id"),),
            ("site", "relation"),
            (("kind", "noise"),),
        ),
    ),
)


def report(max_new_tokens: int = MAX_NEW_TOKENS) -> Report:
    """`REPORT` whose authors' protocol generates replies of `max_new_tokens` tokens
    (`--max_new_tokens`); ValueError naming it before any compute."""
    check_max_new_tokens(max_new_tokens)
    return REPORT._replace(compute=functools.partial(_compute, max_new_tokens=max_new_tokens))
