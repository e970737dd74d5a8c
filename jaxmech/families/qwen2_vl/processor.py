"""Inputs as the Qwen2-VL processor makes them: pixels, the chat prompt, token spans.

Images (`patches`): resized to `smart_resize`'s size (both sides multiples of patch x
merge = 28, the pixel count within [min_pixels, max_pixels], the aspect ratio kept;
Python's round, i.e. half to even: 70 x 98 becomes 56 x 112) as the reference's default
processor does (torchvision's antialiased bicubic on uint8, `data.inputs.resize`; equal level
for level), or with Pillow's bicubic where the config names the PIL backend's class
(`Qwen2VLImageProcessorPil`; `ImageSettings.resize`), rescaled by 1/255 and normalised
with the checkpoint's mean and std (CLIP's by default), the single frame repeated over
the temporal patch, and flattened in merge-block patch order (`positions`), each patch
as (C, T, p, p).

Text (`chat_prompt`, `encode`): the Qwen chat template for one user turn holding one
image then the question, with the default system message (Qwen2 / 2.5-VL's; Qwen3-VL's
template adds none: `QwenVLConfig.chat_system`) and the assistant's generation prompt;
`<|image_pad|>` expanded to the image's merged-token count; the checkpoint's own
`tokenizer.json` (the `tokenizers` package); rows left-padded to one length with
`<|endoftext|>`.

Videos (`encode_video`): Qwen2 / 2.5-VL's one vision block of every frame's tokens, or
Qwen3-VL's (`QwenVLConfig.video_timestamps`) one block per temporal patch, each after
its timestamp "<t seconds>" (t the mean of its frames' times, one decimal), whose
M-RoPE ids are those of an image each (the text between them counts on); Qwen3-VL's
video processor also counts the frames in its pixel budget (`video_smart_resize`).

Spans (`spans`): where the image tokens are, with their (t, row, col) in the merged grid
and the cell of a `cells`-sized grid they fall in; each object word's last sub-token
(from the tokenizer's character offsets); the question's tokens; the answer position
(the last token, whose logits predict the first answer token).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple

import numpy as np

from jaxmech.data.inputs import pixels, prompts
from jaxmech.data.inputs.pixels import CLIP_MEAN, CLIP_STD, read_image
from jaxmech.data.inputs.resize import resize_bicubic
from jaxmech.families import hf_vlm
from jaxmech.families.qwen2_vl import positions
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.families.qwen2_vl.model import Inputs
from jaxmech.families.vlm_view import Spans

SYSTEM = "You are a helpful assistant."
TAIL = "<|im_end|>\n<|im_start|>assistant\n"  # what follows the question
IMAGE_PAD, VIDEO_PAD, PAD = "<|image_pad|>", "<|video_pad|>", "<|endoftext|>"


class ImageSettings(NamedTuple):
    """The image processor's settings (`preprocessor_config.json`; Qwen's defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    # how a photograph is resized (`data.inputs.resize.BACKENDS`): the reference's default
    # processor's torchvision, or its PIL backend's where the config names that class
    resize: str = "torchvision"
    # a video's pixel budget counts its frames (Qwen3-VL's video processor)
    frames_in_budget: bool = False


# the video processor's defaults (its frames' pixel bounds differ from an image's)
VIDEO_DEFAULTS = ImageSettings(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)


def image_settings(folder: str, video: bool = False) -> ImageSettings:
    """The folder's preprocessor_config.json (either key style: `min_pixels` /
    `max_pixels` or `size: {shortest_edge, longest_edge}`), or the defaults. `video`:
    the video processor's, from video_preprocessor_config.json where there is one,
    else preprocessor_config.json (as the reference falls back), else its defaults."""
    d = VIDEO_DEFAULTS if video else ImageSettings()
    names = ("video_preprocessor_config.json",) * video + ("preprocessor_config.json",)
    paths = [os.path.join(folder, n) for n in names if os.path.exists(os.path.join(folder, n))]
    if not paths:
        return d
    with open(paths[0]) as f:
        raw = json.load(f)
    size = raw.get("size") or {}
    return ImageSettings(
        min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
        max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
        patch_size=int(raw.get("patch_size", d.patch_size)),
        merge_size=int(raw.get("merge_size", d.merge_size)),
        resize="pil" if str(raw.get("image_processor_type", "")).endswith("Pil") else d.resize,
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


def video_smart_resize(frames: int, height: int, width: int, s: ImageSettings):
    """(h, w) Qwen3-VL's video processor resizes `frames` frames of height x width to:
    `smart_resize`'s rounding, with the budget [min_pixels, max_pixels] over every frame
    (their count rounded to the temporal patch), small frames first scaled up."""
    factor, T = s.patch_size * s.merge_size, s.temporal_patch_size
    if frames < T:
        raise ValueError(f"video: {frames} frame(s), expected at least {T} (the temporal patch)")
    if min(height, width) < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"video: frames of {height} x {width}, expected an aspect ratio <= 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / T) * T
    if t * h * w > s.max_pixels:
        beta = math.sqrt(frames * height * width / s.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < s.min_pixels:
        beta = math.sqrt(s.min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def pixel_table(s: ImageSettings) -> np.ndarray:
    """float32 [3, 256] the normalised value of each uint8 level (`data.inputs.pixels`)."""
    return pixels.pixel_table(s.mean, s.std)


def patches(image, s: ImageSettings, codes: bool = False):
    """(float32 [P, C T p p] the flattened patches, (1, h, w) the patch grid); `codes`:
    the uint8 levels instead, a quarter of the bytes (`data.inputs.pixels.decode_pixels` gives
    the floats)."""
    x = read_image(image)
    p, m, T = s.patch_size, s.merge_size, s.temporal_patch_size
    h, w = smart_resize(x.shape[0], x.shape[1], p * m, s.min_pixels, s.max_pixels)
    if (h, w) != x.shape[:2]:
        x = resize_bicubic(x, h, w, s.resize)
    x = x.transpose(2, 0, 1)
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (T, p, p))
    return _levels(x.reshape(gh * gw, 3 * T * p * p), s, codes), (1, gh, gw)


def _levels(x_uint8, s: ImageSettings, codes: bool) -> np.ndarray:
    """Patches [P, C T p p] of uint8 levels as they are (`codes`) or normalised."""
    x = np.ascontiguousarray(x_uint8)
    return x if codes else pixels.normalise(x, s.mean, s.std)


def video_patches(frames, s: ImageSettings, codes: bool = False):
    """(float32 [P, C T p p] the flattened patches, (t, h, w) the patch grid) of a video
    ([F, H, W, 3] uint8 frames, at a size the processor keeps: `check_frame_size`).
    Frames pair up over the temporal patch (the last repeated to an even count), in the
    reference video processor's patch order: temporal patch, merged row, merged column,
    then (C, T, p, p). `codes`: the uint8 levels instead (`patches`)."""
    x = np.asarray(frames)
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != np.uint8:
        raise ValueError(f"video: shape {x.shape} {x.dtype}, expected uint8 [F, H, W, 3]")
    check_frame_size(x.shape[1], x.shape[2], s, len(x))
    p, m, T = s.patch_size, s.merge_size, s.temporal_patch_size
    x = np.concatenate([x, np.repeat(x[-1:], -len(x) % T, 0)]).transpose(0, 3, 1, 2)
    t, gh, gw = len(x) // T, x.shape[2] // p, x.shape[3] // p
    x = x.reshape(t, T, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return _levels(x.reshape(t * gh * gw, 3 * T * p * p), s, codes), (t, gh, gw)


def check_frame_size(height: int, width: int, s: ImageSettings, frames: int = 2) -> None:
    """Refuses (ValueError) video frames the video processor would resize: its resize
    (torchvision's antialiased bicubic) is not reproduced here, so frames must come at
    a size it keeps (`frames`: how many, where the budget counts them)."""
    unit = s.patch_size * s.merge_size
    if s.frames_in_budget:
        kept = video_smart_resize(frames, height, width, s)
    else:
        kept = smart_resize(height, width, unit, s.min_pixels, s.max_pixels)
    if kept != (height, width):
        raise ValueError(
            f"video: frames of {height} x {width} would be resized to {kept[0]} x {kept[1]} "
            f"(multiples of {unit}, min_pixels {s.min_pixels}, max_pixels {s.max_pixels}); "
            "pass frames at a size the video processor keeps"
        )


def chat_prompt(question: str, system: str = SYSTEM, pad: str | None = IMAGE_PAD,
                text_first: bool = False) -> str:  # fmt: skip
    """The Qwen chat template for one image (or, `pad` VIDEO_PAD, one video; None: no
    image, the text-only prompt) then `question`, ready for the answer; `system` "": no
    system turn (Qwen3-VL's template adds no default one). `text_first`: the question
    before the image, as the template renders a message whose text item comes first
    (paper 003's `coco_blur.py`)."""
    vision = "" if pad is None else f"<|vision_start|>{pad}<|vision_end|>"
    turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    if text_first:
        return f"{turn}<|im_start|>user\n{question}{vision}{TAIL}"
    return f"{turn}<|im_start|>user\n{vision}{question}{TAIL}"


def answer_turn(question: str, answer: str) -> tuple[str, str]:
    """(prompt, turn): `chat_prompt(question)` and the assistant's turn the Qwen chat
    template writes after it ("{answer}<|im_end|>" and a newline: paper 003's ID
    fine-tune's labels)."""
    return chat_prompt(question), f"{answer}<|im_end|>\n"


class Processor(NamedTuple):
    """A checkpoint's tokenizer (`tokenizers.Tokenizer`), image and video settings and
    config."""

    tokenizer: Any
    images: ImageSettings
    config: QwenVLConfig
    videos: ImageSettings = VIDEO_DEFAULTS


def load_processor(folder: str, config: QwenVLConfig, resize: str | None = None) -> Processor:
    """The folder's tokenizer.json and preprocessor_config.json; errors name the path.
    `resize`: how photographs are resized (`data.inputs.resize.BACKENDS`; None: as the config's
    processor class does, `ImageSettings.resize`)."""
    tok, path = prompts.read_tokenizer(folder)
    prompts.check_token_id(tok, path, IMAGE_PAD, config.image_token_id, "image_token_id")
    prompts.check_token_id(tok, path, VIDEO_PAD, config.video_token_id, "video_token_id",
                           optional=True)  # fmt: skip
    images = image_settings(folder)
    images = hf_vlm.with_resize(images, resize)
    videos = image_settings(folder, video=True)._replace(frames_in_budget=config.video_timestamps)
    return Processor(tok, images, config, videos)


class Encoded(NamedTuple):
    """A batch ready for `model.forward`, with what `spans` needs: the prompts (image pad
    expanded), each token's character offsets [B, S, 2] (-1 at padding) and the
    question's character range in each prompt [B, 2]; the patch grid (t, h, w) and
    merge size of its images; whether they are videos (each frame a row of cells)."""

    inputs: Inputs
    prompts: list
    offsets_BxSx2: np.ndarray
    question_Bx2: np.ndarray
    grid: tuple
    merge: int
    video: bool = False
    patch_size: int = 0  # pixels per patch side (0: not recorded)

    def describe(self) -> str:
        """One line for logs: the picture's size, its patches and the tokens."""
        t, h, w = self.grid
        return (f"image {h * self.patch_size} x {w * self.patch_size} px, {t * h * w} "
                f"patches, {self.inputs.image_BxI.shape[1]} image tokens, "
                f"{self.inputs.tokens_BxS.shape[1]} tokens")  # fmt: skip


def _pixels(proc: Processor, images, codes: bool = False):
    if (
        proc.images.patch_size != proc.config.patch_size
        or proc.images.merge_size != proc.config.merge_size
    ):
        raise ValueError("preprocessor_config.json: patch / merge size differ from config.json's")
    out = [patches(im, proc.images, codes) for im in images]
    grids = {g for _, g in out}
    if len(grids) > 1:
        raise ValueError(
            f"images: they resize to different patch grids {sorted(grids)}; a batch "
            "holds images of one size"
        )
    return np.stack([p for p, _ in out]), out[0][1]


def encode(proc: Processor, images, questions, codes: bool = False,
           text_first: bool = False) -> Encoded:  # fmt: skip
    """Images (paths, PIL images or arrays) and one question each -> an `Encoded` batch
    (`codes`: its pixels as uint8 levels, `data.inputs.pixels.decode_pixels` before
    `model.forward`; `text_first`: each question before its image, `chat_prompt`)."""
    prompts.check_batch(images, questions)
    pixels, grid = _pixels(proc, images, codes)
    return _encode(proc, pixels, grid, questions, IMAGE_PAD, proc.config.image_token_id,
                   text_first=text_first)  # fmt: skip


def encode_video(proc: Processor, videos, questions, fps: float = 24.0,
                 codes: bool = False) -> Encoded:  # fmt: skip
    """Videos (uint8 [F, H, W, 3] frames each, one size for all: `video_patches`) and one
    question each -> an `Encoded` batch, each video where the chat template puts it
    (`<|video_pad|>`). `fps`: the frames' rate, which only Qwen2.5-VL's time ids read
    (tokens_per_second x the seconds a temporal patch spans); 24 is what the reference
    assumes for frames given without their metadata. `codes`: as `encode`'s."""
    prompts.check_batch(videos, questions, what="videos")
    if not fps > 0:
        raise ValueError(f"fps = {fps}: expected a positive frame rate")
    out = [video_patches(v, proc.videos, codes) for v in videos]
    if len({g for _, g in out}) > 1:
        raise ValueError(f"videos: different patch grids {sorted({g for _, g in out})}")
    pixels, grid = np.stack([p for p, _ in out]), out[0][1]
    stamps = None
    if proc.config.video_timestamps:
        stamps = frame_times(len(videos[0]), fps, proc.videos.temporal_patch_size)
    return _encode(proc, pixels, grid, questions, VIDEO_PAD, proc.config.video_token_id,
                   time_interval(proc, fps), stamps)  # fmt: skip


def frame_times(frames: int, fps: float, T: int) -> list[float]:
    """The time in seconds of each temporal patch of `frames` frames at `fps` (the mean
    of its first and last frame's; the last frame repeated to a multiple of T), as
    Qwen3-VL's processor stamps them."""
    index = list(range(frames)) + [frames - 1] * (-frames % T)
    return [(index[i] / fps + index[i + T - 1] / fps) / 2 for i in range(0, len(index), T)]


def encode_text(proc: Processor, questions) -> Encoded:
    """Questions asked without an image (the text-only prompt, `chat_prompt(pad=None)`)
    -> an `Encoded` batch with no patches and no image tokens: the authors' text-only
    baseline (paper 003's `coco_deviation.py`: `extract_embeds(query, None, ...)`)."""
    prompts.check_batch(None, questions)
    F = 3 * proc.images.temporal_patch_size * proc.images.patch_size**2
    pixels = np.zeros((len(questions), 0, F), np.uint8)
    return _encode(proc, pixels, (1, 0, 0), questions, None, proc.config.image_token_id)


def time_interval(proc: Processor, fps: float) -> float:
    """A video's M-RoPE time ids per temporal patch at `fps`: Qwen2.5-VL's
    tokens_per_second x the seconds a temporal patch spans; 1 where the config has no
    tokens_per_second (Qwen2-VL: one id per temporal patch)."""
    per_second = proc.config.vit_tokens_per_second
    return per_second * proc.videos.temporal_patch_size / fps if per_second else 1.0


def _vision_text(pad: str, n: int, stamps=None) -> str:
    """The vision block of n merged tokens, or one per timestamp (`stamps`, seconds)."""
    if stamps is None:
        return f"<|vision_start|>{pad * n}<|vision_end|>"
    per = n // len(stamps)
    return "".join(f"<{t:.1f} seconds><|vision_start|>{pad * per}<|vision_end|>" for t in stamps)


def _encode(proc: Processor, patches_BxPxF, grid, questions, pad: str, pad_id: int,
            interval: float = 1.0, stamps=None, text_first: bool = False) -> Encoded:  # fmt: skip
    c = proc.config
    n = int(np.prod(grid)) // c.merge_size**2
    block = f"<|vision_start|>{pad}<|vision_end|>"

    def template(q):
        text = chat_prompt(q, c.chat_system, pad=pad, text_first=text_first)
        return text if pad is None else text.replace(block, _vision_text(pad, n, stamps))

    # what follows the question: the vision block too where it comes after the text
    tail = _vision_text(pad, n, stamps) + TAIL if text_first and pad is not None else TAIL
    texts, question_Bx2 = prompts.templated(questions, template, tail)
    rows = hf_vlm.padded_rows(proc.tokenizer, texts, PAD)
    per_frame = stamps is not None
    inputs = _inputs(c, rows.tokens_BxS, rows.valid_BxS, patches_BxPxF, grid, pad_id, interval,
                     per_frame)  # fmt: skip
    return Encoded(
        inputs,
        texts,
        rows.offsets_BxSx2,
        question_Bx2,
        grid,
        c.merge_size,
        pad == VIDEO_PAD,
        c.patch_size,
    )


def _inputs(c: QwenVLConfig, tokens, valid, pixels, grid, pad_id: int, interval: float,
            per_frame: bool = False) -> Inputs:  # fmt: skip
    """The forward's `Inputs`; `per_frame`: each temporal patch its own block of tokens,
    whose M-RoPE ids are an image's (Qwen3-VL's timestamped videos)."""
    B = tokens.shape[0]
    n = int(np.prod(grid) > 0)  # images per row: 0 for a text-only batch
    blocks = [(1, *grid[1:])] * grid[0] if per_frame else [grid]
    n *= len(blocks)
    pos = positions.mrope_ids(tokens, blocks * B * (n > 0), pad_id, c.merge_size, [n] * B,
                              valid_BxS=valid, time_intervals=[interval] * B * n)  # fmt: skip
    image = np.stack([np.flatnonzero((row == pad_id) & ok) for row, ok in zip(tokens, valid)])
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


def spans(enc: Encoded, words, cells=(1, 1)) -> Spans:
    """The VLM interface's `Spans` of an encoded batch; `words` are each row's (first,
    second) object words as they appear in its question; `cells` the (rows, cols) of the
    scene grid that `cell_I` indexes (row-major)."""
    xy = prompts.word_positions(enc.prompts, enc.question_Bx2, enc.offsets_BxSx2, words)
    return _spans(enc, xy, cells)


def _spans(enc: Encoded, xy, cells) -> Spans:
    f, r, c = positions.merged_grid(enc.grid, enc.merge)
    h, w = enc.grid[1] // enc.merge, enc.grid[2] // enc.merge
    row = f * cells[0] // enc.grid[0] if enc.video else r * cells[0] // h  # a video's: its frame
    cell = row * cells[1] + c * cells[1] // w
    question = prompts.question_mask(enc.offsets_BxSx2, enc.question_Bx2)
    S = enc.offsets_BxSx2.shape[1]
    return Spans(
        enc.inputs.image_BxI,
        np.stack([f, r, c], 1).astype(np.int32),
        cell.astype(np.int32),
        xy[:, 0],
        xy[:, 1],
        question,
        np.full(len(xy), S - 1, np.int32),
    )
