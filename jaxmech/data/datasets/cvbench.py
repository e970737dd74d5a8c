"""CV-Bench's 2D relation task (Cambrian-1; published at huggingface.co/datasets/
nyu-visionx/CV-Bench), read from the user's copy: `test_2d.jsonl` (images under the
folder at each row's `filename`, e.g. `img/2D/relation/coco_203.png`) or
`test_2d.parquet` (the image embedded in each row's `image`). Rows whose `task` is
"Relation" only (650 in the published file).

Each row: `question` in one of two wordings, with the red box ("Considering the relative
positions of the book (annotated by the red box) and the couch in the image provided,
where is the book (annotated by the red box) located with respect to the couch?") or
without it ("Considering the relative positions of the bottle and the wine glass in the
image provided, where is the bottle located with respect to the wine glass?"); `choices`
(two words: left / right or above / below), `answer` ("(A)" or "(B)"). The question
keeps the benchmark's wording; its answers are the right choice and the other; X and Y
are read from the question, from its asked clause ("where is the X located with respect
to the Y?") where it has one, else from "the relative positions of the X and the Y" (a
row that names no object pair is refused). Where the
wording names a red box, it is drawn into the pixels, so an image mirror flips it too.
The sample counts the rows of each wording (`boxed`, `unboxed`).

`bbox` (list[list[float]] in the parquet schema) is read as the boxes of X then Y, each
[x1, y1, x2, y2] corners in the image's pixels, turned into the questions' [x, y, w, h];
one box is X's alone (Y's unknown), none / null / [] no boxes. What was verified: the
schema (list of float lists, REFERENCE.md's CV-Bench section) and, on a CV-Bench 3D
record quoted in github.com/haoningwu3639/SpatialScore issue 3, four pixel numbers per
box whose third and fourth exceed the first and second by a box's size (corners, not
width / height: x + w would pass the image's edge). Not verified (no card, loader or
evaluation code states it): the corner order on the 2D Relation rows, and which box is
whose (that issue reports a 3D record whose list order does not follow the question's
colours). So X, Y in list order is an assumption: the sample checks it on every file,
counting the rows whose two box centres put X on the answer's side of Y
(`bbox_order_agrees`) and those that put it on the other (`bbox_order_disagrees`); a
box whose corners are not [x1, y1, x2, y2] with x2 > x1, y2 > y1, or a row with more
than two boxes, is refused naming the file, the record and the field. Paper 004's
post-hoc "object order reversed vs kept" (`reports.counterfactuals`) does not depend on
which box is X's (swapping both swaps the plain order and every random order alike).
"""

from __future__ import annotations

import os
import re

from jaxmech.data.datasets import questions as q

FILES = ("test_2d.jsonl", "test_2d.parquet")
RED_BOX = " (annotated by the red box)"
# X (the red box's object where the wording names one) and Y of either wording
_OBJECTS = re.compile(
    r"relative positions of the (?P<x>.+?)(?P<box> \(annotated by the red box\))? and the "
    r"(?P<y>.+?) in the image",
    re.IGNORECASE,
)
# the asked clause names X and Y in the order the answer is about; the leading "relative
# positions of A and B" need not list them in that order (a third-party parser of
# CV-Bench reports it does not always), so the asked clause wins where it matches
_ASKED = re.compile(
    r"where is the (?P<x>.+?)(?: \(annotated by the red box\))? located with respect to "
    r"the (?P<y>.+?)\?",
    re.IGNORECASE,
)


def load(folder: str, n=None, seed: int = 0) -> q.QuestionSet:
    path = q.first_file(folder, FILES, "CV-Bench 2D file")
    rows = _parquet_rows(path) if path.endswith(".parquet") else q.read_jsonl(path)
    out = [_question(folder, r, where) for r, where in rows if r.get("task") == "Relation"]
    boxed = sum(RED_BOX in x.question.lower() for x in out)
    chosen = q.sample(out, n, seed)
    return q.QuestionSet("cvbench", tuple(chosen), {path: q.sha256(path)},
                         {"rows": len(rows), "relation": len(out), "boxed": boxed,
                          "unboxed": len(out) - boxed, **box_counts(out),
                          **q.drawn(n, len(out), chosen, seed)})  # fmt: skip


def _parquet_rows(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path)
    # rows counted from 1, as a JSON-lines file's lines and a JSON list's records
    return [(r, f"{path}: row {i + 1}") for i, r in enumerate(table.to_pylist())]


def _question(folder: str, r: dict, where: str) -> q.ImageQuestion:
    question = q.text_field(r, "question", where)
    choices = q.pair_field(r, "choices", where)
    answer = r.get("answer")
    if answer not in ("(A)", "(B)"):
        raise q.record_error(where, "answer", f'expected "(A)" or "(B)", got {answer!r}')
    k = "AB".index(answer[1])
    m = _ASKED.search(question) or _OBJECTS.search(question)
    if m is None:
        raise q.record_error(where, "question", "names no object pair (the relation template)")
    right = choices[k].strip().lower()
    return q.ImageQuestion(_image(folder, r, where), question, (right, choices[1 - k].strip().lower()),
                           (m["x"], m["y"]), right, _boxes(r.get("bbox"), where), where)  # fmt: skip


def _boxes(value, where: str):
    """A row's `bbox` ([[x1, y1, x2, y2] of X, of Y], or X's alone) as the questions'
    ([x, y, w, h] of X, of Y or None); None where the row has no box (module docstring)."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if not isinstance(value, (list, tuple)) or len(value) > 2:
        why = f"expected one or two [x1, y1, x2, y2] boxes, got {value!r}"
        raise q.record_error(where, "bbox", why)
    out = []
    for box in value:
        ok = isinstance(box, (list, tuple)) and len(box) == 4
        if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
            raise q.record_error(where, "bbox", f"expected [x1, y1, x2, y2] numbers, got {box!r}")
        x1, y1, x2, y2 = (float(v) for v in box)
        if x2 <= x1 or y2 <= y1:
            why = f"expected x2 > x1 and y2 > y1 ([x1, y1, x2, y2]), got {box!r}"
            raise q.record_error(where, "bbox", why)
        out.append((x1, y1, x2 - x1, y2 - y1))
    return (out[0], out[1] if len(out) == 2 else None)


# the answer word -> (axis of the box centres, X's centre below Y's on it)
_SIDE = {"left": (0, True), "right": (0, False), "above": (1, True), "below": (1, False)}


def box_counts(questions) -> dict:
    """What the sample says of the boxes read: rows with both, X's only, none, and of
    those with both whose centres differ on the answer's axis, how many put X on the
    answer's side of Y in list order (the X-then-Y assumption holds) and how many not."""
    both = [x for x in questions if x.boxes and x.boxes[1] is not None]
    agree = disagree = 0
    for x in both:
        axis, less = _SIDE.get(x.relation, (None, None))
        if axis is None:
            continue
        cx, cy = (b[axis] + b[axis + 2] / 2 for b in x.boxes)
        if cx != cy:
            agree, disagree = agree + ((cx < cy) == less), disagree + ((cx < cy) != less)
    return {"bbox_both": len(both), "bbox_x_only": sum(bool(x.boxes) for x in questions) - len(both),
            "bbox_none": sum(not x.boxes for x in questions), "bbox_order_agrees": agree,
            "bbox_order_disagrees": disagree, "bbox_reading": BBOX_READING}  # fmt: skip


# said in the sample (so in the log line of the questions read): the reading is assumed
BBOX_READING = ("assumed, not stated by the card: [x1, y1, x2, y2] pixels, X's box then Y's; "
                "bbox_order_agrees / _disagrees check the order against the answers")  # fmt: skip


def _image(folder: str, r: dict, where: str):
    """The row's image: its file under `folder`, else the bytes a parquet row embeds."""
    name = r.get("filename")
    if isinstance(name, str) and name:
        for path in (
            os.path.join(folder, name),
            os.path.join(folder, "img", "2D", "relation", name),
        ):
            if os.path.isfile(path):
                return path
    image = r.get("image")
    if isinstance(image, dict) and isinstance(image.get("bytes"), bytes):
        return image["bytes"]
    if isinstance(name, str) and name:
        raise ValueError(f"{os.path.join(folder, name)}: no such image (of {where})")
    raise q.record_error(where, "filename", "expected an image file name or embedded image bytes")
