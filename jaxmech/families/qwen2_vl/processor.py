"""Inputs as the Qwen2-VL processor makes them: pixels, the chat prompt, token spans.

Images (`patches`): resized with Pillow's bicubic filter to `smart_resize`'s size (both
sides multiples of patch x merge = 28, the pixel count within [min_pixels, max_pixels],
the aspect ratio kept; Python's round, i.e. half to even: 70 x 98 becomes 56 x 112),
rescaled by 1/255 and normalised with the checkpoint's mean and std (CLIP's by default),
the single frame repeated over the temporal patch, and flattened in merge-block patch
order (`positions`), each patch as (C, T, p, p). This is the reference's Pillow backend
(`Qwen2VLImageProcessorPil`); its default torchvision backend resizes differently by
1-4 levels of 255 (antialiasing), so the two do not agree pixel for pixel.

Text (`chat_prompt`, `encode`): the Qwen chat template for one user turn holding one
image then the question, with the default system message and the assistant's
generation prompt; `<|image_pad|>` expanded to the image's merged-token count; the
checkpoint's own `tokenizer.json` (the `tokenizers` package); rows left-padded to one
length with `<|endoftext|>`.

Spans (`spans`): where the image tokens are, with their (t, row, col) in the merged grid
and the cell of a `cells`-sized grid they fall in; each object word's last sub-token
(from the tokenizer's character offsets); the question's tokens; the answer position
(the last token, whose logits predict the first answer token).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from jaxmech.families.qwen2_vl import positions
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.families.qwen2_vl.model import Inputs
from jaxmech.families.vlm_view import Spans

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SYSTEM = "You are a helpful assistant."
IMAGE_PAD, PAD = "<|image_pad|>", "<|endoftext|>"


class ImageSettings(NamedTuple):
    """The image processor's settings (`preprocessor_config.json`; Qwen's defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD


def image_settings(folder: str) -> ImageSettings:
    """The folder's preprocessor_config.json (either key style: `min_pixels` /
    `max_pixels` or `size: {shortest_edge, longest_edge}`), or the defaults."""
    path = os.path.join(folder, "preprocessor_config.json")
    if not os.path.exists(path):
        return ImageSettings()
    with open(path) as f:
        raw = json.load(f)
    size = raw.get("size") or {}
    d = ImageSettings()
    return ImageSettings(
        min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
        max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
        patch_size=int(raw.get("patch_size", d.patch_size)),
        merge_size=int(raw.get("merge_size", d.merge_size)),
        temporal_patch_size=int(raw.get("temporal_patch_size", d.temporal_patch_size)),
        mean=tuple(raw.get("image_mean", d.mean)),
        std=tuple(raw.get("image_std", d.std)),
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """(h, w): multiples of `factor` near (height, width) with min_pixels <= h w <= max_pixels."""
    if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"image: size {height} x {width}, expected an aspect ratio of at most 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def read_image(image) -> np.ndarray:
    """uint8 [H, W, 3] RGB of a path, a PIL image or an array ([H, W, 3] uint8, or floats
    in [0, 1])."""
    if isinstance(image, (str, os.PathLike)):
        if not os.path.exists(image):
            raise ValueError(f"image = {str(image)!r}: no such file")
        with Image.open(image) as im:
            return np.asarray(im.convert("RGB"))
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    x = np.asarray(image)
    if x.ndim != 3 or x.shape[-1] != 3:
        raise ValueError(f"image: shape {x.shape}, expected [H, W, 3]")
    if x.dtype != np.uint8:
        if x.min() < 0 or x.max() > 1:
            raise ValueError("image: float values outside [0, 1]")
        x = np.rint(x * 255).astype(np.uint8)
    return x


def patches(image, s: ImageSettings):
    """(float32 [P, C T p p] the flattened patches, (1, h, w) the patch grid)."""
    x = read_image(image)
    p, m, T = s.patch_size, s.merge_size, s.temporal_patch_size
    h, w = smart_resize(x.shape[0], x.shape[1], p * m, s.min_pixels, s.max_pixels)
    x = np.asarray(Image.fromarray(x).resize((w, h), Image.BICUBIC))
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = ((x - np.asarray(s.mean, np.float32)) / np.asarray(s.std, np.float32)).transpose(2, 0, 1)
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (T, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * T * p * p)), (1, gh, gw)


def chat_prompt(question: str, system: str = SYSTEM) -> str:
    """The Qwen chat template for one image then `question`, ready for the answer."""
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|>{IMAGE_PAD}<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
    )


class Processor(NamedTuple):
    """A checkpoint's tokenizer (`tokenizers.Tokenizer`), image settings and config."""

    tokenizer: Any
    images: ImageSettings
    config: QwenVLConfig


def load_processor(folder: str, config: QwenVLConfig) -> Processor:
    """The folder's tokenizer.json and preprocessor_config.json; errors name the path."""
    from tokenizers import Tokenizer

    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint = {folder!r}: no tokenizer.json")
    tok = Tokenizer.from_file(path)
    if tok.token_to_id(IMAGE_PAD) != config.image_token_id:
        raise ValueError(
            f"{path}: {IMAGE_PAD} has id {tok.token_to_id(IMAGE_PAD)}, config.json says "
            f"image_token_id = {config.image_token_id}"
        )
    return Processor(tok, image_settings(folder), config)


class Encoded(NamedTuple):
    """A batch ready for `model.forward`, with what `spans` needs: the prompts (image pad
    expanded), each token's character offsets [B, S, 2] (-1 at padding) and the
    question's character range in each prompt [B, 2]; the patch grid (t, h, w) and
    merge size of its images."""

    inputs: Inputs
    prompts: list
    offsets_BxSx2: np.ndarray
    question_Bx2: np.ndarray
    grid: tuple
    merge: int


def _check_batch(images, questions):
    if isinstance(questions, str) or not len(questions):
        raise ValueError("questions: expected a non-empty list of strings")
    if len(images) != len(questions):
        raise ValueError(f"images: {len(images)} images for {len(questions)} questions (one each)")


def _pixels(proc: Processor, images):
    if (
        proc.images.patch_size != proc.config.patch_size
        or proc.images.merge_size != proc.config.merge_size
    ):
        raise ValueError("preprocessor_config.json: patch / merge size differ from config.json's")
    out = [patches(im, proc.images) for im in images]
    grids = {g for _, g in out}
    if len(grids) > 1:
        raise ValueError(
            f"images: they resize to different patch grids {sorted(grids)}; a batch "
            "holds images of one size"
        )
    return np.stack([p for p, _ in out]), out[0][1]


def encode(proc: Processor, images, questions) -> Encoded:
    """Images (paths, PIL images or arrays) and one question each -> an `Encoded` batch."""
    _check_batch(images, questions)
    pixels, grid = _pixels(proc, images)
    c = proc.config
    n = int(np.prod(grid)) // c.merge_size**2
    prompts, rows, spans = [], [], []
    for q in questions:
        text = chat_prompt(q).replace(IMAGE_PAD, IMAGE_PAD * n)
        enc = proc.tokenizer.encode(text, add_special_tokens=False)
        start = text.index("<|vision_end|>") + len("<|vision_end|>")
        prompts.append(text)
        rows.append((enc.ids, enc.offsets))
        spans.append((start, start + len(q)))
    S = max(len(ids) for ids, _ in rows)
    pad = proc.tokenizer.token_to_id(PAD)
    tokens = np.full((len(rows), S), pad if pad is not None else 0, np.int32)
    offsets = np.full((len(rows), S, 2), -1, np.int32)
    valid = np.zeros((len(rows), S), bool)
    for b, (ids, offs) in enumerate(rows):
        tokens[b, S - len(ids) :], offsets[b, S - len(ids) :], valid[b, S - len(ids) :] = (
            ids,
            offs,
            True,
        )
    return Encoded(
        _inputs(c, tokens, valid, pixels, grid),
        prompts,
        offsets,
        np.asarray(spans),
        grid,
        c.merge_size,
    )


def _inputs(c: QwenVLConfig, tokens, valid, pixels, grid) -> Inputs:
    B = tokens.shape[0]
    pos = positions.mrope_ids(tokens, [grid] * B, c.image_token_id, c.merge_size, valid_BxS=valid)
    image = np.stack(
        [np.flatnonzero((row == c.image_token_id) & ok) for row, ok in zip(tokens, valid)]
    )
    rows, cols, frame = positions.patch_grid(grid, c.merge_size)
    window = positions.window_ids(grid, c.merge_size, c.vit_window)

    def each(a):
        return np.broadcast_to(a, (B,) + a.shape).copy()

    return Inputs(
        tokens,
        pixels,
        pos,
        image.astype(np.int32),
        each(rows),
        each(cols),
        each(frame),
        each(window),
        valid,
    )


def _word_range(question: str, word: str) -> tuple[int, int]:
    m = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", question)
    if m is None:
        raise ValueError(f"words: {word!r} is not a word of the question {question!r}")
    return m.span()


def last_subtoken(enc: Encoded, b: int, char_range) -> int:
    """The position of the last token of row b overlapping `char_range` of its prompt."""
    lo, hi = char_range
    offs = enc.offsets_BxSx2[b]
    hit = np.flatnonzero((offs[:, 0] < hi) & (offs[:, 1] > lo))
    return int(hit[-1])


def spans(enc: Encoded, words, cells=(1, 1)) -> Spans:
    """The VLM interface's `Spans` of an encoded batch; `words` are each row's (first,
    second) object words as they appear in its question; `cells` the (rows, cols) of the
    scene grid that `cell_I` indexes (row-major)."""
    if len(words) != len(enc.prompts):
        raise ValueError(f"words: {len(words)} pairs for {len(enc.prompts)} questions")
    xy = []
    for b, pair in enumerate(words):
        q0 = int(enc.question_Bx2[b, 0])
        question = enc.prompts[b][q0 : enc.question_Bx2[b, 1]]
        xy.append([last_subtoken(enc, b, np.add(_word_range(question, w), q0)) for w in pair])
    return _spans(enc, np.asarray(xy), cells)


def _spans(enc: Encoded, xy, cells) -> Spans:
    f, r, c = positions.merged_grid(enc.grid, enc.merge)
    h, w = enc.grid[1] // enc.merge, enc.grid[2] // enc.merge
    cell = (r * cells[0] // h) * cells[1] + c * cells[1] // w
    offs = enc.offsets_BxSx2
    q = enc.question_Bx2
    question = (
        (offs[..., 0] >= q[:, None, 0])
        & (offs[..., 1] <= q[:, None, 1])
        & (offs[..., 1] > offs[..., 0])
    )
    S = offs.shape[1]
    return Spans(
        enc.inputs.image_BxI,
        np.stack([f, r, c], 1).astype(np.int32),
        cell.astype(np.int32),
        xy[:, 0].astype(np.int32),
        xy[:, 1].astype(np.int32),
        question,
        np.full(len(xy), S - 1, np.int32),
    )
