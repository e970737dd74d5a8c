"""What'sUp (Kamath, Hessel and Chang, EMNLP 2023; published with the code at
github.com/amitakamath/whatsup_vlms, files from its Google Drive links), read from the
user's copy of its `data/` folder.

* Controlled A / B (`controlled_images_dataset.json`, `controlled_clevr_dataset.json`):
  a JSON list of `{"image_path": "data/controlled_images/<x>_<prep>_<y>.jpeg",
  "caption_options": [4 captions]}`, the first caption the right one. The relation is
  read from the file name as the dataset's own loader does: `left_of`, `right_of`,
  `_on_`, else `under` (A); `left_of`, `right_of`, `in-front_of`, else `behind` (B). X
  is the name's first token, Y its last. Images resolve against the folder given, with
  or without the leading `data/`.
* The two-object COCO and Visual Genome triples (`coco_qa_two_obj.json`,
  `vg_qa_two_obj.json`): a JSON list of `[image_id, true_caption, false_caption]`, images
  `val2017/{image_id:012d}.jpg` and `vg_images/{image_id}.jpg`. A caption reads "A photo
  of a dog to the left of a person"; a record whose relation is none of `RELATION_TEXT`
  is skipped and counted (`sample["skipped"]`), a record of another shape refused.

Questions carry no wording of their own (`question` None): a report words them from the
objects and the relation. The answers are the relation word and its opposite
(`questions.OPPOSITE`): left / right, on / under, front / behind, above / below.
"""

from __future__ import annotations

import json
import os
import re

from jaxmech.data.datasets import questions as q

CONTROLLED = {"a": "controlled_images_dataset.json", "b": "controlled_clevr_dataset.json"}
TRIPLES = {"coco": ("coco_qa_two_obj.json", "val2017/{:012d}.jpg"),
           "vg": ("vg_qa_two_obj.json", "vg_images/{}.jpg")}  # fmt: skip
# a caption's relation phrase -> the relation word
RELATION_TEXT = {"to the left of": "left", "to the right of": "right", "above": "above",
                 "below": "below", "in front of": "front", "behind": "behind",
                 "on top of": "on", "on": "on", "under": "under"}  # fmt: skip
_CAPTION = re.compile(
    r"^a photo of (?:an? |the )?(?P<x>.+?) (?P<rel>"
    + "|".join(sorted(map(re.escape, RELATION_TEXT), key=len, reverse=True))
    + r") (?:an? |the )?(?P<y>.+?)\.?$",
    re.IGNORECASE,
)


def load(folder: str, n=None, seed: int = 0, subset: str = "a") -> q.QuestionSet:
    """What'sUp's `subset` ("a", "b": controlled; "coco", "vg": two-object triples)."""
    if subset in CONTROLLED:
        return _controlled(folder, n, seed, subset)
    return _triples(folder, n, seed, subset)


def read_json_list(path: str):
    """The file's JSON list, or an error naming the file."""
    try:
        with open(path) as f:
            records = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of records, got {type(records).__name__}")
    return records


def _prep(name: str, subset: str) -> str:
    if "left_of" in name:
        return "left"
    if "right_of" in name:
        return "right"
    if subset == "a":
        return "on" if "_on_" in name else "under"
    return "front" if "in-front_of" in name else "behind"


def _controlled(folder, n, seed, subset) -> q.QuestionSet:
    path = q.require_file(os.path.join(folder, CONTROLLED[subset]), f"What'sUp {subset.upper()}")
    out = []
    for i, r in enumerate(read_json_list(path)):
        where = f"{path}: record {i + 1}"  # a JSON list: its records are counted from 1
        if not isinstance(r, dict):
            raise q.record_error(where, "record", f"expected an object, got {r!r}")
        rel_path = q.text_field(r, "image_path", where)
        options = r.get("caption_options")
        if not isinstance(options, list) or len(options) != 4:
            raise q.record_error(where, "caption_options", f"expected 4 captions, got {options!r}")
        image = _resolve(folder, rel_path)
        tokens = os.path.splitext(os.path.basename(rel_path))[0].split("_")
        rel = _prep(os.path.basename(rel_path), subset)
        out.append(q.ImageQuestion(image, None, (rel, q.OPPOSITE[rel]),
                                   (tokens[0], tokens[-1]), rel, None, where))  # fmt: skip
    chosen = q.sample(out, n, seed)
    return q.QuestionSet(f"whatsup_{subset}", tuple(chosen), {path: q.sha256(path)},
                         {"records": len(out), **q.drawn(n, len(out), chosen, seed)})  # fmt: skip


def _resolve(folder: str, rel_path: str) -> str:
    """An image path of a What'sUp file: under `folder`, with or without `data/`."""
    parts = rel_path.split("/")
    tries = [os.path.join(folder, rel_path)]
    if parts[0] == "data":
        tries.append(os.path.join(folder, *parts[1:]))
    for t in tries:
        if os.path.isfile(t):
            return t
    raise ValueError(f"{tries[-1]}: no such image (record image_path {rel_path!r})")


def parse_caption(caption: str):
    """(X, relation word, Y) of a two-object caption, or None if it names no relation."""
    m = _CAPTION.match(caption.strip())
    return None if m is None else (m["x"], RELATION_TEXT[m["rel"].lower()], m["y"])


def read_triples(folder: str, subset: str):
    """([(image_id, image path, X, relation, Y, where)], path, skipped records) of the
    two-object triples of `subset` ("coco", "vg")."""
    name, image_of = TRIPLES[subset]
    path = q.require_file(os.path.join(folder, name), f"What'sUp {subset} two-object triples")
    rows, skipped = [], 0
    for i, r in enumerate(read_json_list(path)):
        where = f"{path}: record {i + 1}"
        ok = isinstance(r, list) and len(r) == 3 and isinstance(r[0], int)
        if not ok or not all(isinstance(c, str) for c in r[1:]):
            raise q.record_error(where, "record",
                                 f"expected [image_id, true_caption, false_caption], got {r!r}")  # fmt: skip
        parsed = parse_caption(r[1])
        if parsed is None:
            skipped += 1
            continue
        image = q.require_file(os.path.join(folder, image_of.format(r[0])), f"image of {where}")
        rows.append((r[0], image, *parsed, where))
    return rows, path, skipped


def _triples(folder, n, seed, subset) -> q.QuestionSet:
    rows, path, skipped = read_triples(folder, subset)
    out = [q.ImageQuestion(image, None, (rel, q.OPPOSITE[rel]), (x, y), rel, None, where)
           for _, image, x, rel, y, where in rows]  # fmt: skip
    chosen = q.sample(out, n, seed)
    return q.QuestionSet(f"whatsup_{subset}", tuple(chosen), {path: q.sha256(path)},
                         {"records": len(out) + skipped, "skipped": skipped,
                          "skipped_why": "caption names no known relation",
                          **q.drawn(n, len(out), chosen, seed)})  # fmt: skip
