"""A Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint's architecture, read from its
`config.json`.

One flat frozen config for both variants (`variant`): the vision tower's fields start
with `vit_`, the merger's with `merge_`, the language model's with `lm_`. `from_hf`
reads every layout of `config.json` met so far:

* Hub files (transformers 4.4x): the LM's fields at the top level, `rope_scaling`
  (`{"type": "mrope", "mrope_section": [...]}`), `torch_dtype`;
* newer saves (transformers 5): the LM under `text_config`, `rope_parameters`, `dtype`;
* Qwen2-VL's vision `hidden_size` is the LM's width (its ViT width is `embed_dim`, its
  MLP `embed_dim * mlp_ratio`); Qwen2.5-VL's vision `hidden_size` is the ViT width,
  `out_hidden_size` the LM's, `intermediate_size` the MLP's; `spatial_patch_size` and
  `patch_size` are the same field.

Qwen2-VL's ViT: LayerNorm, quick_gelu MLP, full attention within a frame. Qwen2.5-VL's:
RMSNorm, SwiGLU MLP with biases, attention within windows of `vit_window` patches
square except in `vit_full_blocks`. Both LMs are Qwen2 decoders (RMSNorm, grouped-query
attention with q / k / v biases, SwiGLU) with three-part rotary positions whose
frequency pairs are split `lm_mrope_section` (t, h, w; t the highest frequencies).

Qwen3-VL (`qwen3_vl`) differs by fields, which the forward reads (not the variant's
name): the patch embedding's bias (`patch_bias`); a learned `vit_pos_table`-row table
(a square grid, 2304 = 48 x 48 for the 4B) resampled bilinearly to each image's patch
grid and added after the patch embedding, besides the 2D rotary; LayerNorm blocks with a
tanh-GELU MLP (`linear_fc1 / fc2`); DeepStack (`vit_deepstack`: the ViT blocks whose
outputs go through their own mergers and are added to the LM's residual at the image
tokens after LM blocks 0, 1, ...); a Qwen3 LM (per-head q / k RMSNorms `lm_qk_norm`, no
q / k / v biases `lm_qkv_bias`, a head width `lm_head_size` set apart from width /
heads); M-RoPE interleaved (`lm_mrope_interleaved`: h on frequency pairs 1, 4, 7, ..., w
on 2, 5, 8, ..., each up to 3 x its section, t on the rest); a chat template without a
default system message (`chat_system` ""); and videos whose frames are each their own
block of tokens after a "<t seconds>" timestamp (`video_timestamps`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxmech.config import ConfigError, choice, fail, float_in, int_in
from jaxmech.families import fields, hf_vlm
from jaxmech.models import hf_config
from jaxmech.models.hf_config import get

VARIANTS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclasses.dataclass(frozen=True)
class QwenVLConfig(fields.VisionFields, fields.RotaryTextFields):
    """One checkpoint's architecture (module docstring); defaults: a tiny Qwen2-VL (the
    shared fields': `families.fields`; images of any size, cut into `patch_size`
    patches, so no `image_size`). Not a `config.ModelConfig`: a checkpoint family is
    loaded, not trained, so its fields are no training flags."""

    variant: str = "qwen2_vl"
    # vision tower
    temporal_patch_size: int = 2
    merge_size: int = 2
    vit_window: int = 0  # patches per window side (Qwen2.5-VL: window_size / patch_size)
    vit_full_blocks: tuple[int, ...] = ()
    vit_rope_theta: float = 10000.0
    # a video's M-RoPE time ids per second (Qwen2.5-VL's tokens_per_second); 0: one id
    # per temporal patch, whatever the frame rate (Qwen2-VL)
    vit_tokens_per_second: float = 0.0
    # language model
    lm_mrope_section: tuple[int, ...] = (2, 1, 1)
    # Qwen3-VL's switches (the defaults: Qwen2 / 2.5-VL's)
    patch_bias: bool = False
    vit_pos_table: int = 0  # rows of a learned square position table (0: none)
    vit_deepstack: tuple[int, ...] = ()  # ViT blocks whose outputs enter LM blocks 0, 1, ..
    lm_head_size: int = 0  # the LM's head width (0: lm_width / lm_heads)
    lm_qk_norm: bool = False
    lm_qkv_bias: bool = True
    lm_mrope_interleaved: bool = False
    chat_system: str = "You are a helpful assistant."  # "": the template adds none
    video_timestamps: bool = False  # each temporal patch its own "<t seconds>" block
    # special tokens besides image_token_id
    video_token_id: int = 61
    vision_start_token_id: int = 62
    vision_end_token_id: int = 63

    def __post_init__(self):
        object.__setattr__(self, "vit_full_blocks", tuple(self.vit_full_blocks))
        object.__setattr__(self, "lm_mrope_section", tuple(self.lm_mrope_section))
        object.__setattr__(self, "vit_deepstack", tuple(self.vit_deepstack))
        self._check_vision()
        self._check_text()
        choice("variant", self.variant, VARIANTS)
        hf_config.check_positive(self, ("temporal_patch_size", "merge_size"), ("vit_rope_theta",))
        int_in("vit_window", self.vit_window, 0)
        int_in("vit_pos_table", self.vit_pos_table, 0)
        int_in("lm_head_size", self.lm_head_size, 0)
        self._check_qwen3()
        float_in("vit_tokens_per_second", self.vit_tokens_per_second, 0.0)
        self._check_heads()
        for i in self.vit_full_blocks:
            if not 0 <= i < self.vit_depth:
                fail(
                    "vit_full_blocks",
                    self.vit_full_blocks,
                    f"block indices in [0, {self.vit_depth})",
                )
        if self.vit_window and self.vit_window % self.merge_size:
            fail("vit_window", self.vit_window, f"a multiple of merge_size = {self.merge_size}")

    def _check_qwen3(self):
        side = self.vit_pos_side
        if side * side != self.vit_pos_table:
            fail("vit_pos_table", self.vit_pos_table, "a square number of rows (0: no table)")
        blocks = self.vit_deepstack
        if len(set(blocks)) != len(blocks) or any(not 0 <= i < self.vit_depth for i in blocks):
            fail("vit_deepstack", blocks, f"distinct blocks in [0, {self.vit_depth})")
        if len(self.vit_deepstack) > self.lm_layers:
            fail("vit_deepstack", self.vit_deepstack,
                 f"at most lm_layers = {self.lm_layers} blocks (one per LM block)")  # fmt: skip

    def _check_heads(self):
        if self.vit_width % self.vit_heads or (self.vit_width // self.vit_heads) % 4:
            fail(
                "vit_width",
                self.vit_width,
                f"vit_heads = {self.vit_heads} heads of a width divisible by 4 (2D rotary)",
            )
        if not self.lm_head_size and self.lm_width % self.lm_heads:
            fail("lm_width", self.lm_width, f"a multiple of lm_heads = {self.lm_heads}")
        hf_config.check_heads(self, vit=False, head_dim=False)  # lm_kv_heads (the ViT's: above)
        if 2 * sum(self.lm_mrope_section) != self.lm_head_dim:
            fail(
                "lm_mrope_section",
                self.lm_mrope_section,
                f"three sections summing to lm head_dim / 2 = {self.lm_head_dim // 2}",
            )

    @property
    def lm_head_dim(self) -> int:
        return self.lm_head_size or self.lm_width // self.lm_heads

    @property
    def vit_pos_side(self) -> int:
        """The learned position table's side (48 for Qwen3-VL's 2304 rows; 0: none)."""
        return int(round(self.vit_pos_table**0.5))

    @property
    def vit_layer_norm(self) -> bool:
        """LayerNorm (with biases) in the ViT's blocks and merger; else RMSNorm."""
        return self.variant != "qwen2_5_vl"

    @property
    def vit_gated(self) -> bool:
        """A SwiGLU ViT MLP (Qwen2.5-VL's); else act(x W_in) W_out."""
        return self.variant == "qwen2_5_vl"

    @property
    def patch_features(self) -> int:
        """The length of one flattened patch: C x T x patch x patch (1176 for Qwen)."""
        return self.vit_in_chans * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_width(self) -> int:
        """The merger's hidden width: merge_size^2 patches concatenated."""
        return self.vit_width * self.merge_size**2


def _mrope_section(text: Mapping[str, Any]) -> tuple[int, ...]:
    rope = hf_config.rope_params(text)
    section = rope.get("mrope_section")
    if section is None:
        raise ConfigError("config.json: no mrope_section under rope_scaling / rope_parameters")
    return tuple(int(s) for s in section)


def _rope_theta(text: Mapping[str, Any]) -> float:
    # rope_parameters only: 4.x's rope_scaling holds the M-RoPE sections, not the base
    return hf_config.rope_theta(hf_config.rope_params(text, ("rope_parameters",)), text, 1e6)


def _vision_fields(variant: str, v: Mapping[str, Any], lm_width: int) -> dict:
    patch = int(get(v, "patch_size", "spatial_patch_size", default=14))
    if variant == "qwen2_vl":
        width = int(get(v, "embed_dim", default=1280))
        mlp = int(width * float(get(v, "mlp_ratio", default=4)))
        window, full, act = 0, (), get(v, "hidden_act", default="quick_gelu")
    elif variant == "qwen3_vl":
        width = int(get(v, "hidden_size", default=1152))
        mlp = int(get(v, "intermediate_size", default=4304))
        window, full, act = 0, (), get(v, "hidden_act", default="gelu_pytorch_tanh")
    else:
        width = int(get(v, "hidden_size", default=1280))
        mlp = int(get(v, "intermediate_size", default=3420))
        window = int(get(v, "window_size", default=112)) // patch
        full = tuple(int(i) for i in get(v, "fullatt_block_indexes", default=()))
        act = get(v, "hidden_act", default="silu")
    # the reference's class default (4) where config.json does not say; released: 2
    # (Qwen3-VL's videos are timed by timestamps in the text instead)
    per_second = 0.0 if variant != "qwen2_5_vl" else float(get(v, "tokens_per_second", default=4))
    out = int(get(v, "out_hidden_size", default=lm_width) if variant != "qwen2_vl" else lm_width)
    if out != lm_width:
        raise ConfigError(
            f"config.json: the vision tower's output width {out} is not the LM's {lm_width}"
        )
    return dict(
        vit_depth=int(get(v, "depth", default=32)),
        vit_width=width,
        vit_heads=int(get(v, "num_heads", default=16)),
        vit_mlp=mlp,
        vit_in_chans=int(get(v, "in_chans", "in_channels", default=3)),
        patch_size=patch,
        temporal_patch_size=int(get(v, "temporal_patch_size", default=2)),
        merge_size=int(get(v, "spatial_merge_size", default=2)),
        vit_window=window,
        vit_full_blocks=full,
        vit_act=act,
        vit_tokens_per_second=per_second,
        **(_qwen3_vision(v) if variant == "qwen3_vl" else {}),
    )


def _qwen3_vision(v: Mapping[str, Any]) -> dict:
    """Qwen3-VL's vision switches (the class defaults where config.json is silent)."""
    rope = hf_config.rope_params(v, ("rope_parameters",))
    return dict(
        patch_bias=True,
        vit_pos_table=int(get(v, "num_position_embeddings", default=2304)),
        vit_deepstack=tuple(
            int(i) for i in get(v, "deepstack_visual_indexes", default=(8, 16, 24))
        ),
        vit_rope_theta=float(get(rope, "rope_theta", default=10000.0)),
    )


def _qwen3_text(text: Mapping[str, Any]) -> dict:
    """Qwen3-VL's LM switches: a Qwen3 decoder, interleaved M-RoPE (the reference
    interleaves whatever `mrope_interleaved` says), the chat template's and the video
    prompt's differences."""
    return dict(
        lm_head_size=int(get(text, "head_dim", default=128)),
        lm_qk_norm=True,
        lm_qkv_bias=bool(get(text, "attention_bias", default=False)),
        lm_mrope_interleaved=True,
        chat_system="",
        video_timestamps=True,
    )


def from_hf(raw: Mapping[str, Any]) -> QwenVLConfig:
    """The config of a checkpoint's `config.json` (as a dict); a ConfigError naming what
    is missing or not a Qwen2-VL / Qwen2.5-VL / Qwen3-VL."""
    variant = fields.model_type(raw, VARIANTS)
    text = {**raw, **(raw.get("text_config") or {})}
    vision = raw.get("vision_config") or {}
    width = int(text["hidden_size"])
    return QwenVLConfig(
        variant=variant,
        **_vision_fields(variant, vision, width),
        **hf_vlm.lm_fields(text, head_dim=False),
        lm_rope_theta=_rope_theta(text),
        lm_mrope_section=_mrope_section(text),
        **(_qwen3_text(text) if variant == "qwen3_vl" else {}),
        tie_embeddings=hf_config.tied(raw, text),
        image_token_id=int(
            get(raw, "image_token_id", default=get(text, "image_token_id", default=151655))
        ),
        video_token_id=int(
            get(raw, "video_token_id", default=get(text, "video_token_id", default=151656))
        ),
        vision_start_token_id=int(get(raw, "vision_start_token_id", default=151652)),
        vision_end_token_id=int(get(raw, "vision_end_token_id", default=151653)),
        dtype=hf_config.stored_dtype(raw, text),
    )
