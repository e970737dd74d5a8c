"""Questions about images: what a dataset's loader yields, whatever its layout on disk.

A question source is one module under `data/` with `load(folder, n=None, seed=0) ->
QuestionSet`, registered by name in `SOURCES` (the one place that lists them):

  coco_spatial   paper 003's COCO-Spatial (`data.datasets.coco_spatial`): left / right, 100 drawn
  coco_spatial_all  the same file's every left / right and above / below row, with
                 COCO's boxes (the population the authors' steering asks,
                 `adversarial_steering.sh`; `whatsup_coco` has no boxes)
  whatsup_a      What'sUp, Controlled A (`data.datasets.whatsup`)
  whatsup_b      What'sUp, Controlled B
  whatsup_coco   What'sUp's COCO two-object triples, every relation
  whatsup_vg     What'sUp's Visual Genome two-object triples
  cvbench        CV-Bench's 2D relation task (`data.datasets.cvbench`)
  manifest       anyone's own images, one JSON question per line (`data.datasets.manifest`)

A loader reads the user's copy of the published files (nothing is downloaded), checks
every record before any model is touched (a malformed record: a ValueError naming the
file, the line and the field; a missing image: its path), and records the sha256 of
each file it read and the sample it drew, so a results folder can say what it asked.
Records are counted from 1 in every message: a JSON-lines file's line, a JSON list's or
a parquet file's record ("file: record 3", "file: row 3").

`n` is the most questions asked: a folder with fewer gives them all, its `sample`
saying how many were asked for and found.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from typing import Any, NamedTuple

# source name -> (module, keyword arguments of its `load`)
SOURCES = {
    "coco_spatial": ("jaxmech.data.datasets.coco_spatial", {}),
    "coco_spatial_all": ("jaxmech.data.datasets.coco_spatial", {"relations": "all"}),
    "whatsup_a": ("jaxmech.data.datasets.whatsup", {"subset": "a"}),
    "whatsup_b": ("jaxmech.data.datasets.whatsup", {"subset": "b"}),
    "whatsup_coco": ("jaxmech.data.datasets.whatsup", {"subset": "coco"}),
    "whatsup_vg": ("jaxmech.data.datasets.whatsup", {"subset": "vg"}),
    "cvbench": ("jaxmech.data.datasets.cvbench", {}),
    "manifest": ("jaxmech.data.datasets.manifest", {}),
}

# each relation word and the word of the opposite relation (the other answer)
OPPOSITE = {"left": "right", "right": "left", "above": "below", "below": "above",
            "on": "under", "under": "on", "front": "behind", "behind": "front"}  # fmt: skip


class ImageQuestion(NamedTuple):
    """One question about one image.

    image: a file path, or the image file's bytes (a parquet row that embeds it).
    question: the benchmark's own wording, or None (worded by the report's template from
      `objects` and the relation).
    answers: (the right answer word, the other one), e.g. ("left", "right").
    objects: (X, Y): the object the question is about and the reference object.
    relation: the right answer's relation word (a key of `OPPOSITE` for the datasets;
      any word for a manifest).
    boxes: ([x, y, w, h] of X, of Y) in the image's pixels (None: not known; an entry
      None: that object's box not known).
    where: "file:line" (or "file: record N" in a JSON list) of the record, for messages.
    """

    image: Any
    question: str | None
    answers: tuple[str, str]
    objects: tuple[str, str]
    relation: str
    boxes: tuple | None
    where: str


class QuestionSet(NamedTuple):
    """A source's questions, with what they were read from: `files` {path: sha256} and
    `sample` (how they were drawn: counts, seed, what was skipped and why)."""

    source: str
    questions: tuple[ImageQuestion, ...]
    files: dict
    sample: dict


# `--protocol`: whose protocol a checkpoint's tables follow (the papers' authors' scripts
# or jaxmech's); it picks a sample's seed (`sample_seed`) and a picture's wording
PROTOCOLS = ("jaxmech", "authors")

# the seed of a dataset's sample under `--protocol=authors`: the authors' scripts call
# `random.seed(42)` before `random.sample` (`mirror_swapping.py` 33, 196)
AUTHORS_SEED = 42


def sample_seed(seed: int | None, protocol: str) -> int:
    """The seed a dataset's sample is drawn from: `seed` where given, else the
    protocol's (the authors' 42, jaxmech's 0)."""
    if seed is not None:
        return seed
    return AUTHORS_SEED if protocol == "authors" else 0


def load_questions(source: str, folder: str, n: int | None = None, seed: int = 0):
    """The `QuestionSet` of `source` (a key of `SOURCES`) read from `folder`: at most `n`
    questions (None: the source's default, every one or COCO-Spatial's 100; a seeded
    sample where the source draws one)."""
    if source not in SOURCES:
        raise ValueError(f"questions_from = {source!r}: expected one of {', '.join(SOURCES)}")
    if not os.path.isdir(folder):
        raise ValueError(f"data = {folder!r}: not a folder")
    if n is not None and n < 1:
        raise ValueError(f"n = {n}: expected a positive number of questions (or None: all)")
    module, kwargs = SOURCES[source]
    return importlib.import_module(module).load(folder, n=n, seed=seed, **kwargs)


def record_error(where: str, field: str, problem: str) -> ValueError:
    """The error of one malformed record: `where` is "file:line"."""
    return ValueError(f"{where}: field {field!r}: {problem}")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def require_file(path: str, what: str) -> str:
    """`path`, or a ValueError naming it and what it should have been."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file ({what})")
    return path


def first_file(folder: str, names: tuple[str, ...], what: str) -> str:
    """The first of `names` (relative to `folder`) that exists; else an error naming all."""
    for name in names:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    tried = ", ".join(os.path.join(folder, n) for n in names)
    raise ValueError(f"no {what} in {folder!r} (looked for {tried})")


def read_jsonl(path: str) -> list[tuple[dict, str]]:
    """[(record, "file:line")] of a JSON-lines file (blank lines skipped); a line that is
    not a JSON object is an error naming the file and the line."""
    import json

    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}:{i + 1}"
            try:
                r = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(r, dict):
                raise record_error(where, "record", f"expected an object, got {r!r}")
            rows.append((r, where))
    return rows


def text_field(record: dict, field: str, where: str) -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        raise record_error(where, field, f"expected a non-empty string, got {value!r}")
    return value


def pair_field(record: dict, field: str, where: str) -> tuple[str, str]:
    value = record.get(field)
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, str) and v.strip() for v in value):
        raise record_error(where, field, f"expected two non-empty strings, got {value!r}")
    return (value[0], value[1])


def box_value(value, where: str, field: str):
    """[x, y, w, h] as floats (w, h > 0), or None for None."""
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and len(value) == 4
    if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise record_error(where, field, f"expected [x, y, w, h] numbers, got {value!r}")
    if value[2] <= 0 or value[3] <= 0:
        raise record_error(where, field, f"expected a positive width and height, got {value!r}")
    return tuple(float(v) for v in value)


def sample(items: list, n: int | None, seed: int) -> list:
    """At most `n` of `items` drawn without replacement by `random.Random(seed)` (their
    order kept as drawn; fewer than `n` exist: every one, in the order drawn), or all
    of them in file order for n None. `random.Random(seed).sample(items, n)` picks the
    positions `random.seed(seed); random.sample(range(len(items)), n)` does (the
    authors' draw)."""
    import random

    if n is None:
        return list(items)
    return random.Random(seed).sample(list(items), min(n, len(items)))


def drawn(n: int | None, found: int, chosen: list, seed: int) -> dict:
    """What a sample records of its draw: `n` asked (None: all), `found` candidates, the
    questions `chosen`, the seed; where fewer were found than asked, a line saying so."""
    out = {"asked": n, "found": found, "n": len(chosen), "seed": seed}
    if n is not None and found < n:
        out["fewer"] = f"{n} asked, {found} found: every one taken"
    return out
