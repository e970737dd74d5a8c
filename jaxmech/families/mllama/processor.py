"""Inputs as the reference's `MllamaProcessor` makes them: tiles, aspect-ratio ids and
masks, the chat prompt and the cross-attention mask.

Images (`tiled`), as `MllamaImageProcessor` (tiles of `size` px, up to
`max_image_tiles`):

* the canvas: among every (rows, cols) arrangement with rows x cols <= max tiles, the
  one whose scale min(canvas_h / h, canvas_w / w) is the smallest at or above 1 (an
  upscale), else the largest below 1; ties to the smallest area;
* the image resized to fit that canvas keeping its aspect ratio: each side clipped to
  [tile, canvas] first, the side that scales less kept, the other floor(side x its
  scale) (so a 20 x 25 image in a 28 px tile becomes 22 x 28, a small image is enlarged
  to reach the tile at one side only);
* padded to the canvas with level 0 (bottom and right), cut into rows x cols tiles,
  row-major; normalised ((level / 255 - mean) / std, as a table per uint8 level); the
  tiles past rows x cols are 0 (after normalisation);
* aspect-ratio id: 1 + the arrangement's index (`config.aspect_ratios`), the mask the
  first rows x cols tiles.

The resize is Pillow's bilinear on uint8 (the reference's PIL backend,
`MllamaImageProcessorPil`, which wrote the fixtures); the reference's default
torchvision backend resizes with torchvision's antialiased bilinear, which differs by a
level in some values (not reproduced: a gap).

Text (`encode`): the published Llama-3.2-11B-Vision-Instruct chat template's output
for one user turn holding the image then the question, with no system turn (the
template writes none when the conversation has an image):
"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n<|image|>{question}
<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n" (reproduced here, not read
from a file). The text-only prompt (`encode_text`) is the same turn without `<|image|>`
(the published template would add a dated system turn there: not reproduced). Tokenized
without added special tokens (the template writes `<|begin_of_text|>`, as the model
card's `processor(..., add_special_tokens=False)`); rows left-padded with
`<|finetune_right_pad_id|>`. The cross-attention mask: every token from the
`<|image|>` token on may read the image's tiles; the tokens before it none.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple

import numpy as np

from jaxmech.data.inputs import prompts
from jaxmech.data.inputs.pixels import CLIP_MEAN, CLIP_STD, pixel_table, read_image
from jaxmech.families import hf_vlm
from jaxmech.families.mllama.config import MllamaConfig, aspect_ratios
from jaxmech.families.mllama.model import Inputs
from jaxmech.models.positions import text_ids

IMAGE, PAD, BOS = "<|image|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>"
HEAD = "<|start_header_id|>{role}<|end_header_id|>\n\n"
TAIL = "<|eot_id|>" + HEAD.format(role="assistant")


class ImageSettings(NamedTuple):
    """The image processor's settings (`preprocessor_config.json`)."""

    size: int = 560
    max_tiles: int = 4
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD


def image_settings(folder: str, c: MllamaConfig) -> ImageSettings:
    """The folder's preprocessor_config.json, or the published defaults at `c`'s tile."""
    path = os.path.join(folder, "preprocessor_config.json")
    raw = {}
    if os.path.exists(path):
        with open(path) as f:
            raw = json.load(f)
    size = raw.get("size") or {"height": c.image_size, "width": c.image_size}
    if size.get("height") != size.get("width"):
        raise ValueError(f"{path}: size = {size}, expected a square tile")
    s = ImageSettings(int(size["height"]), int(raw.get("max_image_tiles", c.max_tiles)),
                      tuple(raw.get("image_mean", CLIP_MEAN)), tuple(raw.get("image_std", CLIP_STD)))  # fmt: skip
    if (s.size, s.max_tiles) != (c.image_size, c.max_tiles):
        raise ValueError(f"{path}: tiles of {s.size} px, at most {s.max_tiles}; config.json's "
                         f"vision tower reads {c.image_size} px, at most {c.max_tiles}")  # fmt: skip
    return s


def canvas(height: int, width: int, s: ImageSettings) -> tuple[int, int]:
    """(rows, cols) of tiles the image is fitted to (module docstring)."""
    best = None
    for rows, cols in aspect_ratios(s.max_tiles):
        scale = min(rows * s.size / height, cols * s.size / width)
        key = (0 if scale >= 1 else 1, scale if scale >= 1 else -scale, rows * cols)
        best = min(best or (key, (rows, cols)), (key, (rows, cols)))
    return best[1]


def fitted(height: int, width: int, rows: int, cols: int, size: int) -> tuple[int, int]:
    """(h, w) the image is resized to inside a rows x cols canvas of `size` px tiles."""
    ch, cw = rows * size, cols * size
    th, tw = min(max(height, size), ch), min(max(width, size), cw)
    sh, sw = th / height, tw / width
    if sw < sh:
        return min(math.floor(height * sw) or 1, th), tw
    return th, min(math.floor(width * sh) or 1, tw)


def tiled(image, s: ImageSettings, patch: int, one_tile: bool = False):
    """(float32 [T, P, C p p] the image's tiles as patches (T = max tiles, the missing
    ones 0), its aspect-ratio id, its tile count). `one_tile`: the image squashed to one
    tile (resized to size x size) instead, as the reports ask photographs (one patch
    grid per picture)."""
    x = read_image(image)
    rows, cols = (1, 1) if one_tile else canvas(x.shape[0], x.shape[1], s)
    h, w = (s.size, s.size) if one_tile else fitted(x.shape[0], x.shape[1], rows, cols, s.size)
    if (h, w) != x.shape[:2]:
        from PIL import Image

        x = np.asarray(Image.fromarray(x).resize((w, h), Image.BILINEAR))
    full = np.zeros((rows * s.size, cols * s.size, 3), np.uint8)
    full[:h, :w] = x
    g = s.size // patch
    t = full.reshape(rows, g, patch, cols, g, patch, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    t = t.reshape(rows * cols, g * g, 3 * patch * patch)
    vals = pixel_table(s.mean, s.std)[np.arange(t.shape[-1]) // patch**2, t]
    out = np.zeros((s.max_tiles,) + vals.shape[1:], np.float32)
    out[: rows * cols] = vals
    return out, aspect_ratios(s.max_tiles).index((rows, cols)) + 1, rows * cols


def chat_prompt(question: str, image: bool = True) -> str:
    """The chat template's one user turn (module docstring), ready for the answer."""
    return BOS + HEAD.format(role="user") + (IMAGE if image else "") + question + TAIL


class Processor(NamedTuple):
    """A checkpoint's tokenizer (`tokenizers.Tokenizer`), image settings and config."""

    tokenizer: Any
    images: ImageSettings
    config: MllamaConfig


def load_processor(folder: str, config: MllamaConfig) -> Processor:
    """The folder's tokenizer.json and preprocessor_config.json; errors name the path."""
    tok, path = prompts.read_tokenizer(folder)
    prompts.check_token_id(tok, path, IMAGE, config.image_token_id, "image_token_index")
    return Processor(tok, image_settings(folder, config), config)


class Encoded(NamedTuple):
    """A batch ready for `model.forward`, with what `spans` needs: the prompts, each
    token's character offsets [B, S, 2] (-1 at padding), the question's character range
    [B, 2], each row's tile count and the tile's patch side (0: no image)."""

    inputs: Inputs
    prompts: list
    offsets_BxSx2: np.ndarray
    question_Bx2: np.ndarray
    n_tiles: list
    grid: int

    def describe(self) -> str:
        """One line for logs."""
        S = self.inputs.tokens_BxS.shape[1]
        if not self.grid:
            return f"no image, {S} tokens"
        return f"tiles {self.n_tiles} of {self.grid} x {self.grid} patches, {S} tokens"


def encode(proc: Processor, images, questions, one_tile: bool = False) -> Encoded:
    """Images (paths, PIL images or arrays) and one question each -> an `Encoded` batch
    (`one_tile`: each image squashed to one tile, `tiled`)."""
    prompts.check_batch(images, questions)
    c = proc.config
    done = [tiled(im, proc.images, c.patch_size, one_tile) for im in images]
    pixels = np.stack([d[0] for d in done])
    return _encode(proc, pixels, np.asarray([d[1] for d in done], np.int32),
                   [d[2] for d in done], questions)  # fmt: skip


def encode_text(proc: Processor, questions) -> Encoded:
    """Questions asked without an image -> an `Encoded` batch with no tiles: the
    authors' text-only baseline."""
    prompts.check_batch(None, questions)
    c = proc.config
    pixels = np.zeros((len(questions), 0, c.n_patches, c.patch_features), np.float32)
    return _encode(proc, pixels, np.zeros(len(questions), np.int32), [0] * len(questions),
                   questions)  # fmt: skip


def _encode(proc: Processor, pixels, aspect_B, n_tiles, questions) -> Encoded:
    c, T = proc.config, pixels.shape[1]
    texts, question_Bx2 = prompts.templated(questions, lambda q: chat_prompt(q, T > 0), TAIL)
    rows = hf_vlm.padded_rows(proc.tokenizer, texts, PAD)
    tokens, valid = rows.tokens_BxS, rows.valid_BxS
    B, S = tokens.shape
    where = [np.flatnonzero((row == c.image_token_id) & ok) for row, ok in zip(tokens, valid)]
    if any(len(w) != (T > 0) for w in where):
        raise ValueError(f"questions: expected {int(T > 0)} {IMAGE} token in each prompt, found "
                         f"{sorted({len(w) for w in where})} (is {IMAGE} in a question?)")  # fmt: skip
    tiles = np.arange(T)[None] < np.asarray(n_tiles)[:, None]
    xattn = np.zeros((B, S, T), bool)
    for b, w in enumerate(where):
        if len(w):
            xattn[b, w[0] :] = tiles[b]
    I = c.n_vision_tokens if T else 0  # noqa: E741
    image = np.asarray([np.full(I, w[0] if len(w) else 0) for w in where], np.int32).reshape(B, I)
    inputs = Inputs(tokens, pixels, aspect_B, tiles, xattn, image, text_ids(valid), valid)
    return Encoded(inputs, texts, rows.offsets_BxSx2, question_Bx2, list(n_tiles),
                   c.grid if T else 0)  # fmt: skip
