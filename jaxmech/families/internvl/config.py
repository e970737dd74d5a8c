"""An InternVL (-hf) checkpoint's architecture, read from its `config.json`.

One flat frozen config: the vision tower's fields start with `vit_`, the language
model's with `lm_`. `from_hf` reads the layouts transformers writes (`text_config` with
`rope_parameters` (5.x) or `rope_theta` + `rope_scaling` (4.x); `torch_dtype` or
`dtype`; sizes as ints or [h, w] pairs).

InternViT (the 300M of InternVL3-1B / 2B / 8B): a conv patch embedding with a bias, a
CLS token, a learned absolute position table of 1 + (image_size / patch)^2 rows added
once at the input, pre-norm LayerNorm blocks with q / k / v biases, erf GELU MLPs and a
layer scale (lambda_1 / lambda_2) on each sublayer. The connector: the last block's
patch tokens (CLS dropped), the pixel shuffle (`downsample_ratio` 0.5: each 2 x 2 block
of patches one token of 4 x the width), LayerNorm, Linear, GELU, Linear. The LM: a Qwen2
decoder (RMSNorm, grouped-query attention with q / k / v biases, SwiGLU) with 1-D rotary
positions.

Refused by name, before any weight is read: the original OpenGVLab layout (model_type
"internvl_chat", fused qkv: use the -hf conversion), InternViT-6B's RMSNorm and q / k
norms (InternVL3-38B / 78B), another LM than Qwen2 (InternVL2.5's InternLM2, InternVL3.5's
Qwen3), sliding-window attention, rope types other than "default" and "dynamic" (which
equals "default" up to `max_position_embeddings`, the only sequences allowed), another
`downsample_ratio` than 0.5, a `vision_feature_layer` other than -1 and a
`vision_feature_select_strategy` other than "default".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxmech.config import ConfigError, choice, fail
from jaxmech.families import fields, hf_vlm
from jaxmech.models import hf_config
from jaxmech.models.hf_config import get

MODEL_TYPES = ("internvl",)
ROPE_TYPES = ("default", "dynamic")


@dataclasses.dataclass(frozen=True)
class InternVLConfig(fields.SquareVisionFields, fields.RotaryTextFields):
    """One checkpoint's architecture (module docstring); defaults: a tiny InternVL (the
    shared fields': `families.fields`; `image_size`: the tile size the position table
    was trained at). Not a `config.ModelConfig`: a checkpoint family is loaded, not
    trained."""

    vit_qkv_bias: bool = True
    proj_act: str = "gelu"
    # language model (Qwen2)
    lm_head_dim: int = 8
    lm_rope_type: str = "default"
    lm_max_positions: int = 32768  # where "dynamic" rotary positions start to scale

    def __post_init__(self):
        self._check_vision()
        self._check_text()
        choice("proj_act", self.proj_act, fields.ACTIVATIONS)
        choice("lm_rope_type", self.lm_rope_type, ROPE_TYPES)
        hf_config.check_positive(self, ("lm_head_dim", "lm_max_positions"))
        hf_config.check_heads(self)

    def _check_image(self) -> None:
        # the pixel shuffle joins 2 x 2 patches
        if self.image_size % self.patch_size or self.table_side % 2:
            fail("image_size", self.image_size,
                 f"an even number of patches of {self.patch_size} px per side")  # fmt: skip

    # vit_head_dim, patch_features (588 at patch 14): `fields.SquareVisionFields`

    @property
    def table_side(self) -> int:
        """The position table's side in patches (32 for InternViT-300M at 448 px)."""
        return self.image_size // self.patch_size

    @property
    def proj_width(self) -> int:
        """The projector's input width: 2 x 2 patches' features side by side."""
        return 4 * self.vit_width


def _side(value, name: str) -> int:
    """An int, or an [h, w] pair with h == w (the reference's tiles are square)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ConfigError(f"config.json: vision_config.{name} = {value}: expected a square")
        value = value[0]
    return int(value)


def _refuse(cond: bool, what: str) -> None:
    if cond:
        raise ConfigError(f"config.json: {what}")


def _vision_fields(v: Mapping[str, Any]) -> dict:
    _refuse(get(v, "norm_type", default="layer_norm") != "layer_norm",
            f"vision_config.norm_type = {v.get('norm_type')!r} is not supported: allowed "
            "'layer_norm' (InternViT-300M; InternViT-6B's RMSNorm is not supported)")  # fmt: skip
    _refuse(
        bool(v.get("use_qk_norm")),
        "vision_config.use_qk_norm = true is not supported (InternViT-6B's q / k norms)",
    )
    _refuse(
        not get(v, "use_mean_pooling", default=True),
        "vision_config.use_mean_pooling = false is not supported (a final LayerNorm)",
    )
    _refuse(
        not get(v, "use_absolute_position_embeddings", default=True),
        "vision_config.use_absolute_position_embeddings = false is not supported",
    )
    return dict(
        vit_depth=int(get(v, "num_hidden_layers", default=24)),
        vit_width=int(get(v, "hidden_size", default=1024)),
        vit_heads=int(get(v, "num_attention_heads", default=16)),
        vit_mlp=int(get(v, "intermediate_size", default=4096)),
        vit_in_chans=int(get(v, "num_channels", default=3)),
        patch_size=_side(get(v, "patch_size", default=14), "patch_size"),
        image_size=_side(get(v, "image_size", default=448), "image_size"),
        vit_eps=float(get(v, "layer_norm_eps", default=1e-6)),
        vit_act=str(get(v, "hidden_act", default="gelu")),
        vit_qkv_bias=bool(get(v, "attention_bias", "qkv_bias", default=False)),
    )


def _rope(text: Mapping[str, Any]) -> tuple[str, float]:
    rope = hf_config.rope_params(text)
    kind = str(get(rope, "rope_type", "type", default="default"))
    _refuse(kind not in ROPE_TYPES,
            f"text_config rope type {kind!r} is not supported: allowed "
            + ", ".join(map(repr, ROPE_TYPES)))  # fmt: skip
    return kind, hf_config.rope_theta(rope, text, 1e4)


def _text_fields(text: Mapping[str, Any]) -> dict:
    _refuse(text.get("model_type", "qwen2") != "qwen2",
            f"text_config.model_type = {text.get('model_type')!r} is not supported: allowed "
            "'qwen2' (InternVL3's LM)")  # fmt: skip
    _refuse(
        bool(text.get("use_sliding_window")),
        "text_config.use_sliding_window = true is not supported",
    )
    kind, theta = _rope(text)
    return hf_vlm.lm_fields(text) | dict(
        lm_rope_theta=theta,
        lm_rope_type=kind,
        lm_max_positions=int(get(text, "max_position_embeddings", default=32768)),
    )


def from_hf(raw: Mapping[str, Any]) -> InternVLConfig:
    """The config of a checkpoint's `config.json` (as a dict); a ConfigError naming what
    is missing, not an InternVL -hf checkpoint, or not supported (module docstring)."""
    if raw.get("model_type") == "internvl_chat":
        raise ConfigError(
            "config.json: model_type = 'internvl_chat' is the original OpenGVLab layout "
            "(fused qkv, remote code), which is not supported: use its -hf conversion "
            "(e.g. OpenGVLab/InternVL3-2B-hf, model_type 'internvl')"
        )
    fields.model_type(raw, MODEL_TYPES)
    _refuse(
        float(raw.get("downsample_ratio", 0.5)) != 0.5,
        f"downsample_ratio = {raw.get('downsample_ratio')} is not supported: allowed 0.5",
    )
    _refuse(raw.get("vision_feature_layer", -1) != -1,
            f"vision_feature_layer = {raw.get('vision_feature_layer')} is not supported: "
            "allowed -1 (the last block)")  # fmt: skip
    _refuse(raw.get("vision_feature_select_strategy", "default") != "default",
            f"vision_feature_select_strategy = {raw.get('vision_feature_select_strategy')!r} "
            "is not supported: allowed 'default' (CLS dropped)")  # fmt: skip
    text = raw.get("text_config") or {}
    return InternVLConfig(
        **_vision_fields(raw.get("vision_config") or {}),
        proj_act=str(raw.get("projector_hidden_act", "gelu")),
        **_text_fields(text),
        tie_embeddings=hf_config.tied(raw, text),  # a stored lm_head wins at load (as transformers)
        image_token_id=int(raw.get("image_token_id", 151667)),
        dtype=hf_config.stored_dtype(raw, text),
    )
