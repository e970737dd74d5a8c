"""A LLaVA-1.5 checkpoint's architecture, read from its `config.json`.

One flat frozen config: the CLIP vision tower's fields start with `vit_`, the
projector's with `proj_`, the Llama language model's with `lm_`. `from_hf` reads both
layouts met so far and fills what a file leaves out with the reference's class
defaults (transformers 5.25's `CLIPVisionConfig`, `LlamaConfig`, `LlavaConfig`), as
llava-hf's sparse config.json relies on them (its text_config names only the vocabulary,
the norm's eps and the context length):

* llava-hf's Hub files (transformers 4.36): `torch_dtype`, a sparse `text_config`;
* transformers 5 saves: every field, `rope_parameters`, `dtype`.

Supported: features from one ViT layer (`vision_feature_layer`, an int) with the CLS
token dropped (`vision_feature_select_strategy` "default"), a Linear-GELU-Linear
projector, Llama blocks with the default rotary positions (no rope scaling). Others
are refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxmech.config import ConfigError, choice, fail
from jaxmech.families import fields, hf_vlm
from jaxmech.models import hf_config
from jaxmech.models.hf_config import get


@dataclasses.dataclass(frozen=True)
class LlavaConfig(fields.SquareVisionFields, fields.RotaryTextFields):
    """One checkpoint's architecture (module docstring); defaults: a tiny LLaVA (the
    shared fields': `families.fields`). Not a `config.ModelConfig`: a checkpoint family
    is loaded, not trained."""

    # the hidden state the projector reads (Hugging Face's index: 0 the embeddings after
    # pre_layrnorm, i the output of block i - 1; negative from the end)
    feature_layer: int = -2
    proj_act: str = "gelu"  # the projector's (Linear, act, Linear)
    proj_bias: bool = True
    lm_head_dim: int = 8
    lm_act: str = "silu"
    lm_attention_bias: bool = False
    lm_mlp_bias: bool = False

    def __post_init__(self):
        self._check_vision()
        self._check_text()
        hf_config.check_positive(self, ("lm_head_dim",))
        for name in ("proj_act", "lm_act"):
            choice(name, getattr(self, name), fields.ACTIVATIONS)
        if not -(self.vit_depth + 1) <= self.feature_layer <= self.vit_depth:
            fail("feature_layer", self.feature_layer,
                 f"a hidden-state index in [{-(self.vit_depth + 1)}, {self.vit_depth}]")  # fmt: skip
        hf_config.check_heads(self)

    # grid (24 for LLaVA-1.5's 336 px at 14 px), n_patches (the image tokens),
    # vit_head_dim, patch_features: `fields.SquareVisionFields`

    @property
    def feature_block(self) -> int:
        """How many ViT blocks the projector's features have been through."""
        return self.feature_layer % (self.vit_depth + 1)


def _rope_theta(text: Mapping[str, Any]) -> float:
    """The LM's rotary base; a ConfigError for a scaled rotary (not reproduced)."""
    rope = hf_config.rope_params(text)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"config.json: text_config rope type {kind!r} is not supported "
                          "(only the default rotary positions)")  # fmt: skip
    return hf_config.rope_theta(rope, text, 10000.0)


def _check_features(raw: Mapping[str, Any]) -> int:
    layer = raw.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ConfigError(f"config.json: vision_feature_layer = {layer!r} is not supported "
                          "(one layer, an int)")  # fmt: skip
    select = raw.get("vision_feature_select_strategy", "default")
    if select != "default":
        raise ConfigError(f"config.json: vision_feature_select_strategy = {select!r} is not "
                          "supported (only 'default': the CLS token dropped)")  # fmt: skip
    return layer


# the reference's class defaults for what a config.json leaves out (module docstring)
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                       hidden_act="quick_gelu", layer_norm_eps=1e-5)  # fmt: skip
# LlavaConfig's when config.json has no vision_config at all: CLIP ViT-L/14-336
LLAVA_VISION = VISION_DEFAULTS | dict(hidden_size=1024, intermediate_size=4096,
                                      num_hidden_layers=24, num_attention_heads=16,
                                      image_size=336, patch_size=14)  # fmt: skip
TEXT_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                     num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
                     rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False)  # fmt: skip


def _vision_fields(raw: Mapping[str, Any]) -> dict:
    v = LLAVA_VISION if raw.get("vision_config") is None else VISION_DEFAULTS | raw["vision_config"]
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ConfigError(f"config.json: vision_config model_type = {v['model_type']!r} is not "
                          "supported (only 'clip_vision_model')")  # fmt: skip
    return hf_vlm.vit_fields(v) | dict(feature_layer=_check_features(raw))


def _text_fields(t: Mapping[str, Any]) -> dict:
    return hf_vlm.lm_fields(t) | dict(
        lm_rope_theta=_rope_theta(t), lm_act=str(t["hidden_act"]),
        lm_attention_bias=bool(t["attention_bias"]), lm_mlp_bias=bool(t["mlp_bias"]))  # fmt: skip


def from_hf(raw: Mapping[str, Any]) -> LlavaConfig:
    """The config of a checkpoint's `config.json` (as a dict); a ConfigError naming what
    is not a supported LLaVA."""
    fields.model_type(raw, ("llava",))
    text = TEXT_DEFAULTS | (raw.get("text_config") or {})
    if text.get("model_type", "llama") != "llama":
        raise ConfigError(f"config.json: text_config model_type = {text['model_type']!r} is "
                          "not supported (only 'llama')")  # fmt: skip
    return LlavaConfig(
        **_vision_fields(raw),
        proj_act=str(raw.get("projector_hidden_act", "gelu")),
        proj_bias=bool(raw.get("multimodal_projector_bias", True)),
        **_text_fields(text),
        tie_embeddings=hf_config.tied(raw, text),
        image_token_id=int(get(raw, "image_token_index", "image_token_id", default=32000)),
        dtype=hf_config.stored_dtype(raw, text),
    )
