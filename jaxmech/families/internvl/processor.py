"""Inputs as the InternVL processor makes them (`InternVLProcessor` around the GotOcr2
image processor): tiles, pixels, the chat prompt, token spans.

Images (`tiles`, `patches`): as the reference's default, cut into tiles of `size` px
square (448; the image processor config's `size`). The InternVL processor asks for
tiles (`crop_to_patches=True`, overriding the image processor's own saved `false`):
the tile grid (cols x rows, min_patches..max_patches tiles, 1..12) whose aspect ratio
is nearest the image's (on a tie the one with more tiles while the image's area
exceeds half of theirs, `tile_grid`); the image resized to it and cut row-major, plus
a thumbnail (the whole image resized to one tile) when there is more than one tile. A
square image up to ~1.41 tiles wide is one tile (a 448 px drawn scene: one tile, so
the views' pictures are the reference's default exactly). `ImageSettings.tiles=False`
(the processor's `crop_to_patches=False`) squashes every image to one tile instead (the
view tiles photographs as the default does: `view.py`). Resizing: torchvision's
antialiased bicubic on uint8 (the reference's default processor; `data.inputs.resize`), or
Pillow's where the config names the PIL backend's class. Normalised with ImageNet's
mean / std as the torchvision backend does (`pixel_table`: mean and std scaled by 255
in float32, then (x - mean) / std; the PIL backend's order where it is the PIL one).
Each tile's patches row-major, each flattened as (C, p, p).

Text (`chat_prompt`, `encode`): the chat template of transformers' InternVL converter
(the -hf checkpoints'): no system turn; the user turn holds the image as
`<img>` + `<IMG_CONTEXT>` x (tokens per tile x tiles) + `</img>` and a newline, then
the question; the assistant's generation prompt. The checkpoint's own tokenizer.json,
rows left-padded with `<|endoftext|>` (the processor pads left).

Batches and spans: `encode.py`.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import numpy as np

from jaxmech.data.inputs import pixels, prompts
from jaxmech.data.inputs.pixels import IMAGENET_MEAN, IMAGENET_STD, read_image
from jaxmech.data.inputs.resize import resize_bicubic
from jaxmech.families import hf_vlm
from jaxmech.families.internvl.config import InternVLConfig

START, END, CONTEXT, PAD = "<img>", "</img>", "<IMG_CONTEXT>", "<|endoftext|>"
TAIL = "<|im_end|>\n<|im_start|>assistant\n"  # what follows the question


class ImageSettings(NamedTuple):
    """The image processor's settings (its config; the -hf checkpoints' values), and
    whether images are tiled (`tiles`: the InternVL processor's default)."""

    size: int = 448
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    tiles: bool = True
    min_tiles: int = 1
    max_tiles: int = 12
    resize: str = "torchvision"  # `data.inputs.resize.BACKENDS`


def image_settings(folder: str) -> ImageSettings:
    """The folder's image processor config: preprocessor_config.json (the Hub's flat
    file) or processor_config.json's "image_processor" (transformers 5's); the
    defaults where there is neither."""
    d = ImageSettings()
    flat, nested = (os.path.join(folder, n) for n in ("preprocessor_config.json",
                                                      "processor_config.json"))  # fmt: skip
    if not os.path.exists(flat) and not os.path.exists(nested):
        return d
    with open(flat if os.path.exists(flat) else nested) as f:
        raw = json.load(f)
    if not os.path.exists(flat):
        raw = raw.get("image_processor") or {}
    size = raw.get("size") or {}
    side = size.get("height", d.size) if isinstance(size, dict) else int(size)
    if isinstance(size, dict) and size.get("width", side) != side:
        raise ValueError(f"{folder}: image processor size {size}: expected square tiles")
    return ImageSettings(
        size=int(side),
        mean=tuple(raw.get("image_mean", d.mean)),
        std=tuple(raw.get("image_std", d.std)),
        min_tiles=int(raw.get("min_patches", d.min_tiles)),
        max_tiles=int(raw.get("max_patches", d.max_tiles)),
        resize="pil" if str(raw.get("image_processor_type", "")).endswith("Pil") else d.resize,
    )


def tile_grid(height: int, width: int, s: ImageSettings) -> tuple[int, int]:
    """(cols, rows) of tiles for an image of that size (module docstring); (1, 1) when
    `s.tiles` is off."""
    if not s.tiles:
        return 1, 1
    grids = sorted(((w, h) for w in range(1, s.max_tiles + 1) for h in range(1, s.max_tiles + 1)
                    if s.min_tiles <= w * h <= s.max_tiles), key=lambda g: g[0] * g[1])  # fmt: skip
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for g in grids:
        diff = abs(aspect - g[0] / g[1])
        if diff < best_diff:
            best, best_diff = g, diff
        elif diff == best_diff and area > 0.5 * s.size * s.size * g[0] * g[1]:
            best = g
    return best


def n_tiles(height: int, width: int, s: ImageSettings) -> int:
    """How many tiles an image becomes: cols x rows, plus the thumbnail if more than 1."""
    cols, rows = tile_grid(height, width, s)
    return cols * rows + (cols * rows > 1)


def _resized(x, height: int, width: int, s: ImageSettings):
    return x if x.shape[:2] == (height, width) else resize_bicubic(x, height, width, s.resize)


def tiles(image, s: ImageSettings):
    """(uint8 [T, size, size, 3] the image's tiles row-major, then the thumbnail;
    (cols, rows) of the tile grid)."""
    x = read_image(image)
    cols, rows = tile_grid(x.shape[0], x.shape[1], s)
    t = s.size
    big = _resized(x, rows * t, cols * t, s)
    out = [big[r * t : (r + 1) * t, c * t : (c + 1) * t] for r in range(rows) for c in range(cols)]
    if len(out) > 1:
        out.append(_resized(x, t, t, s))
    return np.stack(out), (cols, rows)


def pixel_table(s: ImageSettings) -> np.ndarray:
    """float32 [3, 256] the normalised value of each uint8 level: the torchvision
    backend's fused (level - 255 mean) / (255 std) in float32
    (`data.inputs.pixels.fused_pixel_table`), or the PIL backend's
    (`data.inputs.pixels.pixel_table`)."""
    if s.resize == "pil":
        return pixels.pixel_table(s.mean, s.std)
    return pixels.fused_pixel_table(s.mean, s.std)


def patches(image, s: ImageSettings, patch: int, codes: bool = False):
    """(float32 [T, P, C p p] each tile's patches, row-major, (cols, rows) of the tile
    grid); `codes`: the uint8 levels instead, a quarter of the bytes
    (`data.inputs.pixels.decode_pixels` gives the floats)."""
    x, grid = tiles(image, s)
    T, n = len(x), s.size // patch
    x = x.transpose(0, 3, 1, 2).reshape(T, 3, n, patch, n, patch).transpose(0, 2, 4, 1, 3, 5)
    x = np.ascontiguousarray(x.reshape(T, n * n, 3 * patch * patch))
    return (x if codes else pixel_table(s)[np.arange(x.shape[-1]) // patch**2, x]), grid


def chat_prompt(question: str, n_image: int | None = 1) -> str:
    """The -hf chat template for one image of `n_image` tokens (None: no image, the
    text-only prompt) then `question`, ready for the answer."""
    image = "" if n_image is None else f"{START}{CONTEXT * n_image}{END}\n"
    return f"<|im_start|>user\n{image}{question}{TAIL}"


class Processor(NamedTuple):
    """A checkpoint's tokenizer (`tokenizers.Tokenizer`), image settings and config."""

    tokenizer: Any
    images: ImageSettings
    config: InternVLConfig


def load_processor(folder: str, config: InternVLConfig, resize: str | None = None,
                   tiles: bool | None = None) -> Processor:  # fmt: skip
    """The folder's tokenizer.json and image processor config; errors name the path.
    `resize`: how images are resized (`data.inputs.resize.BACKENDS`; None: as the config's
    processor class does). `tiles`: tile images (None: the reference's default, yes)."""
    tok, path = prompts.read_tokenizer(folder)
    prompts.check_token_id(tok, path, CONTEXT, config.image_token_id, "image_token_id")
    for t in (START, END):
        if tok.token_to_id(t) is None:
            raise ValueError(f"{path}: no {t} token")
    images = image_settings(folder)
    images = hf_vlm.with_resize(images, resize)
    if tiles is not None:
        images = images._replace(tiles=bool(tiles))
    check_settings(images, config)
    return Processor(tok, images, config)


def check_settings(s: ImageSettings, c: InternVLConfig) -> None:
    """Tiles of whole patches, an even number per side (the pixel shuffle's 2 x 2)."""
    if s.size % c.patch_size or (s.size // c.patch_size) % 2:
        raise ValueError(f"image processor size = {s.size}: expected an even number of "
                         f"patches of {c.patch_size} px per side")  # fmt: skip
