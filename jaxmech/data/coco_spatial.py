"""COCO-Spatial as paper 003 builds it: What'sUp's two-object COCO triples
(`coco_qa_two_obj.json`, images `val2017/{id:012d}.jpg`; `data.whatsup`) whose caption
says "to the left of" / "to the right of", a seeded sample of `n` (100 by default, as
the authors' `random.sample`; here `random.Random(seed).sample`), each object's box from
COCO's `instances_val2017.json` (under `annotations/` or in the folder itself; published
at cocodataset.org): the first annotation of the image whose category name contains the
object's name, `bbox` = [x, y, w, h] in pixels (None where no category matches).

The folder: `coco_qa_two_obj.json`, `val2017/`, `annotations/instances_val2017.json`.
"""

from __future__ import annotations

import json

from jaxmech.data import questions as q
from jaxmech.data import whatsup

DEFAULT_N = 100  # the paper's 100 questions
INSTANCES = ("annotations/instances_val2017.json", "instances_val2017.json")


def load(folder: str, n=None, seed: int = 0) -> q.QuestionSet:
    rows, path, skipped = whatsup.read_triples(folder, "coco")
    lr = [r for r in rows if r[3] in ("left", "right")]
    chosen = q.sample(lr, DEFAULT_N if n is None else n, seed, f"{path} (left / right)")
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
    return q.QuestionSet("coco_spatial", out, files, {
        "records": len(rows) + skipped, "left_right": len(lr), "n": len(out), "seed": seed,
        "boxes_missing": missing})  # fmt: skip


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
            raise q.record_error(f"{path}: categories[{i}]", "name", f"expected id and name, got {c!r}")  # fmt: skip
        names[c["id"]] = c["name"]
    by_image = {}
    for i, a in enumerate(coco["annotations"]):
        where = f"{path}: annotations[{i}]"
        if not isinstance(a, dict) or a.get("category_id") not in names:
            raise q.record_error(where, "category_id", f"not a category of the file: {a!r}")
        box = q.box_value(a.get("bbox"), where, "bbox")
        by_image.setdefault(a.get("image_id"), []).append((names[a["category_id"]], box))

    def boxes(image_id, name):
        found = [b for cat, b in by_image.get(image_id, ()) if name.lower() in cat.lower()]
        return found[0] if found else None

    return boxes
