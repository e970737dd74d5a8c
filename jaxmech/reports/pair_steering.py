"""Fig. 6A of paper 003 (`arbitrary_steering/single_lr.py`) as the arbitrary-steering
report's `--sets=pair`: both object words steered at once, at a sweep of layers.

Two interventions on every left / right question: (1) X towards the left end of row
r and Y towards its right end, (2) the reverse (r = 1, their cells (0, 1) and (3, 1),
or the last row of a shorter grid). (1) implies "left", (2) "right"
(`analysis.pair_steering`).

Protocols:

  jaxmech   each word's ID replaced by its target's (`Delta(t) - Delta(own cell)`,
            scale 1) at `lm/resid_pre.y` for every steered site y, with that site's
            ID; a photograph's questions with both boxes.
  authors   `single_lr.py`: X += 5 (ID(a) - ID(b)), Y += 5 (ID(b) - ID(a)), one ID
            (their layer 13 of 32, scaled to the LM's depth) added at the output of
            each block of their sweep 5..19 (scaled; `--layers` overrides), every
            question (theirs is one photograph).

The result has the arbitrary-steering report's shape (one question set "pair" whose
targets are X's), so its rows, summary and share figure are that report's; the paper
figure (`plot_paper`) is Fig. 6A's: log p of each word against the layer steered,
after each intervention and unsteered, 95% bands over the questions.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxmech.analysis import arbitrary_steering as ar
from jaxmech.analysis import pair_steering as ps
from jaxmech.families.vlm_view import model_outline
from jaxmech.memory import remembered
from jaxmech.reports import target_steering as ts
from jaxmech.reports.common import (
    LoadedRun,
    chunk_progress,
    compiled_call,
    id_labels,
    joined,
    log_estimate,
    probe_rows,
    protocol_of,
    question_batches,
    question_ci,
    rows_per_call,
    steered_sites,
    table_store,
    view_of,
)

AUTHORS_SWEEP = range(5, 20)  # single_lr.py `for layer in range(5, 20)`
AUTHORS_ID_LAYER = 13  # single_lr.py `big_embeds_dicts_foralllayers[13]`


def scaled(layer: int, n: int) -> int:
    """An authors' layer of LLaVA-1.5-7B's 32 blocks at an LM of n blocks, kept where
    its block's output is steerable (0..n - 2)."""
    return min(max(round(layer * n / ar.AUTHORS_DEPTH), 0), n - 2)


def interventions(grid) -> tuple[np.ndarray, np.ndarray]:
    """(X's cells [2], Y's cells [2]): (left end, right end) of row r and the reverse."""
    r = min(1, grid.h - 1)
    left, right = r * grid.w, r * grid.w + grid.w - 1
    return np.asarray([left, right], np.int32), np.asarray([right, left], np.int32)


def setup(run: LoadedRun, log=print) -> ts.Setup:
    """The sites, ID sites, reported layers, scale and X's targets (module docstring);
    ValueError naming `--layers` where one cannot be steered."""
    n = view_of(run).n_lm_blocks(model_outline(run.params))
    a, _ = interventions(view_of(run).grid)
    if protocol_of(run) != "authors":
        ts.check_layers(run.subject.layers, n, "jaxmech")
        sites = tuple(steered_sites(run))
        return ts.Setup(sites, sites, sites, ts.JAXMECH_SCALE, a, "jaxmech")
    ts.check_layers(run.subject.layers, n, "authors")
    layers = tuple(run.subject.layers or sorted({scaled(y, n) for y in AUTHORS_SWEEP}))
    idl = scaled(AUTHORS_ID_LAYER, n)
    if run.subject.layers is None:
        log(f"the authors' sweep {AUTHORS_SWEEP.start}..{AUTHORS_SWEEP.stop - 1} and ID layer "
            f"{AUTHORS_ID_LAYER} of {ar.AUTHORS_DEPTH} blocks (single_lr.py) scaled to {n}: "
            f"{list(layers)}, ID {idl} (--layers chooses the sweep)")  # fmt: skip
    return ts.Setup(tuple(y + 1 for y in layers), (idl,) * len(layers), layers, ar.AUTHORS_SCALE,
                    a, "authors")  # fmt: skip


def minus_of(s: ts.Setup, grid, ex) -> np.ndarray:
    """[I, B, 2] the cells whose IDs X and Y lose: their own (jaxmech), the other
    target (authors: the IDs traded)."""
    a, b = interventions(grid)
    B = len(np.asarray(ex.answer_B))
    if s.protocol == "authors":
        return np.broadcast_to(np.stack([b, a], -1)[:, None], (2, B, 2))
    own = np.asarray(ex.spec.cells_BxK)[:, :2]
    return np.broadcast_to(own[None], (2, B, 2))


def steer_batch(run: LoadedRun, batch, s: ts.Setup, delta, log) -> dict:
    """One batch's table and what `target_steering` reads of a set (`steer_set`)."""
    ex, view = ts.steerable(run, batch, s), batch.view
    words, names = ts.word_pair(view, 0)
    a, b = interventions(view.grid)
    minus, n = minus_of(s, view.grid, ex), len(np.asarray(ex.answer_B))
    first = int(np.min(np.asarray(ex.spans.x_B)))
    fn = ps.table_fn(view, s.sites, s.id_sites, words, first, s.scale)
    secs = log_estimate(run, view, ex.inputs, n * (1 + 4 * len(s.sites)),
                        f"pair: {n} questions x 2 interventions x {len(s.sites)} layers x 2 (ID, "
                        "noise), each run counted whole", log)  # fmt: skip
    at = remembered(ps.compile_at(fn, run.params, delta, ex, a, b, minus))
    rows, plan = rows_per_call(run, at, n, log, secs)
    store = table_store(run, "pair_steering", sites=list(s.sites), id_sites=list(s.id_sites),
                        scale=s.scale, **batch.key)  # fmt: skip
    lp = ps.pair_table(view, run.params, delta, ex, a, b, minus, fn, batch=rows,
                       progress=chunk_progress(log, rows), store=store, plan=plan,
                       compiled=at.program)  # fmt: skip
    return {"lp": lp, "sides": np.repeat(np.asarray([[1], [-1]]), n, 1),
            "answer_first": np.asarray(ex.answer_B) == words[0],
            "cells": np.asarray(ex.spec.cells_BxK)[:, :2].T, "names": names}  # fmt: skip


def compute(run: LoadedRun, log=print) -> dict:
    """The universal IDs, then every left / right batch steered (`steer_batch`),
    joined, in `target_steering.compute_sets`' shape with the one set "pair"."""
    s = setup(run, log)
    what = f"universal spatial IDs ({len(id_labels(run))} labels)"
    delta = ar.universal_ids(view_of(run), run.params, id_labels(run), probe_rows(run),
                             functools.partial(_call, run, what), s.protocol == "authors")  # fmt: skip
    out = [steer_batch(run, b, s, delta, log) for b in question_batches(run, (0,))]
    out = [o for o in out if o["sides"].shape[1]]
    if not out:
        raise ValueError("pair steering: no question to steer (n = 0): a photograph needs "
                         "both boxes under jaxmech's protocol")  # fmt: skip
    res = joined(out, ts.PER_QUESTION)
    return {k: {"pair": res[k]} for k in ts.PER_QUESTION} | {
        "setup": s, "words": {"pair": (out[0]["names"], True)}, "lines": {"pair": ()}}  # fmt: skip


def _call(run: LoadedRun, what: str, fn, args):
    return compiled_call(fn, args, what, estimate=run.subject.estimates_time)


def curves(res: dict) -> dict:
    """{label: ([Y', 4] cells of mean log p over the questions, colour, line style)}:
    each word after each intervention, and unsteered (model 0's)."""
    lp, words = res["lp"]["pair"], res["words"]["pair"][0]
    n_sites = lp["id"].shape[1]
    out = {}
    for i, colour in enumerate(("yellowgreen", "orchid")):
        for w, style in enumerate(("--", "-")):
            cells = [question_ci(lp["id"][0, y, i, w]) for y in range(n_sites)]
            out[f'"{words[w]}" after intervention {i + 1}'] = (cells, colour, style)
    for w, style in enumerate(("--", "-")):
        out[f'"{words[w]}" no intervention'] = ([question_ci(lp["plain"][0, w])] * n_sites,
                                                "blue", style)  # fmt: skip
    return out


def plot_paper(res: dict, run: LoadedRun, path: str) -> str:
    """Fig. 6A as the paper draws it: x the layer steered, y log likelihood of each
    word; intervention 1 (X left, Y right), 2 (the reverse), none."""
    from jaxmech import plots

    s, grid = res["setup"], view_of(run).grid
    a, b = interventions(grid)
    title = (f"Fig. 6A: both words steered, intervention 1 = X to {ts._cell_label(a[0], grid)}, "
             f"Y to {ts._cell_label(b[0], grid)} ({ts.PROTOCOL_WORDS[s.protocol]}, scale "
             f"{s.scale:g})")  # fmt: skip
    return plots.save(plots.layer_logp_figure(curves(res), list(s.layers), title), path)
