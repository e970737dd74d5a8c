"""Inputs as the reference's Gemma-3 processor makes them: pixels, the chat prompt, spans.

Images (`processed`), as the reference's default image processor
(`Gemma3ImageProcessor`, its torchvision backend in transformers 5; Pillow's where the
config names the PIL backend's class, `...Pil`): every photograph resized to the ViT's
square (preprocessor_config.json's `size`, 896 px for gemma-3) with the antialiased
bilinear filter (`resample` 2; `data.inputs.resize.resize_bilinear`, level for level), no crop,
no padding; then the fused rescale-and-normalise in float32 with the config's mean and
std (gemma-3: 0.5, 0.5), as a table per uint8 level (`pixel_table`). Pan-and-scan (the
reference's option, off by default) is not reproduced: a preprocessor_config.json that
turns it on is refused by name.

Text (`chat_prompt`, `encode`): the output of Gemma-3's published chat template for one
user turn holding one image then the question (as the reference's processor applies
it, `apply_chat_template(tokenize=True)`):
"<bos><start_of_turn>user\\n<start_of_image>{question}<end_of_turn>\\n<start_of_turn>model\\n"
(the question trimmed; without an image no `<start_of_image>`), then the processor's
expansion of `<start_of_image>` to "\\n\\n<start_of_image>" + `<image_soft_token>` x
mm_tokens_per_image + "<end_of_image>\\n\\n". Tokenized by the checkpoint's own
tokenizer.json without its template (the chat template holds the one `<bos>`), rows
left-padded with `<pad>`. The image soft tokens are the bidirectional block
(`model.lm_masks`), as the reference's `token_type_ids`.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from jaxmech.data.inputs import prompts
from jaxmech.data.inputs.pixels import fused_pixel_table, read_image
from jaxmech.data.inputs.resize import resize_bicubic, resize_bilinear
from jaxmech.families import hf_vlm
from jaxmech.families.gemma3.config import Gemma3Config

BOS, PAD = "<bos>", "<pad>"
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TAIL = "<end_of_turn>\n<start_of_turn>model\n"  # what follows the question
RESAMPLES = {2: resize_bilinear, 3: resize_bicubic}  # PIL's codes: BILINEAR, BICUBIC


class ImageSettings(NamedTuple):
    """The image processor's settings (`preprocessor_config.json`; gemma-3's defaults)."""

    size_hw: tuple = (896, 896)
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    resample: int = 2
    resize: str = "torchvision"  # `data.inputs.resize.BACKENDS`


def image_settings(folder: str) -> ImageSettings:
    """The folder's preprocessor_config.json, or gemma-3's where it has none; ValueError
    naming the file for pan-and-scan or a resample filter not reproduced."""
    d = ImageSettings()
    path, raw = hf_vlm.preprocessor_json(folder)
    if raw is None:
        return d
    if raw.get("do_pan_and_scan"):
        raise ValueError(f"{path}: do_pan_and_scan = true is not supported (one resized image "
                         "per question, the reference's default)")  # fmt: skip
    if not raw.get("do_resize", True) or not raw.get("do_normalize", True):
        raise ValueError(f"{path}: do_resize and do_normalize must be true")
    resample = int(raw.get("resample", d.resample))
    if resample not in RESAMPLES:
        raise ValueError(f"{path}: resample = {resample} is not supported (2 bilinear, 3 bicubic)")
    size = raw.get("size") or {}
    kind = str(raw.get("image_processor_type", ""))
    return ImageSettings(
        size_hw=(int(size["height"]), int(size["width"])) if "height" in size else d.size_hw,
        mean=tuple(raw.get("image_mean", d.mean)),
        std=tuple(raw.get("image_std", d.std)),
        resample=resample,
        resize="pil" if kind.endswith("Pil") else d.resize,
    )


def pixel_table(s: ImageSettings) -> np.ndarray:
    """float32 [3, 256] each channel's normalised value of every uint8 level, as the
    reference's fused rescale-and-normalise computes it in float32
    (`data.inputs.pixels.fused_pixel_table`)."""
    return fused_pixel_table(s.mean, s.std)


def processed(image, s: ImageSettings) -> np.ndarray:
    """uint8 [h, w, 3] a photograph (a path, PIL image or array) resized as the processor
    does, before the normalisation."""
    x = read_image(image)
    if x.shape[:2] == tuple(s.size_hw):
        return x
    return RESAMPLES[s.resample](x, *s.size_hw, s.resize)


def patches(image, s: ImageSettings, patch: int, codes: bool = False) -> np.ndarray:
    """float32 [P, C p p] the processed photograph's patches, row-major, each flattened
    (C, p, p), normalised (`pixel_table`); `codes`: the uint8 levels instead."""
    return hf_vlm.flat_patches(processed(image, s), patch, None if codes else pixel_table(s))


def image_sequence(n: int) -> str:
    """What the processor puts where the chat template wrote `<start_of_image>`."""
    return f"\n\n{BOI}{IMAGE * n}{EOI}\n\n"


def chat_prompt(question: str, image: bool = True) -> str:
    """Gemma-3's chat template for one user turn, one image (`image` False: none) then
    `question` (trimmed), ready for the answer; `<start_of_image>` not yet expanded."""
    return f"{BOS}<start_of_turn>user\n{BOI if image else ''}{question.strip()}{TAIL}"


class Processor(NamedTuple):
    """A checkpoint's tokenizer (`tokenizers.Tokenizer`), image settings and config."""

    tokenizer: Any
    images: ImageSettings
    config: Gemma3Config


def load_processor(folder: str, config: Gemma3Config, resize: str | None = None) -> Processor:
    """The folder's tokenizer.json and preprocessor_config.json; errors name the path.
    `resize`: how photographs are resized (`data.inputs.resize.BACKENDS`; None: as the
    config's processor class does)."""
    tok, path = prompts.read_tokenizer(folder)
    for token, want, field in ((IMAGE, config.image_token_id, "image_token_index"),
                               (BOI, config.boi_token_id, "boi_token_index"),
                               (EOI, config.eoi_token_id, "eoi_token_index")):  # fmt: skip
        prompts.check_token_id(tok, path, token, want, field)
    if tok.token_to_id(BOS) is None:
        raise ValueError(f"{path}: no {BOS} token")
    images = image_settings(folder)
    images = hf_vlm.with_resize(images, resize)
    if images.size_hw != (config.image_size, config.image_size):
        raise ValueError(f"{os.path.join(folder, 'preprocessor_config.json')}: images become "
                         f"{images.size_hw[0]} x {images.size_hw[1]} px, config.json's ViT reads "
                         f"{config.image_size} x {config.image_size}")  # fmt: skip
    return Processor(tok, images, config)


# the batch's `describe` names its image tokens pooled (`hf_vlm.GridEncoded`)
Encoded = hf_vlm.GridEncoded


def _encode(proc: Processor, pixels_BxPxF, questions, image: bool) -> Encoded:
    c = proc.config
    n = c.mm_tokens if image else 0
    questions = [str(q).strip() for q in questions]
    texts, question_Bx2 = prompts.templated(
        questions, lambda q: chat_prompt(q, image).replace(BOI, image_sequence(n)), TAIL
    )
    rows = hf_vlm.padded_rows(proc.tokenizer, texts, PAD)
    inputs = hf_vlm.grid_inputs(rows, pixels_BxPxF, c.image_token_id, n, IMAGE)
    return Encoded(inputs, texts, rows.offsets_BxSx2, question_Bx2, c.token_grid if n else 0,
                   c.image_size, "image tokens (pooled)")  # fmt: skip


encode, encode_text = hf_vlm.grid_encoders(patches, _encode)


spans = hf_vlm.grid_spans  # image tokens at (0, row, col) of the pooled token grid
