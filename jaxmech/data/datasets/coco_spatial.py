"""COCO-Spatial as paper 003 builds it: What'sUp's two-object COCO triples
(`coco_qa_two_obj.json`, images `val2017/{id:012d}.jpg`; `data.datasets.whatsup`) whose caption
says "to the left of" / "to the right of", a seeded sample of `n` (100 by default, as
the authors' `random.sample` in `mirror_swapping.py`; here `random.Random(seed).sample`,
which draws the same positions), each object's box from COCO's `instances_val2017.json`
(under `annotations/` or in the folder itself; published at cocodataset.org): the first
annotation of the image whose category name contains the object's name, `bbox` = [x, y,
w, h] in pixels (None where no category matches).

`relations="all"` (the source `coco_spatial_all`): every row of the file whose caption
says left / right or above / below, in file order (no sample unless `n` is given): what
the authors' steering asks (`adversarial_steering.sh` runs `adversarial_steering.py` on
the whole file; their corner steering reads no box).

The folder: `coco_qa_two_obj.json`, `val2017/`, `annotations/instances_val2017.json`.
"""

from __future__ import annotations

import json

from jaxmech.data.datasets import questions as q
from jaxmech.data.datasets import whatsup

DEFAULT_N = 100  # the paper's 100 questions
INSTANCES = ("annotations/instances_val2017.json", "instances_val2017.json")
# `relations` -> the relation words kept ("all": the two relations of the authors'
# captions, `utils/coco.py`'s `extract_subject_object`, which refuses any other)
RELATIONS = {"left_right": ("left", "right"), "all": ("left", "right", "above", "below")}


def load(folder: str, n=None, seed: int = 0, relations: str = "left_right") -> q.QuestionSet:
    """At most `n` questions (None: 100 of `relations="left_right"`, every one of
    "all") of the relations `relations` ("left_right": paper 003's COCO-Spatial; "all":
    every row, as the authors' steering)."""
    if relations not in RELATIONS:
        raise ValueError(f"relations = {relations!r}: expected one of {', '.join(RELATIONS)}")
    rows, path, skipped = whatsup.read_triples(folder, "coco")
    words = RELATIONS[relations]
    lr = [r for r in rows if r[3] in words]
    if n is None and relations == "left_right":
        n = DEFAULT_N
    chosen = q.sample(lr, n, seed)
    ann_path = q.first_file(folder, INSTANCES, "COCO instances file")
    boxes = box_finder(ann_path)
    out = tuple(
        q.ImageQuestion(
            image,
            None,
            (rel, q.OPPOSITE[rel]),
            (x, y),
            rel,
            (boxes(image_id, x), boxes(image_id, y)),
            where,
        )  # fmt: skip
        for image_id, image, x, rel, y, where in chosen
    )
    missing = sum(b is None for qu in out for b in qu.boxes)
    files = {path: q.sha256(path), ann_path: q.sha256(ann_path)}
    kept = {r: sum(x[3] == r for x in lr) for r in ("left", "right", "above", "below")}
    name = "coco_spatial" if relations == "left_right" else "coco_spatial_all"
    return q.QuestionSet(name, out, files, {
        "records": len(rows) + skipped, "skipped": skipped, "relations": relations,
        "by_relation": {r: k for r, k in kept.items() if k},
        **q.drawn(n, len(lr), chosen, seed), "boxes_missing": missing})  # fmt: skip


def box_finder(path: str):
    """`boxes(image_id, name)`: the [x, y, w, h] of the first annotation of the image
    whose category name contains `name` (None if none does); the file checked first."""
    try:
        with open(path) as f:
            coco = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    for key in ("annotations", "categories"):
        if not isinstance(coco, dict) or not isinstance(coco.get(key), list):
            raise ValueError(f"{path}: field {key!r}: expected a list (a COCO instances file)")
    names = {}
    for i, c in enumerate(coco["categories"]):
        if not isinstance(c, dict) or "id" not in c or not isinstance(c.get("name"), str):
            raise q.record_error(f"{path}: category {i + 1}", "name", f"expected id and name, got {c!r}")  # fmt: skip
        names[c["id"]] = c["name"]
    by_image = {}
    for i, a in enumerate(coco["annotations"]):
        where = f"{path}: annotation {i + 1}"  # counted from 1, as every record
        if not isinstance(a, dict) or a.get("category_id") not in names:
            raise q.record_error(where, "category_id", f"not a category of the file: {a!r}")
        box = q.box_value(a.get("bbox"), where, "bbox")
        by_image.setdefault(a.get("image_id"), []).append((names[a["category_id"]], box))

    def boxes(image_id, name):
        found = [b for cat, b in by_image.get(image_id, ()) if name.lower() in cat.lower()]
        return found[0] if found else None

    return boxes
