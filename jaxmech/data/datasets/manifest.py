"""Anyone's own images: a manifest, one JSON question per line (`questions.jsonl` in the
folder given, or the folder's only `*.jsonl`):

    {"image": "photos/cup.jpg", "answers": ["left", "right"], "objects": ["cup", "plate"],
     "question": "Is the cup to the left or the right of the plate?",
     "relation": "left", "boxes": [[12, 40, 30, 30], [80, 38, 60, 42]]}

`image` (relative to the manifest's folder, or absolute), `answers` (the right answer
word first) and `objects` (X, then the reference Y) are required; `question` (default:
worded by the report's template), `relation` (default: the right answer) and `boxes`
([x, y, w, h] in pixels per object; null where not known) are optional. No code needed.
"""

from __future__ import annotations

import glob
import os

from jaxmech.data.datasets import questions as q

FIELDS = ("image", "answers", "objects", "question", "relation", "boxes")


def load(folder: str, n=None, seed: int = 0) -> q.QuestionSet:
    path = _manifest(folder)
    out = [_question(os.path.dirname(path), r, where) for r, where in q.read_jsonl(path)]
    if not out:
        raise ValueError(f"{path}: no questions (n = 0)")
    chosen = q.sample(out, n, seed)
    return q.QuestionSet("manifest", tuple(chosen), {path: q.sha256(path)},
                         {"records": len(out), **q.drawn(n, len(out), chosen, seed)})  # fmt: skip


def _manifest(folder: str) -> str:
    if os.path.isfile(os.path.join(folder, "questions.jsonl")):
        return os.path.join(folder, "questions.jsonl")
    found = sorted(glob.glob(os.path.join(folder, "*.jsonl")))
    if len(found) != 1:
        raise ValueError(f"{folder!r}: expected questions.jsonl or one *.jsonl manifest, "
                         f"found {len(found)}")  # fmt: skip
    return found[0]


def _question(root: str, r: dict, where: str) -> q.ImageQuestion:
    unknown = sorted(set(r) - set(FIELDS))
    if unknown:
        raise q.record_error(
            where, unknown[0], f"not a manifest field (fields: {', '.join(FIELDS)})"
        )
    image = os.path.join(root, q.text_field(r, "image", where))
    q.require_file(image, f"image of {where}")
    answers, objects = q.pair_field(r, "answers", where), q.pair_field(r, "objects", where)
    question = r.get("question")
    if question is not None:
        question = q.text_field(r, "question", where)
    relation = q.text_field(r, "relation", where) if "relation" in r else answers[0]
    boxes = r.get("boxes")
    if boxes is not None:
        if not isinstance(boxes, list) or len(boxes) != 2:
            raise q.record_error(where, "boxes", f"expected two boxes (or null), got {boxes!r}")
        boxes = tuple(q.box_value(b, where, "boxes") for b in boxes)
    return q.ImageQuestion(image, question, answers, objects, relation, boxes, where)
