"""Steering an object's spatial ID to target cells: what the arbitrary-steering
report (paper 003's Fig. 6) and the depth diagnosis (Fig. 7) share. Shared report
code, not a report: the setup (targets, protocol, layers, scale), the question sets,
the compiled steered table over chunks, the per-question results and their rows,
summaries and figures. `reports.arbitrary_steering` asks left / right questions with
it (and near / far, in between: `reports.target_questions`, each set its own implied
answers and figure line), `reports.depth_diagnosis` above / below and front / behind
ones; `reports.pair_steering` (Fig. 6A) builds a result of the same shape.

Protocols (`--protocol`):

  jaxmech   X's ID replaced by the target's (`Delta(t) - Delta(X's cell)`, scale 1) at
            `lm/resid_pre.y` for every steered site y (`common.steered_sites`), every
            cell a target; a photograph's questions with both boxes.
  authors   `arbitrary_steering/batch_lr.py`: `5 x (Delta_L(t) - Delta_L(t's mirror
            across the width))` added to the output of block L (site L + 1) for their
            layers 12, 13, 14 of LLaVA-1.5-7B's 32 (scaled to the LM's depth; `--layers`
            overrides), every cell a target (their figure draws row 0), IDs from the
            factorial probes, every question.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import numpy as np

from jaxmech.analysis import arbitrary_steering as ar
from jaxmech.data.spec import Grid
from jaxmech.families.vlm_view import Examples, model_outline
from jaxmech.memory import remembered
from jaxmech.reports.common import (
    LoadedRun,
    cell_interval,
    chunk_progress,
    compiled_call,
    fmt_interval,
    id_labels,
    joined,
    log_estimate,
    probe_rows,
    protocol_of,
    question_batches,
    question_ci,
    report_main,
    rows_per_call,
    steered_sites,
    table_store,
    take_examples,
    view_of,
)

KINDS = ("id", "noise")
JAXMECH_SCALE = 1.0  # the target's ID replaces X's own: no extrapolation
PROTOCOL_WORDS = {"jaxmech": "jaxmech's protocol", "authors": "the authors' protocol"}


class Setup(NamedTuple):
    """Where and how a protocol steers: `sites` (`lm/resid_pre.y`), the ID's site for
    each (`id_sites`), the layer each is reported as (`layers`: jaxmech's site, the
    authors' hooked block), `scale`, the target cells [T] and the protocol."""

    sites: tuple
    id_sites: tuple
    layers: tuple
    scale: float
    targets: np.ndarray
    protocol: str


class QSet(NamedTuple):
    """One question set steered: its name, questions, answer words [2] (token ids) and
    their names, the axis their relation reads, and whether a target on the first
    word's side implies the first word (False: the depth diagnosis, up reads 'behind')."""

    name: str
    ex: Examples
    words: np.ndarray
    word_names: tuple
    axis: str
    follows_first: bool = True
    # sides(grid, targets [T], ex) -> [T, B] the answer each target implies (None: its
    # side of the reference cell along `axis`, `minus_and_ref`)
    sides: Callable | None = None
    line: tuple | None = None  # the cells its paper figure draws (None: `default_line`)


def parse_targets(text: str | None, grid: Grid) -> np.ndarray | None:
    """`--targets` ("ROW:COL,ROW:COL", rows and columns from 0) as cell ids on `grid`
    (None: every cell); ValueError naming `--targets` otherwise."""
    if not text:
        return None
    try:
        pairs = [tuple(int(v) for v in p.split(":")) for p in text.split(",")]
    except ValueError:
        pairs = [()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"--targets = {text!r}: expected ROW:COL pairs, e.g. 0:0,0:3")
    bad = [p for p in pairs if not (0 <= p[0] < grid.h and 0 <= p[1] < grid.w)]
    if bad:
        raise ValueError(f"--targets = {text!r}: cell {bad[0][0]}:{bad[0][1]} is not on the "
                         f"{grid.h} x {grid.w} grid (rows 0..{grid.h - 1}, columns 0..{grid.w - 1})")  # fmt: skip
    return np.asarray([r * grid.w + c for r, c in pairs], np.int32)


def authors_layers(n_blocks: int) -> list[int]:
    """Their layers 12, 13, 14 of 32 blocks scaled to `n_blocks` (exact at 32), each kept
    where its hooked site L + 1 is one jaxmech can steer (1..n_blocks - 1)."""
    scaled = sorted({round(layer * n_blocks / ar.AUTHORS_DEPTH) for layer in ar.AUTHORS_LAYERS})
    return [min(max(layer, 0), n_blocks - 2) for layer in scaled if n_blocks >= 2]


def setup(run: LoadedRun, targets=None, authors_targets=None, log=print) -> Setup:
    """The protocol's sites, scale and targets (module docstring); `targets`: cells given
    (None: every cell; the authors' default `authors_targets` where given). ValueError
    naming `--layers` where a layer cannot be steered."""
    view, protocol = view_of(run), protocol_of(run)
    n = view.n_lm_blocks(model_outline(run.params))
    every = np.arange(view.grid.cells, dtype=np.int32)
    check_layers(run.subject.layers, n, protocol)
    if protocol != "authors":
        sites = steered_sites(run)
        chosen = every if targets is None else targets
        return Setup(tuple(sites), tuple(sites), tuple(sites), JAXMECH_SCALE, chosen, protocol)
    layers = list(run.subject.layers or authors_layers(n))
    check_layers(layers, n, protocol)
    if run.subject.layers is None:
        log(f"the authors' layers {', '.join(map(str, ar.AUTHORS_LAYERS))} of LLaVA-1.5-7B's "
            f"{ar.AUTHORS_DEPTH} blocks (batch_lr.py) scaled to {n}: {layers} (--layers chooses)")  # fmt: skip
    default = every if authors_targets is None else authors_targets
    chosen = default if targets is None else targets
    return Setup(tuple(y + 1 for y in layers), tuple(layers), tuple(layers), ar.AUTHORS_SCALE,
                 chosen, protocol)  # fmt: skip


def check_layers(layers, n: int, protocol: str) -> None:
    """ValueError naming `--layers` where none of `layers` (None: every one) can be
    steered in an LM of `n` blocks: jaxmech steers `resid_pre.L` for L in 1..n - 1
    (layer 0 precedes the image; the last block's output is read by the final norm
    only); the authors add to block L's output (site L + 1), so L in 0..n - 2, each."""
    if protocol == "authors":
        if layers is not None and (not layers or min(layers) < 0 or max(layers) > n - 2):
            raise ValueError(f"--layers = {list(layers)}: the authors' steering adds to the "
                             f"output of block L (site L + 1): expected layers in 0..{n - 2} "
                             f"of {n} blocks")  # fmt: skip
        if layers is None and n < 2:
            raise ValueError(f"--layers: an LM of {n} block(s) has no site to steer")
        return
    if not [y for y in (range(n) if layers is None else layers) if 1 <= y < n]:
        raise ValueError(f"--layers = {None if layers is None else list(layers)}: no layer in "
                         f"1..{n - 1} of {n} blocks (layer 0 precedes the image; the last is "
                         "read by the final norm only)")  # fmt: skip


def check_flags(F) -> None:
    """A checkpoint's `--targets` on `--grid` and `--layers` on each checkpoint's config
    (`check_layers`), before any weight is read; ValueError naming the flag."""
    from jaxmech.cli import parse_layers
    from jaxmech.families.registry import read_checkpoint_config

    try:
        grid = Grid(*(int(x) for x in F.grid.lower().split("x")))
    except (TypeError, ValueError):
        return  # `cli.checkpoint_options` refuses it by name
    parse_targets(F.targets, grid)
    layers = parse_layers(F.layers)
    for folder in (f for f in F.checkpoint.split(",") if f):
        if os.path.isdir(folder):  # a Hub name: checked once resolved (`Report.check`)
            check_layers(layers, int(read_checkpoint_config(folder)[1].lm_layers), F.protocol)


def targets_main(report_of):
    """The `main(argv)` of an entry point whose report takes `--targets`
    (`report_of(text)` -> Report): a checkpoint's flags checked first (`check_flags`,
    a usage error naming the flag), then `common.report_main`."""
    from absl import app, flags

    def main(argv):
        F = flags.FLAGS
        if F.checkpoint:
            try:
                check_flags(F)
            except ValueError as e:
                raise app.UsageError(str(e)) from None
        return report_main(report_of(F.targets))(argv)

    return main


def minus_and_ref(s: Setup, grid: Grid, ex: Examples, axis: str):
    """([T, B] the cell whose ID is subtracted, [T, B] the cell a target's side is read
    against): X's and Y's cells (jaxmech), the target's mirror for both (authors)."""
    T, B = len(s.targets), len(np.asarray(ex.answer_B))
    if s.protocol == "authors":
        m = np.broadcast_to(ar.mirror_cells(grid, s.targets, axis)[:, None], (T, B))
        return m, m
    cells = np.asarray(ex.spec.cells_BxK)
    return (np.broadcast_to(cells[:, 0], (T, B)), np.broadcast_to(cells[:, 1], (T, B)))


def steerable(run: LoadedRun, batch, s: Setup) -> Examples:
    """The batch's questions a protocol can steer: jaxmech's those whose X and Y cells
    are known (a photograph's: both boxes); the authors' every one (they read no box)."""
    ex = batch.examples
    if s.protocol == "authors":
        return ex
    known = (np.asarray(ex.spec.cells_BxK)[:, :2] >= 0).all(1)
    return take_examples(ex, np.flatnonzero(known))


def word_pair(view, relation: int) -> tuple[np.ndarray, tuple]:
    """(token ids [2], names) of a relation's answer words in the view's wording."""
    names = {0: ("left", "right"), 1: ("above", "below"), 4: ("front", "behind")}[relation]
    return np.asarray(view.answer_words)[relation].astype(np.int32), names


def lr_sets(run: LoadedRun, batch, s: Setup) -> list[QSet]:
    """Fig. 6's one question set: the batch's left / right questions."""
    ex = steerable(run, batch, s)
    return [QSet("left_right", ex, *word_pair(batch.view, 0), "width")]


def steer_set(run: LoadedRun, view, qs: QSet, s: Setup, delta, key: dict, log) -> dict:
    """One question set's table (`analysis.arbitrary_steering.steer_table`) through
    `view` (its batch's: a photograph's processed grid) in chunks sized by the memory
    plan, resumable, its time estimated first: {"lp": the words' log p, "sides": [T, B],
    "answer_first": [B] bool, "cells": [2, B]}."""
    ex, grid = qs.ex, view.grid
    minus, ref = minus_and_ref(s, grid, ex, qs.axis)
    n, T = len(np.asarray(ex.answer_B)), len(s.targets)
    first = int(np.min(np.asarray(ex.spans.x_B)))
    fn = ar.table_fn(view, s.sites, s.id_sites, qs.words, first, s.scale)
    secs = log_estimate(run, view, ex.inputs, n * (1 + 2 * T * resumed_share(view, run, s, ex)),
                        f"{qs.name}: {n} questions x {T} targets x {len(s.sites)} layers x 2 (ID, "
                        "noise), a steered run counted as the share of LM blocks and rows it runs",
                        log)  # fmt: skip
    at = remembered(ar.compile_at(fn, run.params, delta, ex, s.targets, minus))
    rows, plan = rows_per_call(run, at, n, log, secs)
    store = table_store(run, "arbitrary_steering", questions=qs.name, sites=list(s.sites),
                        id_sites=list(s.id_sites), targets=s.targets.tolist(), scale=s.scale,
                        **key)  # fmt: skip
    lp = ar.steer_table(view, run.params, delta, ex, qs.words, s.sites, s.id_sites, s.targets,
                        minus, s.scale, batch=rows, progress=chunk_progress(log, rows),
                        store=store, plan=plan, fn=fn, compiled=at.program)  # fmt: skip
    return {
        "lp": lp,
        "sides": sides_of(qs, grid, s.targets, ref),
        "answer_first": np.asarray(ex.answer_B) == qs.words[0],
        "cells": np.asarray(ex.spec.cells_BxK)[:, :2].T,
    }


def sides_of(qs: QSet, grid: Grid, targets, ref_TxB) -> np.ndarray:
    """[T, B] the answer each target implies: the set's own `sides`, else its side of
    the reference cells along the set's axis (`analysis.arbitrary_steering.target_sides`)."""
    if qs.sides is None:
        return ar.target_sides(grid, targets, ref_TxB, qs.axis)
    return qs.sides(grid, targets, qs.ex)


def resumed_share(view, run: LoadedRun, s: Setup, ex: Examples) -> float:
    """The whole forwards one question's steered runs at every site of `s` cost: a view
    with `forward_from` resumes at the site from the first X word (the LM's blocks
    after it over the rows from there; an over-count by the ViT's share, which does not
    run); without it every run is whole."""
    if view.forward_from is None:
        return float(len(s.sites))
    n = view.n_lm_blocks(model_outline(run.params))
    S = np.asarray(ex.spans.question_BxS).shape[1]
    rows = (S - int(np.min(np.asarray(ex.spans.x_B)))) / S
    return float(sum((n - y) / n for y in s.sites) * rows)


PER_QUESTION = {"lp": -1, "sides": -1, "answer_first": -1, "cells": -1}


def compute_sets(run: LoadedRun, sets_of, relations, targets=None, authors_targets=None,
                 log=print) -> dict:  # fmt: skip
    """The universal IDs (drawn probes, the authors' factorial ones under their
    protocol), then every question set `sets_of(run, batch, setup)` of each batch of
    `relations` steered (`steer_set`), joined over batches: {"lp": {set: ...}, "sides",
    "answer_first", "cells": {set: ...}, "setup", "words": {set: names}, "lines": {set:
    the cells its paper figure draws}}."""
    s = setup(run, targets, authors_targets, log)
    what = f"universal spatial IDs ({len(id_labels(run))} labels)"
    delta = ar.universal_ids(view_of(run), run.params, id_labels(run), probe_rows(run),
                             functools.partial(_call, run, what), s.protocol == "authors")  # fmt: skip
    per_set, words, lines = {}, {}, {}
    for batch in question_batches(run, relations):
        for qs in sets_of(run, batch, s):
            words[qs.name] = (qs.word_names, qs.follows_first)
            lines[qs.name] = qs.line or default_line(batch.view.grid, qs.axis)
            if not len(np.asarray(qs.ex.answer_B)):
                log(f"  {qs.name}: no question to steer here (n = 0)")
                continue
            res = steer_set(run, batch.view, qs, s, delta, batch.key, log)
            per_set.setdefault(qs.name, []).append(res)
    if not per_set:
        raise ValueError("arbitrary steering: no question to steer (n = 0): a photograph "
                         "needs both boxes under jaxmech's protocol (--protocol=authors reads none)")  # fmt: skip
    sets = {k: joined(v, PER_QUESTION) for k, v in per_set.items()}
    return {key: {k: v[key] for k, v in sets.items()} for key in PER_QUESTION} | {
        "setup": s, "words": words, "lines": lines}  # fmt: skip


def _call(run: LoadedRun, what: str, fn, args):
    return compiled_call(fn, args, what, estimate=run.subject.estimates_time)


def per_question(res: dict, name: str) -> dict:
    """{"follow": {kind: [K, Y', T, B]} (`analysis.arbitrary_steering.follows`, with
    "plain"), "shift": {kind: [K, Y', T, W, B]}} of question set `name`."""
    lp, (_, first) = res["lp"][name], res["words"][name]
    return {"follow": ar.follows(lp, res["sides"][name], first), "shift": ar.shifts(lp)}


def moved(follow: dict, kind: str) -> np.ndarray:
    """[K, Y', T, B] `follow[kind]` where the unsteered answer did not follow the
    target (NaN elsewhere): the answers steering moved onto the target's side."""
    return np.where(follow["plain"] == 0, follow[kind], np.nan)


def over_targets(x_TxB) -> np.ndarray:
    """[..., B] each question's mean over the targets counted (axis -2; NaN: none)."""
    n = np.isfinite(x_TxB).sum(-2)
    return np.where(n > 0, np.nansum(x_TxB, -2) / np.maximum(n, 1), np.nan)


def result_rows(res: dict, run: LoadedRun) -> list[dict]:
    """results.csv (module docstring): per model, question set, layer, target, kind."""
    s, w, rows = res["setup"], view_of(run).grid.w, []
    for name in res["lp"]:
        pq, (words, _) = per_question(res, name), res["words"][name]
        for k, model in enumerate(run.models):
            for y, layer in enumerate(s.layers):
                for t, cell in enumerate(s.targets):
                    for kind in KINDS:
                        f = question_ci(pq["follow"][kind][k, y, t], 0.0, 1.0)
                        m = question_ci(moved(pq["follow"], kind)[k, y, t], 0.0, 1.0)
                        row = {"model": model, "questions": name, "layer": layer,
                               "site": s.sites[y], "target_row": int(cell) // w,
                               "target_col": int(cell) % w, "kind": kind, "follow": f[0],
                               "follow_low": f[1], "follow_high": f[2], "n": f[3],
                               "moved": m[0], "moved_low": m[1], "moved_high": m[2],
                               "n_moved": m[3]}  # fmt: skip
                        for j, (order, word) in enumerate(zip(("first", "second"), words)):
                            d = question_ci(pq["shift"][kind][k, y, t, j])
                            row |= {f"{order}_word": word, f"dlogp_{order}": d[0],
                                    f"dlogp_{order}_low": d[1], f"dlogp_{order}_high": d[2]}  # fmt: skip
                        rows.append(row)
    return rows


def summarise_sets(res: dict, run: LoadedRun, log) -> dict:
    """Per question set and layer: the share of answers following the target over every
    target (ID, noise, and unsteered), and of those moved, 95% intervals."""
    s, out = res["setup"], {}
    log(f"\narbitrary steering ({PROTOCOL_WORDS[s.protocol]}: scale {s.scale:g}, "
        f"{len(s.targets)} target cells); the share of answers on the target's side")  # fmt: skip
    for name in res["lp"]:
        pq = per_question(res, name)
        for y, layer in enumerate(s.layers):
            cells = {k: cell_interval(over_targets(pq["follow"][k][:, y]), 0.0, 1.0)
                     for k in ("id", "noise", "plain")}  # fmt: skip
            cells |= {f"moved_{k}": cell_interval(over_targets(moved(pq["follow"], k)[:, y]),
                                                  0.0, 1.0) for k in KINDS}  # fmt: skip
            out[f"{name}/layer {layer}"] = cells | {"site": s.sites[y]}
            log(f"{name:>10} layer {layer:>3} (resid_pre.{s.sites[y]}): "
                + "; ".join(f"{k} {fmt_interval(c, signed=False)}" for k, c in cells.items()))  # fmt: skip
    return out


def summarise(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    s = res["setup"]
    return summarise_sets(res, run, log) | {
        "protocol": s.protocol, "scale": s.scale, "layers": list(s.layers),
        "sites": list(s.sites), "targets": s.targets.tolist()}  # fmt: skip


def share_grids(res: dict, name: str, grid: Grid) -> dict:
    """{layer: [H, W] cells}: per target cell the ID steering's share following it (NaN
    where not a target), model 0's, per question."""
    s, pq = res["setup"], per_question(res, name)
    out = {}
    for y, layer in enumerate(s.layers):
        g = np.full(grid.cells, np.nan)
        for t, cell in enumerate(s.targets):
            g[cell] = question_ci(pq["follow"]["id"][0, y, t], 0.0, 1.0)[0]
        out[layer] = g.reshape(grid.h, grid.w)
    return out


def plot_shares(res: dict, run: LoadedRun, path: str, name: str = "left_right") -> str:
    """Every target cell's share of answers following it, one grid per layer."""
    from jaxmech import plots

    grids = share_grids(res, name, view_of(run).grid)
    titled = {f"layer {layer}: on the target's side": g for layer, g in grids.items()}
    title = f"{name}, ID steering ({PROTOCOL_WORDS[res['setup'].protocol]}), model 0"
    return plots.save(plots.target_share_figure(titled, title), path)


def default_line(grid: Grid, axis: str) -> tuple:
    """The cells a paper figure draws along `axis`: row 0 left to right (Fig. 6B, 6C)
    or column 0 top to bottom (Fig. 7)."""
    return tuple(range(grid.w) if axis == "width" else range(0, grid.cells, grid.w))


def figure_targets(s: Setup, line) -> list[int]:
    """The indices into `s.targets` of the cells of `line`, in its order, those steered."""
    where = {int(cell): i for i, cell in enumerate(s.targets)}
    return [where[c] for c in line if c in where]


def paper_panels(res: dict, name: str, grid: Grid, split: bool) -> list:
    """Rows (one per layer) of (title, {curve: [T', 4] cells}, {control: [T', 4]}) of
    each word's change of log p per figure target (`figure_targets` of the set's line);
    `split`: a panel per unsteered truth (Fig. 6B's "Original: left" / "right")."""
    s, pq = res["setup"], per_question(res, name)
    (words, _), idx = res["words"][name], figure_targets(s, res["lines"][name])
    truth = np.asarray(res["answer_first"][name])
    groups = [(f"Original: {words[0]}", truth), (f"Original: {words[1]}", ~truth)] if split else [("", np.ones_like(truth))]  # fmt: skip
    rows = []
    for y, layer in enumerate(s.layers):
        row = []
        for title, keep in groups:
            cell = lambda kind, j: [question_ci(pq["shift"][kind][0, y, t, j][keep]) for t in idx]  # noqa: E731
            curves = {f"ΔP('{w}')": cell("id", j) for j, w in enumerate(words)}
            controls = {f"noise ΔP('{w}')": cell("noise", j) for j, w in enumerate(words)}
            row.append((f"Layer {layer} — {title or name}", curves, controls))
        rows.append(row)
    return rows, [_cell_label(int(s.targets[t]), grid) for t in idx]


def _cell_label(cell: int, grid: Grid) -> str:
    """A cell as the authors key it: (x, y), column then row."""
    return f"({cell % grid.w},{cell // grid.w})"


FIGURES = {"left_right": "Fig. 6B", "near_far": "Fig. 6C", "in_between": "Fig. 6D"}


def plot_paper(res: dict, run: LoadedRun, path: str, name: str = "left_right") -> str:
    """Fig. 6B / 6C / 6D as the paper draws it: per layer, each answer word's change of
    log p against the ID steered onto the subject along the set's line (row 0; in
    between's middle column), questions split by their true answer, 95% bands; the
    noise control dashed."""
    from jaxmech import plots

    rows, ticks = paper_panels(res, name, view_of(run).grid, split=True)
    s = res["setup"]
    title = (f"{FIGURES.get(name, name)}: arbitrary spatial steering, {name} "
             f"({PROTOCOL_WORDS[s.protocol]}, scale {s.scale:g})")  # fmt: skip
    return plots.save(plots.target_curves_figure(rows, ticks, title), path)


def check(run: LoadedRun, log=print, targets_text: str | None = None) -> None:
    """Before any compute: `--targets` on the subject's grid and `--layers` steerable."""
    parse_targets(targets_text, view_of(run).grid)
    setup(run, log=lambda *_: None)
