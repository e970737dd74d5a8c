"""A Gemma-3 checkpoint's architecture, read from its `config.json`.

One flat frozen config: the SigLIP vision tower's fields start with `vit_`, the Gemma-3
language model's with `lm_`. `from_hf` reads both layouts met and fills what a file
leaves out with the reference's class defaults (transformers 5.25's
`SiglipVisionConfig`, `Gemma3TextConfig`, `Gemma3Config`), as the Hub's sparse
config.json of google/gemma-3-4b-it relies on them:

* the Hub's files (transformers 4.50): `rope_theta` (the global layers', default 1e6),
  `rope_local_base_freq` (the sliding layers', default 1e4), `rope_scaling` (the global
  layers' only), `sliding_window_pattern` (layer i global where (i + 1) % pattern == 0,
  default 6);
* transformers 5 saves: `layer_types` and per-layer-type `rope_parameters`.

Supported: rotary "default" and "linear" (gemma-3-4b's global layers: the frequencies
divided by `factor`), SigLIP without its pooling head (`vision_use_head` false; a stored
head is not loaded), no bidirectional LM (`use_bidirectional_attention`). The reference's
`Gemma3ForConditionalGeneration` applies neither `attn_logit_softcapping` nor
`final_logit_softcapping` (its attention never passes the cap, its head never reads it),
so neither is read here. Others are refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxmech.config import ConfigError, choice, fail, int_in
from jaxmech.families import fields, hf_vlm
from jaxmech.models import hf_config
from jaxmech.models.hf_config import get

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "linear")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(fields.SquareVisionFields, fields.TextFields):
    """One checkpoint's architecture (module docstring); defaults: a tiny Gemma-3 (the
    shared fields': `families.fields`; the vision tower is a SigLIP, no CLS, no head)."""

    # projector: average pooling to mm_tokens (a square), Gemma RMSNorm (vit_eps), x @ W
    mm_tokens: int = 4
    # language model (Gemma-3)
    lm_head_dim: int = 8
    lm_act: str = "gelu_pytorch_tanh"
    lm_query_scale: float = 8.0  # query_pre_attn_scalar: scores scaled by its -1/2 power
    lm_window: int = 4096  # the sliding layers' window (a token sees W - 1 earlier ones)
    lm_layer_types: tuple = ("sliding_attention", "full_attention")
    lm_local_theta: float = 10_000.0  # the sliding layers' rotary base
    lm_global_theta: float = 1_000_000.0  # the global layers'
    lm_local_factor: float = 1.0  # linear rotary scaling (1: none) of the sliding layers
    lm_global_factor: float = 1.0  # of the global layers (gemma-3-4b: 8)
    boi_token_id: int = 61
    eoi_token_id: int = 62

    def __post_init__(self):
        self._check_vision()
        self._check_text()
        hf_config.check_positive(self, ("mm_tokens", "lm_head_dim", "lm_window"),
                                 ("lm_query_scale", "lm_local_theta", "lm_global_theta",
                                  "lm_local_factor", "lm_global_factor"))  # fmt: skip
        choice("lm_act", self.lm_act, fields.ACTIVATIONS)
        for name in ("boi_token_id", "eoi_token_id"):
            int_in(name, getattr(self, name), 0, self.lm_vocab - 1)
        if len(self.lm_layer_types) != self.lm_layers:
            fail("lm_layer_types", self.lm_layer_types, f"one type per layer ({self.lm_layers})")
        for t in self.lm_layer_types:
            choice("lm_layer_types", t, LAYER_TYPES)
        side = round(self.mm_tokens**0.5)
        if side * side != self.mm_tokens or self.grid % side:
            fail("mm_tokens", self.mm_tokens,
                 f"a square whose side divides the {self.grid} x {self.grid} patch grid")  # fmt: skip
        hf_config.check_heads(self)

    # grid (64 for gemma-3's 896 px at 14 px), n_patches, vit_head_dim, patch_features:
    # `fields.SquareVisionFields`

    @property
    def token_grid(self) -> int:
        """Image tokens per side after the pooling (16 for gemma-3: 256 tokens)."""
        return round(self.mm_tokens**0.5)

    @property
    def pool(self) -> int:
        """The average pooling's kernel and stride, in patches (4 for gemma-3)."""
        return self.grid // self.token_grid

    def sliding(self, i: int) -> bool:
        """Whether LM layer i attends within the sliding window."""
        return self.lm_layer_types[i] == "sliding_attention"


VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                       hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                       vision_use_head=True)  # fmt: skip
TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                     num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                     head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                     query_pre_attn_scalar=256, sliding_window=4096, attention_bias=False,
                     use_bidirectional_attention=False)  # fmt: skip


def _rope(params: Mapping[str, Any] | None, theta: float, where: str) -> tuple[float, float]:
    """(base, linear factor) of one layer type's rotary settings."""
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json: text_config {where} rope type {kind!r} is not "
                          f"supported (only {', '.join(ROPE_TYPES)})")  # fmt: skip
    factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    return float(params.get("rope_theta", theta)), factor


def _layers(t: Mapping[str, Any]) -> tuple:
    n = int(t["num_hidden_layers"])
    types = t.get("layer_types")
    if types is None:
        pattern = int(get(t, "sliding_window_pattern", "_sliding_window_pattern", default=6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return tuple(str(x) for x in types)


def _text_fields(t: Mapping[str, Any]) -> dict:
    if t.get("model_type", "gemma3_text") != "gemma3_text":
        raise ConfigError(f"config.json: text_config model_type = {t['model_type']!r} is not "
                          "supported (only 'gemma3_text')")  # fmt: skip
    if t.get("use_bidirectional_attention"):
        raise ConfigError("config.json: text_config use_bidirectional_attention = true is not "
                          "supported (only the causal LM)")  # fmt: skip
    if t.get("attention_bias"):
        raise ConfigError("config.json: text_config attention_bias = true is not supported")
    params = t.get("rope_parameters")
    if params and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention"), params.get("sliding_attention")
    else:  # the Hub's 4.x fields
        full = dict(t.get("rope_scaling") or {})
        full.setdefault("rope_theta", float(t.get("rope_theta", 1_000_000.0)))
        local = {"rope_type": "default",
                 "rope_theta": float(t.get("rope_local_base_freq", 10_000.0))}  # fmt: skip
    g_theta, g_factor = _rope(full, 1_000_000.0, "full_attention")
    l_theta, l_factor = _rope(local, 10_000.0, "sliding_attention")
    return hf_vlm.lm_fields(t) | dict(
                lm_act=str(get(t, "hidden_activation", "hidden_act")),
                lm_query_scale=float(t["query_pre_attn_scalar"]),
                lm_window=int(t["sliding_window"]), lm_layer_types=_layers(t),
                lm_local_theta=l_theta, lm_global_theta=g_theta, lm_local_factor=l_factor,
                lm_global_factor=g_factor)  # fmt: skip


def _vision_fields(raw: Mapping[str, Any]) -> dict:
    v = VISION_DEFAULTS | (raw.get("vision_config") or {})
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ConfigError(f"config.json: vision_config model_type = {v['model_type']!r} is not "
                          "supported (only 'siglip_vision_model')")  # fmt: skip
    if v["vision_use_head"]:
        raise ConfigError("config.json: vision_config vision_use_head = true is not supported "
                          "(Gemma-3's SigLIP has no pooling head)")  # fmt: skip
    return hf_vlm.vit_fields(v)


def from_hf(raw: Mapping[str, Any]) -> Gemma3Config:
    """The config of a checkpoint's `config.json` (as a dict); a ConfigError naming what
    is not a supported Gemma-3."""
    fields.model_type(raw, ("gemma3",))
    text = TEXT_DEFAULTS | (raw.get("text_config") or {})
    tied = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return Gemma3Config(
        **_vision_fields(raw),
        mm_tokens=int(raw.get("mm_tokens_per_image", 256)),
        **_text_fields(text),
        tie_embeddings=bool(tied),
        image_token_id=int(get(raw, "image_token_index", "image_token_id", default=262_144)),
        boi_token_id=int(get(raw, "boi_token_index", "boi_token_id", default=255_999)),
        eoi_token_id=int(get(raw, "eoi_token_index", "eoi_token_id", default=256_000)),
        dtype=hf_config.stored_dtype(raw, text),
    )
