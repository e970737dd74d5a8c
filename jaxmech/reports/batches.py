"""A report's questions as batches of one shape: the rendered examples and their twins.

A subject's `question_batches(run, relations, twins)` gives a list of `QuestionBatch`:
drawn scenes are one batch (every picture one size: `drawn_batch`), a dataset's
photographs one batch per processed grid (`photo_batches`), since one compiled call
holds one shape and photographs are only resized by the checkpoint's own processor.
A report runs its table on each batch and joins the per-question results
(`joined`), so its intervals are over every question whatever its size.

Twins, by name (each an `Examples` of the same shapes as the batch's, with its own
answer words):

  mirror      drawn: the spec's mirror twin (width; the height mirror for relation 1);
              a photograph: flipped across its width (left / right) or its height
              (above / below), the answer swapped (`data.inputs.image_twins.mirror_twin`)
  recolour    drawn: every object recoloured; a photograph: the authors' rainbow
              recolour (`image_twins.recolour_twin`, seeded per question), answer kept
  swap        the question with X and Y swapped (its answer swapped); a photograph's
              swapped question is worded by the template (a benchmark's own wording
              cannot be swapped in general: CV-Bench's red box marks X)
  text        a photograph's question asked without the image (`view.render_text`):
              the authors' text-only baseline of the diagnostics
  blur:W, fill:W
              a photograph with X's box (W "x"), Y's ("y") or a box of X's size
              elsewhere ("random") blurred or filled (`image_twins.occluded`)
  scene:i     the version `analysis.counterfactuals.SCENES[i]` of the scene; a
              photograph has the plain one (0), the width flip (1) and the height flip
              (2) only: `QuestionBatch.scenes` lists the versions that are real, the
              others are the plain image and a report leaves their rows out

A photograph's `Examples.spec` is descriptive, never rendered: the cells of X's and Y's
box centres on the view's grid (-1: no box), labels (1, 2), relation 0 (left / right),
1 (above / below), or a relation no drawn scene has (`PHOTO_RELATIONS`: 3 on / under,
4 front / behind; What'sUp's), asked only where a report asks for it by id and the
view's tokenizer tells its two answer words apart (`vlm_view.relation_words`). The
height flip swaps on / under as it swaps above / below (`MIRROR_AXIS`); no image flip
swaps front / behind, so it has no mirror twin.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmech.analysis.spatial_ids import authors_cell_weights
from jaxmech.data.inputs import image_twins, pictures
from jaxmech.data.spec import SceneSpec, swap_named, take
from jaxmech.families.vlm_view import Examples, VLMView, answer_ids, examples, relation_words

ALL_SCENES = (0, 1, 2, 3, 4)  # a drawn scene has every version (`counterfactuals.SCENES`)
PHOTO_SCENES = (0, 1, 2)  # a photograph: plain, flipped across its width, its height
# answer word -> relation id (0, 1 as `data.spec`; 2 is presence; 3, 4 photographs' only)
RELATION_OF = {"left": 0, "right": 0, "above": 1, "below": 1, "on": 3, "under": 3,
               "front": 4, "behind": 4}  # fmt: skip
PHOTO_RELATIONS = {3: "on_under", 4: "front_behind"}  # relations no drawn scene has
FIRST_WORD = {0: "left", 1: "above", 3: "on", 4: "front"}  # each relation's answer_words[r, 0]
# the image axis whose flip swaps a relation (1: the width, 0: the height); none swaps
# front / behind (depth is not a direction in the image plane)
MIRROR_AXIS = {0: 1, 1: 0, 3: 0}
# the answer instruction appended to a benchmark's own question, by wording and relation
INSTRUCTIONS = {
    "jaxmech": dict.fromkeys((0, 1, 3, 4), " Answer with one word."),
    "authors": {0: ' Answer "left" or "right" only.', 1: ' Answer "above" or "below" only.',
                3: ' Answer "on" or "under" only.', 4: ' Answer "front" or "behind" only.'},
}  # fmt: skip
# the photographs' relations' questions, by wording (`pictures.TEMPLATES`' style; paper
# 003's authors have none for them: theirs quote the two answers as their others do)
PHOTO_TEMPLATES = {
    "jaxmech": {3: "Is the {x} on or under the {y}? Answer with one word.",
                4: "Is the {x} in front of or behind the {y}? Answer with one word."},
    "authors": {3: 'Is the {x} on or under the {y}? Answer "on" or "under" only.',
                4: 'Is the {x} in front of or behind the {y}? Answer "front" or "behind" only.'},
}  # fmt: skip


class QuestionBatch(NamedTuple):
    """Questions of one shape (module docstring): `examples`, `twins` {name: Examples},
    `view` (the subject's, its ViT positions those of this batch's grid), `key` (what
    tells the batch apart in a chunk store; {} for the only one), `scenes` (the real
    `scene:i` versions) and `index` [B] (the questions' positions in the subject's set)."""

    examples: Examples
    twins: dict
    view: VLMView
    key: dict
    scenes: tuple
    index: np.ndarray
    cell_weights: Any = None  # [B, 2, L] X's and Y's box centres over the cells (None: drawn)


def drawn_batch(view: VLMView, specs: dict, relations, twins=()) -> QuestionBatch:
    """The one batch of drawn questions `specs` ({"examples": spec, twin: spec}) of the
    relation ids `relations`, with the named twins."""
    from jaxmech.analysis.counterfactuals import scene_versions

    asked = np.isin(np.asarray(specs["examples"].relation_B), relations)
    ex = examples(view, take(specs["examples"], asked))
    out = {}
    for t in twins:
        if t in ("mirror", "recolour"):
            spec = take(specs[t], asked)
            out[t] = Examples(spec, view.render(spec, ask=ex.spec)[0], ex.spans,
                              *answer_ids(view, spec))  # fmt: skip
        elif t == "swap":
            out[t] = examples(view, swap_named(ex.spec))
        else:
            out[t] = examples(view, scene_versions(view.grid, ex.spec)[_scene(t)])
    return QuestionBatch(ex, out, view, {}, ALL_SCENES, np.flatnonzero(asked))


def _scene(name: str) -> int:
    if not name.startswith("scene:"):
        raise ValueError(f"twin {name!r}: expected mirror, recolour, swap or scene:I")
    return int(name.split(":")[1])


def photo_relation(question) -> int | None:
    """The relation id of a photograph's question (`RELATION_OF`; None: none of them, a
    manifest's other words). Relations 3, 4 (on / under, front / behind) are asked only
    by a report that names their ids; the others ask 0, 1 and leave them out."""
    return RELATION_OF.get(question.relation)


def worded(question, relation: int, wording: str, swap: bool = False) -> str:
    """The text a photograph's question is asked in: the benchmark's own question with
    the relation's answer instruction, else (or `swap`: X and Y swapped) the pictures'
    template of `wording` over the object names."""
    x, y = question.objects[::-1] if swap else question.objects
    if question.question is None or swap:
        if relation in PHOTO_RELATIONS:
            return PHOTO_TEMPLATES[wording][relation].format(x=x, y=y)
        templates = pictures.AUTHORS_TEMPLATES if wording == "authors" else pictures.TEMPLATES
        return templates[relation].format(x=x, y=y)
    return question.question.rstrip() + INSTRUCTIONS[wording][relation]


def box_cells(view: VLMView, question, size) -> np.ndarray:
    """[2] the cells of X's and Y's box centres on the view's grid (-1: no box)."""
    h, w = size
    out = []
    for box in question.boxes or (None, None):
        if box is None:
            out.append(-1)
            continue
        cx, cy = box[0] + box[2] / 2, box[1] + box[3] / 2
        col = min(int(cx / w * view.grid.w), view.grid.w - 1)
        row = min(int(cy / h * view.grid.h), view.grid.h - 1)
        out.append(row * view.grid.w + col)
    return np.asarray(out, np.int32)


def framed(view: VLMView, question, size):
    """(question, (h, w)): the question's boxes in the pixels of the region of its
    photograph that the processed image shows (`view.image_frame`; None: the whole
    photograph, returned as it is), and that region's size; a box whose centre the
    region leaves out (a centre crop's cut sides) becomes None (no cell)."""
    if view.image_frame is None or not question.boxes:
        return question, size
    top, left, h, w = view.image_frame(*size)
    boxes = []
    for box in question.boxes:
        x, y = (None, None) if box is None else (box[0] - left, box[1] - top)
        inside = box is not None and 0 <= x + box[2] / 2 < w and 0 <= y + box[3] / 2 < h
        boxes.append([x, y, box[2], box[3]] if inside else None)
    return question._replace(boxes=tuple(boxes)), (h, w)


def true_frame(view: VLMView, question, size, wording: str):
    """(question, (h, w)) a true ID's box weights read: `framed` (the region the model
    sees); the authors' (`wording` "authors"): the whole photograph, as their
    `utils/coco.py` places a box by the image's own width and height whatever the
    processor cuts."""
    return (question, size) if wording == "authors" else framed(view, question, size)


def box_weights(view: VLMView, question, size, authors: bool) -> np.ndarray:
    """[2, L] the weights over the view's grid cells of X's and Y's box centres (zeros:
    no box), bilinear between the four nearest cells. `authors`: as paper 003's
    `utils/coco.py` (the centre at nx * W cells, floor and the next cell: a cell's own
    centre splits half to its right neighbour; at the last column / row their weights,
    `spatial_ids.authors_cell_weights`); else centred (nx * W - 0.5: a cell's centre
    weighs on that cell alone), clamped to the grid."""
    h, w = size
    gh, gw = view.grid.h, view.grid.w
    out = np.zeros((2, gh * gw), np.float32)
    for k, box in enumerate(question.boxes or (None, None)):
        if box is None:
            continue
        if authors:
            centre = ((box[0] + box[2] / 2) / w * gw, (box[1] + box[3] / 2) / h * gh)
            out[k] = authors_cell_weights(*centre, gh, gw)
            continue
        fx = (box[0] + box[2] / 2) / w * gw - 0.5
        fy = (box[1] + box[3] / 2) / h * gh - 0.5
        fx, fy = min(max(fx, 0.0), gw - 1.0), min(max(fy, 0.0), gh - 1.0)
        x0, y0 = int(np.floor(fx)), int(np.floor(fy))
        x1, y1 = min(x0 + 1, gw - 1), min(y0 + 1, gh - 1)
        wx, wy = fx - x0, fy - y0
        for (c, r), v in (((x0, y0), (1 - wx) * (1 - wy)), ((x1, y0), wx * (1 - wy)),
                          ((x0, y1), (1 - wx) * wy), ((x1, y1), wx * wy)):  # fmt: skip
            out[k, r * gw + c] += v
    return out


def photo_sizes(questions) -> list[tuple[int, int]]:
    """(height, width) of each question's image, read from its header only."""
    import io

    from PIL import Image

    sizes = []
    for q in questions:
        src = io.BytesIO(q.image) if isinstance(q.image, bytes) else q.image
        with Image.open(src) as im:
            sizes.append((im.size[1], im.size[0]))
    return sizes


def photo_batches(view: VLMView, qset, relations, twins=(), wording: str = "jaxmech",
                  seed: int = 0) -> list[QuestionBatch]:  # fmt: skip
    """The questions of QuestionSet `qset` whose relation is one of `relations`, one
    batch per processed grid (`view.image_grid`), largest first, with the named twins
    (module docstring; the recolour twin of question i drawn from (seed, i))."""
    if view.render_images is None:
        raise ValueError(f"{view.name}: its view renders drawn scenes only, not photographs")
    _check_photo_relations(view, relations, twins)
    keep = [i for i, q in enumerate(qset.questions) if photo_relation(q) in relations]
    sizes = dict(zip(keep, photo_sizes([qset.questions[i] for i in keep])))
    groups = defaultdict(list)
    for i in keep:
        groups[view.image_grid(*sizes[i])].append(i)
    order = sorted(groups, key=lambda g: (-len(groups[g]), g))
    return [_photo_batch(view.at_image_grid(g), qset, np.asarray(groups[g]), sizes, twins,
                         wording, seed, g) for g in order]  # fmt: skip


def _check_photo_relations(view: VLMView, relations, twins) -> None:
    """ValueError naming the relation where a photograph relation asked (3, 4) has no
    answer words the view can tell apart, or the mirror twin is asked of one: it is
    left / right's and above / below's (`image_twins.mirror_twin`; on / under's height
    flip is the scene version `scene:2`, front / behind has none). A report asks only
    those that pass (`readable_relations`)."""
    for r in set(relations) & set(PHOTO_RELATIONS):
        first, second_or_why = relation_words(view, r)
        if first is None:
            raise ValueError(f"relations: {PHOTO_RELATIONS[r]} asked, but {second_or_why}")
        if "mirror" in twins:
            flip = "its height flip is scene:2" if r in MIRROR_AXIS else "no image flip swaps it"
            raise ValueError(f"twins: mirror asked of {PHOTO_RELATIONS[r]}, which has no "
                             f"mirror twin ({flip})")  # fmt: skip


def readable_relations(view: VLMView, qset) -> tuple[tuple, dict]:
    """(the photograph relations (`PHOTO_RELATIONS`) that `qset` has and the view can
    read, {name: why} of those it has but cannot: their questions are left out)."""
    have = sorted({photo_relation(q) for q in qset.questions} & set(PHOTO_RELATIONS))
    words = {r: relation_words(view, r) for r in have}
    unread = {PHOTO_RELATIONS[r]: w[1] for r, w in words.items() if w[0] is None}
    return tuple(r for r in have if words[r][0] is not None), unread


def _photo_batch(view, qset, index, sizes, twins, wording, seed, grid) -> QuestionBatch:
    qs = [qset.questions[i] for i in index]
    rel = np.asarray([photo_relation(q) for q in qs], np.int32)
    pixels = [image_twins.open_image(q.image) for q in qs]
    cells = np.stack([box_cells(view, *framed(view, q, sizes[i])) for q, i in zip(qs, index)])
    spec = SceneSpec(cells, np.tile(np.int32([1, 2]), (len(qs), 1)),
                     np.tile(np.int32([1, 2]), (len(qs), 1)), np.zeros((len(qs), 2), np.int32),
                     rel)  # fmt: skip

    def asked(images, questions, swap=False):
        texts = [worded(q, r, wording, swap) for q, r in zip(questions, rel)]
        words = [q.objects[::-1] if swap else q.objects for q in questions]
        inputs, spans = view.render_images(images, texts, words)
        ans = np.asarray(view.answer_words)[rel]  # [B, 2] the relation's (first, second)
        first = np.asarray([q.answers[0] == FIRST_WORD[r] for q, r in zip(questions, rel)]) != swap
        answer, other = np.where(first, ans[:, 0], ans[:, 1]), np.where(first, ans[:, 1], ans[:, 0])
        return Examples(spec, inputs, spans, answer, other)

    ex = asked(pixels, qs)
    out = {}
    for t in twins:
        if t == "swap":
            out[t] = asked(pixels, qs, swap=True)
        elif t == "recolour":
            rngs = [np.random.default_rng([seed, 31, int(i)]) for i in index]
            out[t] = asked([image_twins.recolour_twin(q, p, g)[0] for q, p, g in
                            zip(qs, pixels, rngs)], qs)  # fmt: skip
        elif t.split(":")[0] in image_twins.OCCLUDE_KINDS:  # "blur:x", "fill:random", ...
            kind, which = t.split(":")
            out[t] = asked([_occluded(q, p, kind, which, np.random.default_rng([seed, 37, int(i)]))
                            for q, p, i in zip(qs, pixels, index)], qs)  # fmt: skip
        elif t == "text":  # the question without the image
            texts = [worded(q, r, wording) for q, r in zip(qs, rel)]
            inputs, spans = view.render_text(texts, [q.objects for q in qs])
            out[t] = ex._replace(inputs=inputs, spans=spans)
        elif t == "mirror":  # each along its own relation, the answer swapped
            pairs = [image_twins.mirror_twin(q, p) for q, p in zip(qs, pixels)]
            out[t] = asked([p for p, _ in pairs], [q for _, q in pairs])
        else:
            out[t] = _flipped(asked, qs, pixels, rel, [FLIPS.get(_scene(t))] * len(qs))
    key = {"image_grid": list(grid)}
    authors = wording == "authors"
    weights = np.stack([box_weights(view, *true_frame(view, q, sizes[i], wording), authors)
                        for q, i in zip(qs, index)])  # fmt: skip
    return QuestionBatch(ex, out, view, key, PHOTO_SCENES, index, weights)


def _occluded(question, pixels, kind: str, which: str, rng) -> np.ndarray:
    """The photograph with X's box (`which` "x"), Y's ("y") or a box of X's size that
    does not meet X's ("random") hidden (`image_twins.occluded`); as it is where that
    box is not known (such a question has no diagnostics)."""
    boxes = question.boxes or (None, None)
    box = boxes[0] if which in ("x", "random") else boxes[1]
    if box is None:
        return pixels
    if which == "random":
        box = image_twins.box_elsewhere(box, pixels.shape[1], pixels.shape[0], rng)
    return image_twins.occluded(pixels, box, kind)


FLIPS = {1: 1, 2: 0}  # scene version -> the image axis flipped (1: the width, 0: the height)


def _flipped(asked, qs, pixels, rel, axes) -> Examples:
    """The photographs flipped along `axes` (per question: 1 the width, 0 the height,
    None as is), each asked its own question, the answer swapped where the flip swaps
    its relation (`MIRROR_AXIS`: the width for left / right, the height for above /
    below and on / under, none for front / behind)."""
    images, asks = [], []
    for q, p, r, a in zip(qs, pixels, rel, axes):
        images.append(p if a is None else np.ascontiguousarray(np.flip(p, a)))
        swaps = a is not None and a == MIRROR_AXIS.get(int(r))
        asks.append(q._replace(answers=q.answers[::-1]) if swaps else q)
    return asked(images, asks)


def joined(results: list[dict], per_question) -> dict:
    """One table's results over every batch: the leaves under the keys `per_question`
    (a tuple: the questions on their last axis; or {key: axis}) concatenated, the rest
    the first batch's (the same in each: names, layers), "wall_s" summed."""
    if len(results) == 1:
        return results[0]
    axes = per_question if isinstance(per_question, dict) else dict.fromkeys(per_question, -1)
    out = dict(results[0])
    for k, axis in axes.items():
        cat = lambda *xs, a=axis: np.concatenate([np.asarray(x) for x in xs], a)  # noqa: E731
        out[k] = jax.tree_util.tree_map(cat, *(r[k] for r in results))
    if "wall_s" in out:
        out["wall_s"] = float(sum(r["wall_s"] for r in results))
    return out


def source_record(qset, folder: str) -> dict:
    """What a results folder records of a dataset: the source, the folder, each file's
    sha256 and the sample drawn."""
    return {"source": qset.source, "data": os.path.abspath(folder), "files": qset.files,
            "sample": qset.sample, "n": len(qset.questions)}  # fmt: skip
