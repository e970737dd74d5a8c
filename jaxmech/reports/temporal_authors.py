"""Paper 003's Fig. 10 under the authors' protocol (`temporal_models/`) on a Qwen2 /
Qwen2.5-VL checkpoint's video input (`experiments.temporal_ids --checkpoint=DIR
--protocol=authors`: the report opens checkpoints as videos).

Three experiments on the drawn videos (`pictures.draw_video`: the two objects of a
scene in different frames), every question asked in the authors' words
(`AUTHORS_QUESTION`, after their time instruction `TIME_INSTRUCTION`):

* 10A, temporal mirror swap (`mirror_swapping.py`): the block-L output of a token group
  (`GROUPS`: their "text", "image", "text-objonly"; "all" as the check) taken from
  the time-reversed twin (same question); read per word w in (before, after)
  `(lp_orig(w) - lp_patched(w)) / (lp_orig(w) - lp_twin(w))`, NaN / inf as 0, every
  question counted.
* 10B, temporal IDs (`extraction_pca.py`): the raw object-word state at every layer per
  frame, averaged per object then over objects (`analysis.temporal_ids.frame_ids`);
  drawn on the first principal component of the frames at their layer 12 (scaled to
  the LM's depth) with the words "before" / "after" of the question asked without the
  video (`pca_line`).
* 10C, temporal steering (`temporal_steering.py`): the subject's word (X) gets
  `5 x (ID_L(f) - ID_L(T - 1 - f))` at block L's output (their layer 13, scaled), for
  every frame f; read the change of log p(before) and log p(after), split by the true
  answer.

Per-question 95% intervals (`tables.cell_interval`). Writes mirror_swap.csv,
steering.csv, pca.csv, summary.json, temporal_ids.png (the table's numbers) and
temporal_ids_paper.png (Fig. 10 as `fig10.ipynb` draws it).

Differences from the authors' scripts, and why:

1. Model: LLaVA-Video-7B-Qwen2 in theirs (and VideoLLaMA3 in the paper); here a Qwen2 /
   Qwen2.5-VL checkpoint (jaxmech has no LLaVA-Video / VideoLLaMA3 family). Layers
   13 / 12 of 28 are scaled to the LM's depth (`scaled`).
2. Videos: their Objaverse videos (10B) and MVBench Scene_QA (10A, 10C) are not
   available; all three use jaxmech's drawn videos, T = grid rows frames (theirs 8,
   objects in frames 1..7), each frame one temporal patch at 2 fps.
3. Prompt: their extraction question for all three (MVBench's scene questions need
   MVBench; their mirror swap's "earlier or later than" rewrite reads a sentence that
   is broken in their code), inside Qwen's chat template, not LLaVA's qwen_1_5 one.
4. Read words: the view's answer tokens "Before" / "After" (what the question's answer
   begins with), not their fixed LLaVA-Video token ids.
5. Positions: the object words' last sub-tokens (`Spans.x_B`, `y_B`), not their fixed
   offsets from the end (which count words, not tokens); steering X's last sub-token,
   theirs a window from an offset near the first-named scene.
6. IDs: per (object, frame) the mean over every video showing it there; theirs keeps the
   last video written. The before / after words come from the question asked without
   the video in Qwen's template (theirs: their own text-only prompt, same words).
7. Mirror swap "text": every token after the video (`patching.token_groups`); theirs
   the last len(input_ids) positions. "text-objonly": the two words' last sub-tokens.
8. Steering reads every frame f; theirs 1..7 of 8 (frame 0 never used).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import patching as pa
from jaxmech.analysis import spatial_ids as si
from jaxmech.analysis import temporal_ids as tid
from jaxmech.analysis.steering import add_forward, at_word
from jaxmech.data.inputs import pictures
from jaxmech.data.spec import mirror_height
from jaxmech.families.vlm_view import model_outline
from jaxmech.memory import remembered
from jaxmech.reports.common import cell_interval, fmt_interval, probe_rows, view_of
from jaxmech.reports.questions import (
    chunk_progress,
    log_estimate,
    relation_questions,
    rows_per_call,
    table_store,
)

AUTHORS_QUESTION = ("In this video, two objects appear at different times. Does the {x} come "
                    "before or after the {y}? Answer in one word.")  # fmt: skip
TIME_INSTRUCTION = ("The video lasts for {secs:.2f} seconds, and {n} frames are uniformly sampled "
                    "from it. These frames are located at {times}.Please answer the following "
                    "questions related to this video.\n")  # fmt: skip
GROUPS = {"text": "text", "image": "image", "text-objonly": "objects", "all": "all"}
PAPER_GROUPS = ("text", "image", "text-objonly")
WORDS = ("before", "after")
SCALE = 5.0  # their mult_factor
THEIR_DEPTH, THEIR_STEER, THEIR_PCA = 28, 13, 12  # LLaVA-Video-7B's blocks, their layers


def scaled(layer: int, n_blocks: int, top: int) -> int:
    """Their layer `layer` of 28 at the same depth of an `n_blocks` LM, in [0, top]."""
    return int(min(max(round(layer * n_blocks / THEIR_DEPTH), 0), top))


def video_clock(view) -> float:
    """Seconds per drawn frame of a video view that words its own questions
    (`VLMView.render_asked`); ValueError naming the view where it is not one (the
    authors' questions are encoded with its processor)."""
    if view.render_asked is None or view.video_clock is None:
        raise ValueError(f"--protocol=authors: {view.name}'s view is not a Qwen2 / Qwen2.5-VL "
                         "video view (one that takes its questions: the checkpoint opened as "
                         "videos)")  # fmt: skip
    return view.video_clock


def authors_questions(spec, n_frames: int, step: float) -> list[str]:
    """[B] their time instruction (frames `step` seconds apart) and extraction question
    for each scene of `spec`."""
    head = TIME_INSTRUCTION.format(secs=n_frames * step, n=n_frames,
                                   times=",".join(f"{f * step:.2f}s" for f in range(n_frames)))  # fmt: skip
    return [head + AUTHORS_QUESTION.format(x=x, y=y) for x, y in pictures.object_names(spec)]


def render(view, spec, ask=None):
    """(inputs, spans) of `spec` as videos asked the authors' question of `ask`'s
    scenes (default `spec`'s: a time-reversed twin keeps its example's question)."""
    ask = spec if ask is None else ask
    asked = authors_questions(ask, view.grid.h, video_clock(view))
    return view.render_asked(spec, ask, questions=asked)


def setup(run) -> dict:
    """The layers and words, checked before any compute (ValueError naming the part)."""
    view = view_of(run)
    video_clock(view)
    grid = view.grid
    n = view.n_lm_blocks(model_outline(run.params))
    if grid.h < 2:
        raise ValueError(f"grid = {grid.h} x {grid.w}: a video needs at least 2 frames (rows)")
    before, after = (int(t) for t in np.asarray(view.answer_words)[1])
    if before == after:
        raise ValueError("--protocol=authors: 'before' and 'after' read as one token")
    layers = tuple(run.subject.layers or ())
    if any(not 0 <= L <= n - 2 for L in layers):
        raise ValueError(f"layers = {list(layers)}: a block's output is steered / patched; "
                         f"expected blocks in [0, {n - 2}]")  # fmt: skip
    return {"n_blocks": n, "words": (before, after),
            "swap_layers": layers or tuple(range(n - 1)),
            "steer_layers": layers[:1] or (scaled(THEIR_STEER, n, n - 2),),
            "pca_layer": scaled(THEIR_PCA, n, n)}  # fmt: skip


def extract(view, params, ex, inputs, spans, rows) -> np.ndarray:
    """[Y, T, D] the authors' temporal IDs from X's and Y's words of the questions."""
    cells, labels = np.asarray(ex.spec.cells_BxK), np.asarray(ex.spec.labels_BxK)
    states = [
        np.asarray(si.word_states(view, params, inputs, p, rows)) for p in (spans.x_B, spans.y_B)
    ]
    frames = np.concatenate([cells[:, 0], cells[:, 1]]) // view.grid.w
    return tid.frame_ids(np.concatenate(states, 1), np.concatenate(labels[:, :2].T), frames,
                         view.grid.h)  # fmt: skip


def word_marks(view, params, ex, site: int) -> np.ndarray:
    """[2, D] the words "before" and "after" of the first question asked without the
    video (their `get_text_embeddings_from_query`), at LM site `site`."""
    q = authors_questions(ex.spec, view.grid.h, video_clock(view))[:1]
    q = [q[0].split("\n", 1)[1]]  # the question alone: no video, no time instruction
    inputs, spans = view.render_text(q, [WORDS])
    st = [
        np.asarray(si.word_states(view, params, inputs, p))[site, 0] for p in (spans.x_B, spans.y_B)
    ]
    return np.stack(st)


def word_logps(logits_BxV, words) -> jax.Array:
    """[2, B] log p of the words (before, after) under the full softmax."""
    lp = jax.nn.log_softmax(logits_BxV.astype(jnp.float32), -1)
    return lp[:, jnp.asarray(words)].T


def steer(
    view, params, inputs, spans, ids_YxTxD, layers, words, scale=SCALE, rows=None
) -> np.ndarray:
    """[L, T, 2, B] the change of log p(before), log p(after) with X's word given
    `scale x (ID_L(f) - ID_L(T - 1 - f))` at block L's output (`lm/resid_pre.{L + 1}`)
    for each frame f; a zero vector changes nothing (0 exactly where no mirror exists)."""
    S, B = spans.length, len(np.asarray(spans.x_B))

    @functools.partial(jax.jit, static_argnums=0)
    def run(site, p, x, vec_D, pos_B):
        if site is None:
            return word_logps(view.forward(p, x)[0], words)
        add = at_word(jnp.broadcast_to(vec_D, (pos_B.shape[0], vec_D.shape[0])), pos_B, S)
        return word_logps(add_forward(view, p, x, site, add.astype(jnp.float32), pos_B), words)

    def chunked(site, vec):
        step = rows or B
        outs = [run(site, params, jax.tree_util.tree_map(lambda a: a[i:i + step], inputs),
                    jnp.asarray(vec), jnp.asarray(spans.x_B[i:i + step])) for i in range(0, B, step)]  # fmt: skip
        return np.concatenate([np.asarray(o) for o in outs], 1)

    T = ids_YxTxD.shape[1]
    plain = chunked(None, np.zeros(ids_YxTxD.shape[-1], np.float32))
    return np.stack([
        np.stack([chunked(L + 1, tid.mirror_steer(ids_YxTxD[L], f, scale).astype(np.float32)) - plain
                  for f in range(T)]) for L in layers])  # fmt: skip


def mirror_swap(view, params_K, inputs, rev_inputs, spans, layers, words, run=None,
                log=print) -> dict:  # fmt: skip
    """{"ratio": [2, L, G, B] their shift per read word (before, after), "logp": the
    table} of the time-reversed twin's block-L output patched at each group. With `run`
    (a checkpoint): its time estimated, its rows per call sized to the memory budget
    and its finished chunks kept and resumed, as the patching report's."""
    groups = pa.token_groups(spans)[[pa.GROUPS.index(g) for g in GROUPS.values()]]
    B = len(np.asarray(spans.x_B))
    before, after = (np.full(B, w, np.int32) for w in words)
    sites, twins = [L + 1 for L in layers], {"mirror": rev_inputs}
    call = pa.table_call_for(view, params_K, twins, groups, sites)
    rows = plan = store = at = None
    if run is not None:
        n_blocks = view.n_lm_blocks(model_outline(params_K))
        tail = sum((n_blocks - y) / n_blocks for y in sites) * len(groups)
        secs = log_estimate(run, view, inputs, B * (2 + tail),
                            f"{len(sites)} layers x {len(groups)} groups x {B} questions",
                            log)  # fmt: skip
        at = remembered(pa.table_compile_at(call, params_K, inputs, twins, groups, before,
                                            after))  # fmt: skip
        rows, plan = rows_per_call(run, at, B, log, secs)
        store = table_store(run, "temporal_mirror_swap", layers=tuple(sites))
    lp = pa.patch_table(view, params_K, inputs, twins, groups, before, after, batch=rows,
                        progress=rows and chunk_progress(log, rows), call=call, store=store,
                        plan=plan, compiled=at and at.program)["mirror"]  # fmt: skip
    out = []
    for own in ("", "_other"):  # "": before's, "_other": after's
        o, t, p = (np.asarray(lp[k + own])[0] for k in ("orig", "twin", "patched"))
        with np.errstate(divide="ignore", invalid="ignore"):
            r = (o - p) / (o - t)
        out.append(np.where(np.isfinite(r), r, 0.0))
    return {"ratio": np.stack(out), "logp": lp}


def check_frames(spec, grid) -> None:
    """Refuses (ValueError naming --questions) questions that leave a frame without an
    object: that frame would have no temporal ID (before any model runs)."""
    cells = np.asarray(spec.cells_BxK)[:, :2]
    empty = sorted(set(range(grid.h)) - set((cells[cells >= 0] // grid.w).tolist()))
    if empty:
        raise ValueError(f"--questions: no question shows an object in frame(s) {empty}, "
                         "which then have no temporal ID; ask more questions")  # fmt: skip


def compute(run, log=print, scale: float = SCALE) -> dict:
    """The three experiments on the subject's before / after questions (above)."""
    s, view = setup(run), view_of(run)
    ex = relation_questions(run)
    check_frames(ex.spec, view.grid)
    inputs, spans = render(view, ex.spec)
    rev, _ = render(view, mirror_height(view.grid, ex.spec), ask=ex.spec)
    params = jax.tree_util.tree_map(lambda x: x[0], run.params)
    rows = probe_rows(run)
    log(f"authors' Fig. 10: {len(ex.answer_B)} questions, {view.grid.h} frames, blocks "
        f"{list(s['swap_layers'])} patched, {list(s['steer_layers'])} steered")  # fmt: skip
    ids = extract(view, params, ex, inputs, spans, rows)
    marks = word_marks(view, params, ex, s["pca_layer"])
    cells = np.asarray(ex.spec.cells_BxK)
    return {
        "protocol": "authors", **s, "scale": scale, "ids": ids,
        "pca": tid.pca_line(ids[s["pca_layer"]], marks),
        "steer": steer(view, params, inputs, spans, ids, s["steer_layers"], s["words"], scale, rows),
        "swap": mirror_swap(view, run.params, inputs, rev, spans, s["swap_layers"], s["words"],
                            run, log),
        "true_before": cells[:, 0] // view.grid.w < cells[:, 1] // view.grid.w,
    }  # fmt: skip


def tables(res: dict) -> dict:
    """mirror_swap (layer, group, word, mean, lo, hi, n), steering (layer, frame,
    original answer, word, ...), pca (frame or word, position)."""
    cell = lambda v: dict(zip(("mean", "lo", "hi", "n"), cell_interval(v[None])))  # noqa: E731
    swap = [{"layer": L, "group": g, "word": w, **cell(res["swap"]["ratio"][i, j, k])}
            for j, L in enumerate(res["swap_layers"]) for k, g in enumerate(GROUPS)
            for i, w in enumerate(WORDS)]  # fmt: skip
    tb = res["true_before"]
    steer = [{"layer": L, "frame": f, "original": side, "word": w,
              **cell(res["steer"][j, f, i][tb == (side == "before")])}
             for j, L in enumerate(res["steer_layers"]) for f in range(res["steer"].shape[1])
             for side in WORDS for i, w in enumerate(WORDS)]  # fmt: skip
    p = res["pca"]
    pca = [{"layer": res["pca_layer"], "point": f"frame {f}", "position": float(v)}
           for f, v in enumerate(p["frames"])]  # fmt: skip
    pca += [{"layer": res["pca_layer"], "point": w, "position": float(v)}
            for w, v in zip(WORDS, p["marks"])]  # fmt: skip
    return {"mirror_swap": swap, "steering": steer, "pca": pca}


def summarise(res: dict, tabs: dict, log) -> dict:
    out = {"protocol": "authors", "scale": res["scale"], "pca_layer": res["pca_layer"],
           "pca_explained": res["pca"]["explained"], "steer_layers": list(res["steer_layers"])}  # fmt: skip
    log(f"10B: PCA of the frame IDs at layer {res['pca_layer']}: PC1 holds "
        f"{res['pca']['explained']:.2f}; frames at {np.round(res['pca']['frames'], 2).tolist()}, "
        f"before / after at {np.round(res['pca']['marks'], 2).tolist()}")  # fmt: skip
    for r in tabs["mirror_swap"]:
        if r["group"] in PAPER_GROUPS:
            key = f"swap/layer {r['layer']}/{r['group']}/{r['word']}"
            out[key] = [r["mean"], r["lo"], r["hi"], r["n"]]
    log("10A: time-reversed twin's block output patched, shift of log p (1: the twin's)")
    for r in tabs["mirror_swap"]:
        if r["word"] == "before" and r["group"] in PAPER_GROUPS:
            log(f"  layer {r['layer']:>3} {r['group']:<13} before "
                f"{fmt_interval((r['mean'], r['lo'], r['hi'], r['n']))}")  # fmt: skip
    log(f"10C: steering X by {res['scale']:g} x (ID(f) - ID(T-1-f)), change of log p")
    for r in tabs["steering"]:
        cell = (r["mean"], r["lo"], r["hi"], r["n"])
        out[f"steer/layer {r['layer']}/frame {r['frame']}/{r['original']}/{r['word']}"] = list(cell)
        log(f"  layer {r['layer']} ID of frame {r['frame']} original {r['original']:<6} "
            f"d log p({r['word']}) {fmt_interval(cell)}")  # fmt: skip
    return out


def plot(res: dict, tabs: dict, path: str) -> list[str]:
    """temporal_ids.png (the mirror swap's table as a heatmap) and
    temporal_ids_paper.png (Fig. 10A-C as `fig10.ipynb` draws them)."""
    from jaxmech import plots

    swap = {(r["layer"], r["group"], r["word"]): r for r in tabs["mirror_swap"]}
    paper = plots.temporal_fig10(swap, res["swap_layers"], PAPER_GROUPS, res["pca"],
                                 tabs["steering"], res["steer_layers"][0], res["steer"].shape[1])  # fmt: skip
    table = plots.temporal_swap_table(swap, res["swap_layers"], tuple(GROUPS), WORDS)
    return [plots.save(table, path), plots.save(paper, path.replace(".png", "_paper.png"))]
