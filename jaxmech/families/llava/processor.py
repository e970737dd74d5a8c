"""Inputs as llava-hf's processor makes them: pixels, the chat prompt, token spans.

Images (`processed`), as the reference's default image processor (`CLIPImageProcessor`,
its torchvision backend in transformers 5; Pillow's bicubic where the config names the
PIL backend's class, `...Pil`):

* `square="crop"` (the reference's default): the shortest edge resized to `size`
  (the long side int(size x long / short)), then the centre `crop` (top / left
  int((H - h) / 2)), so a photograph that is not square loses its sides (or top and
  bottom); every photograph becomes one size.
* `square="pad"` (the original LLaVA code's `image_aspect_ratio: pad`, llava-hf's
  `LlavaImageProcessor(do_pad=True)`): first padded to a square of its long side in the
  mean colour (int(255 x mean) per channel; the image at ((m - w) // 2, (m - h) // 2)),
  so nothing is cut.

Resizes are `data.inputs.resize`'s (torchvision's antialiased bicubic on uint8, level for
level); the normalisation is the reference's fused one in float32: (level - 255 mean) /
(255 std), as a table per uint8 level (`pixel_table`); patches flattened (C, p, p) in
row-major patch order. `frame` says which region of the photograph the processed image
shows (box coordinates map through it).

Text (`chat_prompt`, `encode`): llava-hf's chat template for one user turn holding one
image then the question, "USER: <image>\\n{question} ASSISTANT:" (a question without an
image: "USER: {question} ASSISTANT:"); `<image>` expanded to the image's patch count;
the checkpoint's own `tokenizer.json` (its template adds `<s>`); rows left-padded.
`load_processor(prompt=MIRROR)`: paper 003's patching scripts' prompt instead
(`mirror_prompt`: "<image>\\nQUESTION: {question}Answer left or right. ANSWER: ", no
template, the question cut after its "?").
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import numpy as np

from jaxmech.data.inputs import prompts
from jaxmech.data.inputs.pixels import CLIP_MEAN, CLIP_STD, fused_pixel_table, read_image
from jaxmech.data.inputs.resize import BACKENDS, resize_bicubic
from jaxmech.families import hf_vlm
from jaxmech.families.llava.config import LlavaConfig

IMAGE, PAD = "<image>", "<pad>"
SQUARES = ("crop", "pad")  # `load_processor(square=)`: the reference's first


class ImageSettings(NamedTuple):
    """The image processor's settings (`preprocessor_config.json`; llava-hf's defaults)."""

    shortest_edge: int = 336  # 0: resized to `size_hw` instead
    size_hw: tuple = ()
    crop: tuple = (336, 336)  # () : no centre crop
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    resize: str = "torchvision"  # `data.inputs.resize.BACKENDS`
    square: str = "crop"  # `SQUARES`


def image_settings(folder: str) -> ImageSettings:
    """The folder's preprocessor_config.json, or llava-hf's defaults where it has none."""
    d = ImageSettings()
    path, raw = hf_vlm.preprocessor_json(folder)
    if raw is None:
        return d
    size, crop = raw.get("size") or {}, raw.get("crop_size") or {}
    kind = str(raw.get("image_processor_type", ""))
    cut = raw.get("do_center_crop", True) and crop
    return ImageSettings(
        shortest_edge=int(size.get("shortest_edge", 0 if "height" in size else d.shortest_edge)),
        size_hw=(int(size["height"]), int(size["width"])) if "height" in size else (),
        crop=(int(crop["height"]), int(crop["width"])) if cut else (),
        mean=tuple(raw.get("image_mean", d.mean)),
        std=tuple(raw.get("image_std", d.std)),
        resize="pil" if kind.endswith("Pil") else d.resize,
        square="pad" if raw.get("do_pad") and kind.startswith("LlavaImageProcessor") else "crop",
    )


def pixel_table(s: ImageSettings) -> np.ndarray:
    """float32 [3, 256] each channel's normalised value of every uint8 level, as the
    reference's fused rescale-and-normalise computes it in float32: (level - 255 mean) /
    (255 std), mean and std taken to float32 first (`data.inputs.pixels.fused_pixel_table`)."""
    return fused_pixel_table(s.mean, s.std)


def resized_size(height: int, width: int, s: ImageSettings) -> tuple[int, int]:
    """(h, w) the resize gives (before the crop): the shortest edge to `shortest_edge`."""
    if not s.shortest_edge:
        return tuple(s.size_hw)
    short, long = min(height, width), max(height, width)
    new = int(s.shortest_edge * long / short)
    return (new, s.shortest_edge) if width <= height else (s.shortest_edge, new)


class Frame(NamedTuple):
    """How a height x width photograph maps onto the processed image: padded to a square
    at (pad_top, pad_left) in a side x side canvas (no padding: 0, 0 and its own size),
    resized to (h, w), then cut at (top, left) to (crop_h, crop_w) (a crop larger than
    the image pads it with zeros: negative top / left)."""

    pad_top: int
    pad_left: int
    padded: tuple
    resized: tuple
    top: int
    left: int
    out: tuple

    def window(self) -> tuple[float, float, float, float]:
        """(top, left, height, width) in the photograph's own pixels of the region the
        processed image shows (it may reach past the photograph where padded)."""
        sy, sx = self.resized[0] / self.padded[0], self.resized[1] / self.padded[1]
        return (self.top / sy - self.pad_top, self.left / sx - self.pad_left,
                self.out[0] / sy, self.out[1] / sx)  # fmt: skip


def frame(height: int, width: int, s: ImageSettings) -> Frame:
    """The `Frame` of a height x width photograph under settings `s`."""
    if min(height, width) < 1:
        raise ValueError(f"image: size {height} x {width}, expected at least 1 x 1")
    side = max(height, width) if s.square == "pad" else 0
    pad_top, pad_left = ((side - height) // 2, (side - width) // 2) if side else (0, 0)
    padded = (side, side) if side else (height, width)
    h, w = resized_size(*padded, s)
    ch, cw = s.crop or (h, w)
    # the reference pads a too-small image by (crop - size) // 2 first, then cuts at 0
    top = -((ch - h) // 2) if ch > h else int((h - ch) / 2)
    left = -((cw - w) // 2) if cw > w else int((w - cw) / 2)
    return Frame(pad_top, pad_left, padded, (h, w), top, left, (ch, cw))


def _cut(x, top: int, left: int, h: int, w: int) -> np.ndarray:
    """x [H, W, 3] cut to h x w from (top, left), zeros where that reaches past x."""
    out = np.zeros((h, w, 3), np.uint8)
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + h, x.shape[0]), min(left + w, x.shape[1])
    out[y0 - top : y1 - top, x0 - left : x1 - left] = x[y0:y1, x0:x1]
    return out


def processed(image, s: ImageSettings) -> np.ndarray:
    """uint8 [h, w, 3] a photograph (a path, PIL image or array) as the processor makes
    it (module docstring), before the normalisation."""
    x = read_image(image)
    f = frame(x.shape[0], x.shape[1], s)
    if s.square == "pad" and f.padded != x.shape[:2]:
        canvas = np.empty(f.padded + (3,), np.uint8)
        canvas[:] = np.asarray([int(m * 255) for m in s.mean], np.uint8)
        canvas[f.pad_top : f.pad_top + x.shape[0], f.pad_left : f.pad_left + x.shape[1]] = x
        x = canvas
    if f.resized != x.shape[:2]:
        x = resize_bicubic(x, *f.resized, s.resize)
    return x if (f.top, f.left, f.out) == (0, 0, x.shape[:2]) else _cut(x, f.top, f.left, *f.out)


def patches(image, s: ImageSettings, patch: int, codes: bool = False) -> np.ndarray:
    """float32 [P, C p p] the processed photograph's patches, row-major, each flattened
    (C, p, p), normalised (`pixel_table`); `codes`: the uint8 levels instead, a quarter
    of the bytes (`data.inputs.pixels.decode_pixels` gives the floats)."""
    return hf_vlm.flat_patches(processed(image, s), patch, None if codes else pixel_table(s))


def chat_prompt(question: str, image: bool = True) -> str:
    """llava-hf's chat template for one image (`image` False: none) then `question`,
    ready for the answer."""
    return f"USER: {IMAGE}\n{question} ASSISTANT:" if image else f"USER: {question} ASSISTANT:"


def answer_turn(question: str, answer: str) -> tuple[str, str]:
    """(prompt, turn): `chat_prompt(question)` and the assistant's turn llava-hf's chat
    template writes after it (" {answer} ": paper 003's ID fine-tune's labels)."""
    return chat_prompt(question), f" {answer} "


# paper 003's patching scripts' prompt (`mirror_swapping.py`, `attribute_swapping.py`):
# no chat template; their own instruction follows the question
MIRROR_TAIL = "Answer left or right. ANSWER: "


def mirror_prompt(question: str, image: bool = True) -> str:
    """The authors' patching prompt, "<image>\\nQUESTION: {question}Answer left or
    right. ANSWER: " (`image` False: without "<image>\\n"); `question` as
    `asked_sentence` gives it."""
    prefix = IMAGE + "\n" if image else ""
    return f"{prefix}QUESTION: {question}{MIRROR_TAIL}"


def asked_sentence(question: str) -> str:
    """The question up to its first "?" (what the authors' patching prompt holds: their
    instruction replaces the question's own); a question without one, whole."""
    return question.split("?", 1)[0] + "?" if "?" in question else question


# `load_processor(prompt=)`: (prompt(question, image), the text after the question,
# how a question is cut first)
MIRROR = "authors_mirror"
PROMPTS = {"chat": (chat_prompt, " ASSISTANT:", lambda q: q),
           MIRROR: (mirror_prompt, MIRROR_TAIL, asked_sentence)}  # fmt: skip


class Processor(NamedTuple):
    """A checkpoint's tokenizer (`tokenizers.Tokenizer`), image settings and config, and
    the prompt its questions are put in (`PROMPTS`)."""

    tokenizer: Any
    images: ImageSettings
    config: LlavaConfig
    prompt: str = "chat"


LLAMA_TOKENIZERS = ("LlamaTokenizer", "LlamaTokenizerFast")


def load_tokenizer(folder: str):
    """The folder's tokenizer.json (`tokenizers.Tokenizer`), set up as transformers 5
    sets it up: a Llama tokenizer (tokenizer_config.json's `tokenizer_class`) gets its
    pipeline rebuilt as the reference's `LlamaTokenizer` does (no normalizer; a Metaspace
    pre-tokenizer that prepends "▁" to the first piece only, or to every piece where
    `legacy` is true; `<s>` added by the template where `add_bos_token`), which for
    llava-hf's legacy tokenizer.json drops the "▁" it would put after `<image>`."""
    tok, _ = prompts.read_tokenizer(folder)
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    cfg = {}
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    if cfg.get("tokenizer_class") in LLAMA_TOKENIZERS:
        _as_transformers_llama(tok, cfg)
    return tok


def _as_transformers_llama(tok, cfg: dict) -> None:
    from tokenizers import pre_tokenizers, processors

    def token(name, default):
        t = cfg.get(name, default)
        return t.get("content") if isinstance(t, dict) else t

    prefix = cfg.get("add_prefix_space")
    scheme = (
        ("always" if cfg.get("legacy", False) else "first") if prefix in (None, True) else "never"
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    ends = [(token("bos_token", "<s>"), cfg.get("add_bos_token", True)),
            (token("eos_token", "</s>"), cfg.get("add_eos_token", False))]  # fmt: skip
    (bos, add_bos), (eos, add_eos) = ends
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    specials = [(t, tok.token_to_id(t)) for t, add in ends if add]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)


def load_processor(folder: str, config: LlavaConfig, resize: str | None = None,
                   square: str | None = None, prompt: str = "chat") -> Processor:  # fmt: skip
    """The folder's tokenizer.json and preprocessor_config.json; errors name the path.
    `resize`: how photographs are resized (`data.inputs.resize.BACKENDS`; None: as the config's
    processor class does); `square`: "crop" (the reference's default: resize the
    shortest edge, cut the centre) or "pad" (the original LLaVA's: pad to a square in
    the mean colour first); None: as preprocessor_config.json says. `prompt`: "chat"
    (llava-hf's template) or `MIRROR` (`mirror_prompt`)."""
    if prompt not in PROMPTS:
        raise ValueError(f"prompt = {prompt!r}: expected one of {', '.join(PROMPTS)}")
    tok = load_tokenizer(folder)
    path = os.path.join(folder, "tokenizer.json")
    prompts.check_token_id(tok, path, IMAGE, config.image_token_id, "image_token_index")
    images = image_settings(folder)
    for name, value, allowed in (("resize", resize, BACKENDS), ("square", square, SQUARES)):
        if value is not None and value not in allowed:
            raise ValueError(f"{name} = {value!r}: expected one of {', '.join(allowed)}")
    images = images._replace(**{k: v for k, v in (("resize", resize), ("square", square)) if v})
    out = frame(config.image_size, config.image_size, images).out
    if out != (config.image_size, config.image_size):
        raise ValueError(f"{os.path.join(folder, 'preprocessor_config.json')}: images become "
                         f"{out[0]} x {out[1]} px, config.json's ViT reads {config.image_size} "
                         f"x {config.image_size}")  # fmt: skip
    return Processor(tok, images, config, prompt)


# the batch: its image tokens are the patch grid (`hf_vlm.GridEncoded`)
Encoded = hf_vlm.GridEncoded


def _encode(proc: Processor, pixels_BxPxF, questions, image: bool) -> Encoded:
    c, n = proc.config, pixels_BxPxF.shape[1]
    template, tail, cut = PROMPTS[proc.prompt]
    texts, question_Bx2 = prompts.templated(
        [cut(q) for q in questions], lambda q: template(q, image).replace(IMAGE, IMAGE * n), tail
    )
    rows = hf_vlm.padded_rows(proc.tokenizer, texts, PAD, add_special_tokens=True)
    inputs = hf_vlm.grid_inputs(rows, pixels_BxPxF, c.image_token_id, n, IMAGE)
    return Encoded(inputs, texts, rows.offsets_BxSx2, question_Bx2, c.grid if n else 0,
                   c.grid * c.patch_size, "patches = image tokens")  # fmt: skip


encode, encode_text = hf_vlm.grid_encoders(patches, _encode)


spans = hf_vlm.grid_spans  # image tokens at (0, row, col) of the patch grid
