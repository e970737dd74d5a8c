"""Twins of a photograph's question as image transforms (the drawn scenes' twins are
`data.spec`'s): the mirror, and the recolour control.

* `mirror_twin`: a left / right question gets the image flipped across its width, an
  above / below question the image flipped across its height; the answer swaps and the
  boxes flip with the pixels (so does anything drawn into them, e.g. CV-Bench's red box).
  A relation a flip does not swap (on / under, in front of / behind) gets no mirror
  twin: `(None, reason)`.
* `recolour_twin`: the authors' control (paper 003, `mirror_attr_swapping/
  attribute_swapping.py`, `recolor_with_random_rainbow`): each pixel's hue mixed, at
  `strength` 0.75, with a random rainbow gradient (a random direction, 0.8-2.5 cycles
  across the image, a random phase), saturation x 1.1, brightness kept; layout, names and
  answer unchanged. The draws come from the `rng` given (the authors' from NumPy's global
  state, unseeded), so a seed fixes the twin; or they are given (`draws`).

Pixels are uint8 [H, W, 3] RGB (`open_image`).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from jaxmech.data.datasets.questions import OPPOSITE, ImageQuestion

FLIP_AXIS = {"left": 1, "right": 1, "above": 0, "below": 0}  # width: axis 1, height: 0


def open_image(image) -> np.ndarray:
    """uint8 [H, W, 3] RGB of a path or an image file's bytes."""
    with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as im:
        return np.asarray(im.convert("RGB"))


def _flip_box(box, axis: int, w: int, h: int):
    if box is None:
        return None
    x, y, bw, bh = box
    return (w - x - bw, y, bw, bh) if axis == 1 else (x, h - y - bh, bw, bh)


def mirror_twin(question: ImageQuestion, pixels: np.ndarray):
    """(pixels, question) of the mirrored image, or (None, why) where a flip does not
    swap the relation."""
    axis = FLIP_AXIS.get(question.relation)
    if axis is None:
        return None, f"relation {question.relation!r}: a flip does not swap it (no mirror twin)"
    h, w = pixels.shape[:2]
    boxes = question.boxes and tuple(_flip_box(b, axis, w, h) for b in question.boxes)
    twin = question._replace(answers=question.answers[::-1], relation=OPPOSITE[question.relation],
                             boxes=boxes)  # fmt: skip
    return np.ascontiguousarray(np.flip(pixels, axis)), twin


RAINBOW_RANGES = ((0.0, 2 * np.pi), (0.8, 2.5), (0.0, 1.0))  # theta, freq, phase: theirs


def recolour_twin(question: ImageQuestion, pixels: np.ndarray, rng: np.random.Generator,
                  strength: float = 0.75, sat_boost: float = 1.1, draws=None):  # fmt: skip
    """(pixels, question): the rainbow-recoloured image, the question unchanged.
    `draws`: (theta, freq, phase) given instead of drawn from `rng` (the authors' are
    unseeded: a test injects the ones their run recorded); each must lie in its range
    (`RAINBOW_RANGES`)."""
    h, w = pixels.shape[:2]
    if draws is None:
        draws = [rng.uniform(lo, hi) for lo, hi in RAINBOW_RANGES]
    elif len(draws) != 3 or not all(lo <= v <= hi for v, (lo, hi) in zip(draws, RAINBOW_RANGES)):
        raise ValueError(
            f"draws = {draws!r}: expected (theta, freq, phase) within {RAINBOW_RANGES}"
        )
    theta, freq, phase = (float(v) for v in draws)
    gx, gy = np.meshgrid(
        np.linspace(0, 1, w, dtype=np.float32), np.linspace(0, 1, h, dtype=np.float32)
    )
    u = np.cos(theta) * gx + np.sin(theta) * gy
    u = (u - u.min()) / max(1e-8, float(u.max() - u.min()))
    hsv = np.asarray(Image.fromarray(pixels).convert("HSV"), np.float32) / 255.0
    hue = (1 - strength) * hsv[..., 0] + strength * ((u * freq + phase) % 1.0)
    sat = np.clip(hsv[..., 1] * sat_boost, 0, 1)
    out = np.stack([np.clip(hue, 0, 1), sat, hsv[..., 2]], -1)
    recoloured = Image.fromarray((out * 255).astype(np.uint8), "HSV").convert("RGB")
    return np.asarray(recoloured), question


OCCLUDE_KINDS = ("blur", "fill")
# the authors' radius in image pixels: `coco_blur.sh` runs `coco_blur.py` with
# `--blur_radius 20` (the script's own default, 15, is not what their figure used)
BLUR_RADIUS = 20


def occluded(pixels: np.ndarray, box, kind: str = "blur", radius: float = BLUR_RADIUS):
    """uint8 [H, W, 3] `pixels` with box [x, y, w, h] hidden: Gaussian-blurred inside
    (`radius` px, the authors' occlusion) or filled with the image's mean colour
    ("fill"). The box is rounded and clipped to the image as the authors' script does."""
    if kind not in OCCLUDE_KINDS:
        raise ValueError(f"occlusion = {kind!r}: expected one of {', '.join(OCCLUDE_KINDS)}")
    H, W = pixels.shape[:2]
    x, y, w, h = (int(round(v)) for v in box)
    x, y = max(0, min(x, W - 1)), max(0, min(y, H - 1))
    w, h = max(1, min(w, W - x)), max(1, min(h, H - y))
    out = pixels.copy()
    if kind == "fill":
        out[y : y + h, x : x + w] = np.round(pixels.reshape(-1, 3).mean(0)).astype(np.uint8)
        return out
    from PIL import ImageFilter

    patch = Image.fromarray(pixels[y : y + h, x : x + w]).filter(ImageFilter.GaussianBlur(radius))
    out[y : y + h, x : x + w] = np.asarray(patch)
    return out


def box_elsewhere(box, width: int, height: int, rng: np.random.Generator, tries: int = 1000):
    """A box of `box`'s size at a uniform place in the image that does not meet `box`
    (the authors' off-target control; where none fits in `tries` draws, the corner
    farthest from it)."""
    bw, bh = int(round(box[2])), int(round(box[3]))
    x0, y0 = box[0], box[1]
    for _ in range(tries):
        x, y = (
            int(rng.integers(0, max(0, width - bw) + 1)),
            int(rng.integers(0, max(0, height - bh) + 1)),
        )
        if x + bw <= x0 or x0 + box[2] <= x or y + bh <= y0 or y0 + box[3] <= y:
            return (float(x), float(y), float(bw), float(bh))
    far_x = 0 if x0 + box[2] / 2 > width / 2 else max(0, width - bw)
    far_y = 0 if y0 + box[3] / 2 > height / 2 else max(0, height - bh)
    return (float(far_x), float(far_y), float(bw), float(bh))
