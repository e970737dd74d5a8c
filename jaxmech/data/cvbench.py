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
are read from the question (a row that names no object pair is refused). Where the
wording names a red box, it is drawn into the pixels, so an image mirror flips it too.
The sample counts the rows of each wording (`boxed`, `unboxed`). Its `bbox` column is
not read (its layout is not stated by the card).
"""

from __future__ import annotations

import os
import re

from jaxmech.data import questions as q

FILES = ("test_2d.jsonl", "test_2d.parquet")
RED_BOX = " (annotated by the red box)"
# X (the red box's object where the wording names one) and Y of either wording
_OBJECTS = re.compile(
    r"relative positions of the (?P<x>.+?)(?P<box> \(annotated by the red box\))? and the "
    r"(?P<y>.+?) in the image",
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
                          "unboxed": len(out) - boxed,
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
    m = _OBJECTS.search(question)
    if m is None:
        raise q.record_error(where, "question", "names no object pair (the relation template)")
    right = choices[k].strip().lower()
    return q.ImageQuestion(_image(folder, r, where), question, (right, choices[1 - k].strip().lower()),
                           (m["x"], m["y"]), right, None, where)  # fmt: skip


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
