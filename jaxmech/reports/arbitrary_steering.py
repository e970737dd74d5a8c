"""Paper 003's arbitrary spatial steering (Fig. 6) on toy VLMs or a checkpoint.

X's word is steered towards every target cell in turn (`analysis.arbitrary_steering`)
on the left / right questions, and the model's left / right belief is read: per target
cell the share of answers that follow the target (the side it lies on: of Y's cell
under jaxmech's protocol, of its own mirror under the authors'), each word's change
of log-probability, both beside a norm-matched Gaussian control; per-question 95%
intervals for a checkpoint, over models for a results folder.

Protocols (`--protocol`):

  jaxmech   X's ID replaced by the target's (`Delta(t) - Delta(X's cell)`, scale 1) at
            `lm/resid_pre.y` for every steered site y (`common.steered_sites`), every
            cell a target; a photograph's questions with both boxes.
  authors   `arbitrary_steering/batch_lr.py`: `5 x (Delta_L(t) - Delta_L(t's mirror
            across the width))` added to the output of block L (site L + 1) for their
            layers 12, 13, 14 of LLaVA-1.5-7B's 32 (scaled to the LM's depth; `--layers`
            overrides), every cell a target (their figure draws row 0), IDs from the
            factorial probes, every question.

`--sets` picks the question sets (`SETS`, comma-separated; default left_right):

  left_right  Fig. 6B: the left / right questions (drawn or a dataset's photographs).
  near_far    Fig. 6C (`batch_nearfar.py`): the left / right pictures asked "near or
              far from Y"; a target implies "near" where it touches Y's cell.
  in_between  Fig. 6D (`batch_inbetween.py`): three-object pictures (Y, Z at the top
              and bottom of the middle column) asked "X in between Y and Z"; a target
              implies "yes" inside the box Y and Z span. The authors' mirror for this
              set is across the height, as their script's.
  pair        Fig. 6A (`single_lr.py`): both words steered at once, X to the left end
              of row 1 and Y to its right end, then the reverse, at a sweep of layers
              (`reports.pair_steering`); runs alone.

Near / far and in between are a checkpoint's, on drawn scenes (`reports.
target_questions` says how they are asked and read). Every set is steered to every
cell under both protocols (their scripts loop over all 16), their layers and scale as
left / right's.

`--targets=ROW:COL,...` steers to those cells only. The machinery, shared with the
depth diagnosis (Fig. 7, `reports.depth_diagnosis`), is `reports.target_steering`.

Writes into `RUN/arbitrary_steering/` (OUT/arbitrary_steering for a checkpoint):
  results.csv   model, questions, layer, site, target_row, target_col, kind (id,
                noise), follow (the share following the target) and its interval and
                n, moved (the same among answers that did not follow it unsteered),
                first_word / second_word and each one's change of log p (dlogp_first,
                dlogp_second: steered - unsteered) with its interval
  summary.json  per question set and layer: the shares over every target, 95% intervals
  arbitrary_steering.png (every target cell's share, a grid per layer), and
  arbitrary_steering_paper.png (Fig. 6B: change of log p per target along row 0);
  near / far's and in between's as arbitrary_steering_near_far[_paper].png (Fig. 6C,
  along row 0) and arbitrary_steering_in_between[_paper].png (Fig. 6D, down the
  middle column), each split by the unsteered truth as the paper's panels are;
  pair's as arbitrary_steering_pair[_paper].png (Fig. 6A: log p of each word against
  the layer steered, after each intervention and unsteered)
"""

from __future__ import annotations

import functools
import os

import numpy as np

from jaxmech.reports import pair_steering
from jaxmech.reports import target_questions as tq
from jaxmech.reports.common import (
    EXAMPLES,
    Report,
    declared,
    needs_depth,
    protocol_of,
    view_of,
)
from jaxmech.reports.target_steering import (
    QSet,
    check,
    compute_sets,
    lr_sets,
    parse_targets,
    plot_paper,
    plot_shares,
    result_rows,
    steerable,
    summarise,
)

SETS = ("left_right", "near_far", "in_between", "pair")  # Fig. 6B, 6C, 6D, 6A


def parse_sets(text: str | None) -> tuple:
    """`--sets` (comma-separated names of `SETS`; None: left_right) as a tuple;
    ValueError naming `--sets` otherwise."""
    names = tuple(n.strip() for n in (text or "left_right").split(",") if n.strip())
    bad = [n for n in names if n not in SETS]
    if bad or not names:
        raise ValueError(f"--sets = {text!r}: expected some of {', '.join(SETS)}, comma-separated")
    if "pair" in names and len(set(names)) > 1:
        raise ValueError(f"--sets = {text!r}: pair runs alone (its layers are a sweep of "
                         "their own, its targets two interventions)")  # fmt: skip
    return tuple(dict.fromkeys(names))


def near_far_set(run, batch, s) -> QSet:
    """Fig. 6C: the left / right batch's pictures asked near or far
    (`target_questions`), the answer a target implies by its distance to Y's cell."""
    ex, wording = steerable(run, batch, s), protocol_of(run)
    words = tq.near_far_words(run.path, wording)
    ex = tq.near_far_examples(batch.view, ex.spec, wording, words)
    y = np.asarray(ex.spec.cells_BxK)[:, 1]
    sides = lambda grid, targets, _: tq.near_sides(grid, targets, y)  # noqa: E731
    names = tq.ASKED["near_far"][wording][1]
    return QSet("near_far", ex, words, (names[0].lower(), names[1].lower()), "width",
                sides=sides)  # fmt: skip


def in_between_set(run, batch, s) -> QSet:
    """Fig. 6D: as many three-object pictures as the batch has questions
    (`target_questions.between_scenes`) asked whether X is in between Y and Z; the
    figure's line the middle column, top to bottom."""
    view, n = batch.view, len(np.asarray(batch.examples.answer_B))
    seed = (getattr(run.subject, "key", None) or {}).get("seed", 0)
    spec = tq.between_scenes(view.grid, n, view.n_labels, view.n_colours, seed)
    ex = tq.between_examples(view, spec, protocol_of(run))
    cells = np.asarray(spec.cells_BxK)
    sides = lambda grid, targets, _: tq.between_sides(grid, targets, cells[:, 1], cells[:, 2])  # noqa: E731
    c, g = tq.between_column(view.grid), view.grid
    return QSet("in_between", ex, np.asarray(view.answer_words)[tq.PRESENCE], ("yes", "no"),
                "height", sides=sides, line=tuple(range(c, g.cells, g.w)))  # fmt: skip


def sets_of(names: tuple):
    """`compute_sets`' `sets_of` asking the question sets `names` of each batch."""
    build = {"near_far": lambda *a: [near_far_set(*a)],
             "in_between": lambda *a: [in_between_set(*a)], "left_right": lr_sets}  # fmt: skip
    return lambda run, batch, s: [q for n in names for q in build[n](run, batch, s)]


def refusal_of(sets: tuple):
    """Why this report does not apply to a results folder (None when it does): near /
    far and in between need a checkpoint's words and pictures."""

    def refusal(config, path: str) -> str | None:
        why = declared("arbitrary_steering")(config, path) or needs_depth(config, path)
        drawn = [n for n in sets if n in ("near_far", "in_between")]
        if why is None and drawn:
            why = (f"{path}: --sets={','.join(drawn)} asks words a toy VLM has not (its answers "
                   "are left / right, above / below, yes / no of one picture): use --checkpoint")  # fmt: skip
        return why

    return refusal


refusal = refusal_of(("left_right",))


def check_sets(run, log=print, targets_text=None, sets=("left_right",)) -> None:
    """Before any compute: the flags (`target_steering.check`); near / far and in
    between need drawn pictures the view renders with any question, in between a grid
    of 3+ rows, near / far two words the tokenizer tells apart."""
    if sets == ("pair",):
        if targets_text:
            raise ValueError("--targets: --sets=pair steers to its two interventions' cells")
        pair_steering.setup(run, log=lambda *_: None)
        return
    check(run, log, targets_text)
    if sets == ("left_right",):
        return
    view = view_of(run)
    if view.render_images is None:
        raise ValueError(f"--sets={','.join(sets)}: {view.name}'s view cannot ask a picture "
                         "another question (use --checkpoint)")  # fmt: skip
    if getattr(run.subject, "photos", None) is not None:
        raise ValueError(f"--sets={','.join(sets)}: drawn scenes only (their cells and "
                         "third object are drawn): use --questions_from=drawn")  # fmt: skip
    if "in_between" in sets:
        tq.between_scenes(view.grid, 1, view.n_labels, view.n_colours)
    if "near_far" in sets:
        tq.near_far_words(run.path, protocol_of(run))


def figure_name(name: str, paper: bool = False) -> str:
    """A set's figure: arbitrary_steering[_SET][_paper].png (left / right's unsuffixed)."""
    return ("arbitrary_steering" + ("" if name == "left_right" else f"_{name}")
            + ("_paper" if paper else "") + ".png")  # fmt: skip


def plots_of(sets: tuple):
    """Each set's two figures: shares per target cell and the paper's curves."""

    def plot(res, tables, run, path):
        folder, out = os.path.dirname(path), []
        for name in sets:
            out.append(plot_shares(res, run, os.path.join(folder, figure_name(name)), name))
            paper = os.path.join(folder, figure_name(name, True))
            if name == "pair":
                out.append(pair_steering.plot_paper(res, run, paper))
            else:
                out.append(plot_paper(res, run, paper, name))
        return out

    return plot


def report(targets_text: str | None = None, sets: tuple = ("left_right",)) -> Report:
    """The report with `--targets` (None: every cell) asking question sets `sets`."""

    def compute(run):
        if sets == ("pair",):
            return pair_steering.compute(run)
        targets = parse_targets(targets_text, view_of(run).grid)
        return compute_sets(run, sets_of(sets), (0,), targets)

    return Report(
        folder="arbitrary_steering",
        refusal=refusal_of(sets),
        compute=compute,
        tables=lambda res, run: {"results": result_rows(res, run)},
        summarise=summarise,
        plot=plots_of(sets),
        figure=figure_name(sets[0]),
        check=functools.partial(check_sets, targets_text=targets_text, sets=sets),
        examples=EXAMPLES,
        per_model=("lp",),
        photos=True,
    )


REPORT = report()
