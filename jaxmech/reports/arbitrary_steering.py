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
  arbitrary_steering_paper.png (Fig. 6B: change of log p per target along row 0)
"""

from __future__ import annotations

import functools

from jaxmech.reports.common import EXAMPLES, Report, declared, needs_depth, view_of
from jaxmech.reports.target_steering import (
    check,
    compute_sets,
    lr_sets,
    parse_targets,
    plot_paper,
    plot_shares,
    result_rows,
    summarise,
)


def refusal(config, path: str) -> str | None:
    """Why this report does not apply to a run (None when it does)."""
    return declared("arbitrary_steering")(config, path) or needs_depth(config, path)


def report(targets_text: str | None = None) -> Report:
    """The report with `--targets` (None: every cell)."""

    def compute(run):
        targets = parse_targets(targets_text, view_of(run).grid)
        return compute_sets(run, lr_sets, (0,), targets)

    return Report(
        folder="arbitrary_steering",
        refusal=refusal,
        compute=compute,
        tables=lambda res, run: {"results": result_rows(res, run)},
        summarise=summarise,
        plot=lambda res, tables, run, path: [
            plot_shares(res, run, path),
            plot_paper(res, run, path.replace(".png", "_paper.png")),
        ],
        figure="arbitrary_steering.png",
        check=functools.partial(check, targets_text=targets_text),
        examples=EXAMPLES,
        per_model=("lp",),
        photos=True,
    )


REPORT = report()
