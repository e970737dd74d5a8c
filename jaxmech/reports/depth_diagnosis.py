"""Paper 003's depth diagnosis (Fig. 7) on a real checkpoint: is depth read as height?

The above / below questions are steered with height IDs (`reports.target_steering`,
along the height: a target's side is above or below) and read twice: asked above or
below ("height"), and the same pictures asked in front of or behind ("depth",
`batches.PHOTO_TEMPLATES`' wording). The paper's finding: steering the subject up
raises "above" and "behind" alike, down "below" and "front" (a VLM has no depth of its
own: higher in the image reads as farther away).

Read per question and layer: the share of answers on the target's side (for depth:
"behind" for a target above, "front" below), and the contrast, the mean change of the
belief for targets above minus for targets below (height: log p(above) - log p(below);
depth: log p(behind) - log p(front)), each against norm-matched noise, 95% intervals
over the questions. Depth is read as height where the depth contrast's interval lies
above 0.

Protocols: jaxmech's steers X's ID to every cell (`Delta(t) - Delta(X's cell)`) at
every steered site; the authors' (`depth_diagnosis/depth_diagnosis.py`): the targets
(0, j) of column 0, `5 x (Delta_L(t) - Delta_L(t's mirror across the height))` at the
output of block L for their layers 12, 13, 14 (scaled to the LM's depth), their
prompt's words read as the view's wording reads them.

Writes into OUT/depth_diagnosis/: results.csv (as arbitrary steering's, question sets
"height" and "depth"), summary.json, depth_diagnosis.png (the shares per target cell)
and depth_diagnosis_paper.png (Fig. 7: change of log p per target down column 0).
Drawn scenes only: a photograph's question cannot be re-asked in another wording here.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxmech.data.inputs import pictures
from jaxmech.families.vlm_view import Examples, relation_words
from jaxmech.reports import target_steering as arb
from jaxmech.reports.batches import PHOTO_TEMPLATES
from jaxmech.reports.common import (
    EXAMPLES,
    LoadedRun,
    Report,
    cell_interval,
    declared,
    fmt_interval,
    protocol_of,
    view_of,
)

DEPTH = 4  # front / behind (`batches.PHOTO_RELATIONS`)


def depth_examples(view, ex: Examples, wording: str) -> Examples:
    """The pictures of `ex` (drawn above / below questions) asked in front of or behind
    instead, in `wording`; its answer words are front / behind's (no truth: the
    pictures have no depth)."""
    templates = list(pictures.AUTHORS_TEMPLATES if wording == "authors" else pictures.TEMPLATES)
    templates[1] = PHOTO_TEMPLATES[wording][DEPTH]
    inputs, spans = view.render_images(
        *pictures.asked(view.grid, ex.spec, view.size, templates=tuple(templates))
    )
    words = np.asarray(view.answer_words)[DEPTH]
    n = len(np.asarray(ex.answer_B))
    return Examples(ex.spec, inputs, spans, np.full(n, words[0]), np.full(n, words[1]))


def depth_sets(run: LoadedRun, batch, s) -> list:
    """Fig. 7's two question sets: the above / below questions, and the same pictures
    asked front / behind (a target above implies "behind", the second word)."""
    ex = arb.steerable(run, batch, s)
    depth = depth_examples(batch.view, ex, protocol_of(run))
    return [
        arb.QSet("height", ex, *arb.word_pair(batch.view, 1), "height"),
        arb.QSet("depth", depth, *arb.word_pair(batch.view, DEPTH), "height", False),
    ]


def authors_targets(grid) -> np.ndarray:
    """Their targets (0, j): column 0, rows top to bottom."""
    return np.arange(0, grid.cells, grid.w, dtype=np.int32)


def contrast(res: dict, name: str, kind: str) -> np.ndarray:
    """[K, Y', B] per question the mean change of the belief (the first word's log p
    minus the second's; depth's negated: behind - front) over targets above minus
    over targets below (NaN where a question has none on one side)."""
    shift = arb.per_question(res, name)["shift"][kind]  # [K, Y', T, W, B]
    belief = shift[..., 0, :] - shift[..., 1, :]
    if not res["words"][name][1]:
        belief = -belief
    sides = np.asarray(res["sides"][name])  # [T, B]
    mean = lambda side: arb.over_targets(np.where(sides == side, belief, np.nan))  # noqa: E731
    return mean(1) - mean(-1)


def verdict(cell) -> str:
    """Whether the depth contrast's interval says depth is read as height."""
    m, lo, hi, n = cell
    if n == 0:
        return "not measured (n = 0)"
    if lo > 0:
        return "yes: steered up reads 'behind', down 'front' (95% CI above 0)"
    if hi < 0:
        return "no: the opposite of the paper's (95% CI below 0)"
    return "undecided (95% CI spans 0)"


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    s, out = res["setup"], arb.summarise_sets(res, run, log)
    log("\nthe contrast: change of belief for targets above minus below (height: above - "
        "below, depth: behind - front)")  # fmt: skip
    for y, layer in enumerate(s.layers):
        cells = {f"{name}_{kind}": cell_interval(contrast(res, name, kind)[:, y])
                 for name in ("height", "depth") for kind in arb.KINDS}  # fmt: skip
        said = verdict(cells["depth_id"])
        out[f"contrast/layer {layer}"] = cells | {"depth_read_as_height": said}
        log(f"layer {layer:>3}: " + "; ".join(f"{k} {fmt_interval(c)}" for k, c in cells.items()))
        log(f"layer {layer:>3}: depth read as height? {said}")
    return out | {"protocol": s.protocol, "scale": s.scale, "layers": list(s.layers),
                  "sites": list(s.sites), "targets": s.targets.tolist()}  # fmt: skip


def plot_paper(res: dict, run: LoadedRun, path: str) -> str:
    """Fig. 7 as the paper draws it: per layer, the change of log p of 'above' / 'below'
    and of 'front' / 'behind' against the ID steered onto the subject down column 0,
    95% bands; the noise control dashed."""
    from jaxmech import plots

    grid = view_of(run).grid
    (height, ticks), (depth, _) = (
        arb.paper_panels(res, n, grid, False) for n in ("height", "depth")
    )
    rows = [h + d for h, d in zip(height, depth)]
    s = res["setup"]
    title = f"Depth diagnosis ({arb.PROTOCOL_WORDS[s.protocol]}, scale {s.scale:g})"
    return plots.save(plots.target_curves_figure(rows, ticks, title), path)


def refusal(config, path: str) -> str | None:
    """A results folder has no depth words: the report is a checkpoint's."""
    hint = "the depth diagnosis asks front / behind, words a toy VLM has not: use --checkpoint"
    return declared("depth_diagnosis", hint)(config, path)


def check(run: LoadedRun, log=print, targets_text: str | None = None) -> None:
    """Before any compute: the view renders pictures with any question and tells front
    from behind (`vlm_view.relation_words`), and the flags (`arbitrary_steering.check`)."""
    view = view_of(run)
    if view.render_images is None:
        raise ValueError(f"{view.name}: its view cannot ask a picture front / behind")
    first, why = relation_words(view, DEPTH)
    if first is None:
        raise ValueError(f"depth diagnosis: {why}")
    arb.check(run, log, targets_text)


def report(targets_text: str | None = None) -> Report:
    """The report with `--targets` (None: every cell; the authors' column 0)."""

    def compute(run):
        grid = view_of(run).grid
        return arb.compute_sets(run, depth_sets, (1,), arb.parse_targets(targets_text, grid),
                                authors_targets(grid))  # fmt: skip

    return Report(
        folder="depth_diagnosis",
        refusal=refusal,
        compute=compute,
        tables=lambda res, run: {"results": arb.result_rows(res, run)},
        summarise=_summary,
        plot=lambda res, tables, run, path: [
            arb.plot_shares(res, run, path, "depth"),
            plot_paper(res, run, path.replace(".png", "_paper.png")),
        ],
        figure="depth_diagnosis.png",
        check=functools.partial(check, targets_text=targets_text),
        examples=EXAMPLES,
        per_model=("lp",),
    )


REPORT = report()
