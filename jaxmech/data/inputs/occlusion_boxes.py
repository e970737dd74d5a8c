"""The boxes and images of paper 003's occlusion experiment (Fig. 8B, the authors'
`ground_truth_deviation/coco_blur.py` with `coco_blur.sh`'s radius 20), as pure
functions of a COCO instances file's contents and a photograph's pixels.

* `category_boxes`: every instance box of an object in an image, found by its *exact*
  COCO category name (their `getCatIds(catNms=[name])[0]`; the COCO-Spatial loader's
  boxes match by substring and keep only the first instance).
* `pick_pair`: X's and Y's box among all instances of their categories: the pair whose
  centres agree best with the asked relation (the largest signed gap along its axis;
  the first such pair, X-major), their `_pick_pair_by_relation`.
* `boxes_elsewhere`: `n` boxes of X's size at uniform places that meet neither X's nor
  Y's box (touching edges allowed), from at most `tries` draws; too few: the found ones
  repeated at random; none: one at (0, 0) where the box fits the image, else none.
  Drawn from the `rng` given: theirs come from Python's `random` seeded with
  `hash((X, Y, relation))`, a per-process string hash (PYTHONHASHSEED), which no other
  program can repeat, so `occlusion_images` takes the boxes as an argument.
* `occlusion_images`: [original, X blurred, each box elsewhere blurred]. Their blurred
  images pass through a float tensor and back (`to_tensor`, `to_pil`: level / 255 *
  255 in float32, truncated), which gives every uint8 level back (checked on all 256
  with torchvision 0.29), so nothing is done for it here.

Boxes are COCO's [x, y, w, h] in pixels; pixels uint8 [H, W, 3] RGB.
"""

from __future__ import annotations

import numpy as np

from jaxmech.data.inputs.image_twins import BLUR_RADIUS, occluded

N_ELSEWHERE = 10  # their `n=10`
TRIES = 500  # their `max_tries=500`
RELATIONS = ("left", "right", "above", "below")


def category_boxes(coco: dict, image_id: int, name: str) -> list:
    """[[x, y, w, h], ...] the boxes of the image's instances of the first category
    named exactly `name`, in the file's order (annotations without a box left out);
    [] where no category or no instance has that name."""
    ids = [c["id"] for c in coco["categories"] if c["name"] == name]
    if not ids:
        return []
    return [list(a["bbox"]) for a in coco["annotations"]
            if a["image_id"] == image_id and a["category_id"] == ids[0] and a.get("bbox")]  # fmt: skip


def _centre(box) -> tuple[float, float]:
    return box[0] + box[2] / 2.0, box[1] + box[3] / 2.0


def pick_pair(x_boxes, y_boxes, relation: str) -> tuple[list, list]:
    """(X's box, Y's box): the pair of instances whose centres best fit `relation`
    (module docstring). ValueError naming the empty list or the relation."""
    if relation not in RELATIONS:
        raise ValueError(f"relation = {relation!r}: expected one of {', '.join(RELATIONS)}")
    for name, boxes in (("x_boxes", x_boxes), ("y_boxes", y_boxes)):
        if not len(boxes):
            raise ValueError(f"{name}: no instance to choose from")
    axis, sign = {"left": (0, 1), "right": (0, -1), "above": (1, 1), "below": (1, -1)}[relation]
    best, best_gap = None, -np.inf
    for a in x_boxes:
        for b in y_boxes:
            gap = sign * (_centre(b)[axis] - _centre(a)[axis])
            if gap > best_gap:  # strictly: the first best pair is kept
                best, best_gap = (list(a), list(b)), gap
    return best


def meets(a, b) -> bool:
    """Whether boxes a and b overlap (sharing an edge is not meeting)."""
    return not (a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1]
                or b[1] + b[3] <= a[1])  # fmt: skip


def boxes_elsewhere(box, forbidden, width: int, height: int, rng: np.random.Generator,
                    n: int = N_ELSEWHERE, tries: int = TRIES) -> np.ndarray:  # fmt: skip
    """int [N, 4] boxes of `box`'s (rounded) size meeting none of `forbidden` (module
    docstring); N is `n`, 1 where none was found but the box fits (at (0, 0)), 0 where
    it does not fit."""
    if n < 1 or tries < 1:
        raise ValueError(f"n = {n}, tries = {tries}: expected positive counts")
    bw, bh = int(round(box[2])), int(round(box[3]))
    found = []
    for _ in range(tries):
        if len(found) == n:
            break
        x = int(rng.integers(0, max(0, width - bw) + 1))
        y = int(rng.integers(0, max(0, height - bh) + 1))
        if not any(meets((x, y, bw, bh), f) for f in forbidden):
            found.append((x, y, bw, bh))
    if found:
        found += [found[int(rng.integers(len(found)))] for _ in range(n - len(found))]
    elif width >= bw and height >= bh:
        found = [(0, 0, bw, bh)]
    return np.asarray(found, np.int64).reshape(-1, 4)


def occlusion_images(pixels: np.ndarray, x_box, elsewhere, radius: float = BLUR_RADIUS) -> list:
    """[original, X's box blurred, each of `elsewhere` blurred]: uint8 [H, W, 3] each."""
    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"pixels: expected uint8 [H, W, 3], got {pixels.dtype} {pixels.shape}")
    return [pixels] + [occluded(pixels, b, "blur", radius) for b in [x_box, *elsewhere]]
