"""A Llama-3.2-Vision (mllama) checkpoint's architecture, read from its `config.json`.

One flat frozen config: the tiled vision tower's fields start with `vit_`, the Llama LM's
with `lm_`. `from_hf` reads the Hub's config.json (transformers 4.45) and transformers 5's
saves (the same nesting: `vision_config`, `text_config`), filling what a file leaves out
with transformers 5.25's class defaults (`MllamaVisionConfig`, `MllamaTextConfig`).

Supported: the default or "llama3" rotary scaling (the published checkpoints'), one
cross-attention layer set, the default supported aspect ratios (every (rows, cols) with
rows x cols <= max_num_tiles, cols fastest, as the reference lists them). Others are
refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxmech.config import ConfigError, choice, fail, int_in
from jaxmech.families import fields, hf_vlm
from jaxmech.models import hf_config
from jaxmech.models.hf_config import get


def aspect_ratios(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """The supported tile arrangements, as the reference enumerates them (first index
    outer); aspect-ratio id k + 1 names entry k (0: no image)."""
    return tuple((a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1)
                 if a * b <= max_tiles)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MllamaConfig(fields.SquareVisionFields, fields.RotaryTextFields):
    """One checkpoint's architecture (module docstring); defaults: a tiny mllama (the
    shared fields': `families.fields`; `vit_depth`: the local layers, `image_size`: one
    tile's side, `lm_vocab`: the lm_head's rows, the embedding holds lm_vocab + 8)."""

    vit_global_depth: int = 1  # gated global layers
    max_tiles: int = 4
    intermediate: tuple = (0, 1)  # local layers whose outputs join the features
    # "llama3" rotary scaling: (factor, low_freq_factor, high_freq_factor, original
    # context) or () for the default rotary
    lm_rope_llama3: tuple = ()
    lm_act: str = "silu"
    cross_layers: tuple = (1,)  # the LM layers that cross-attend to the image

    def __post_init__(self):
        self._check_vision()
        self._check_text()
        hf_config.check_positive(self, ("vit_global_depth", "max_tiles"))
        choice("lm_act", self.lm_act, fields.ACTIVATIONS)
        if self.vit_in_chans != 3:  # the processor and the key map read RGB
            fail("vit_in_chans", self.vit_in_chans, "3")
        for i in self.intermediate:
            int_in("intermediate", i, 0, self.vit_depth - 1)
        for i in self.cross_layers:
            int_in("cross_layers", i, 0, self.lm_layers - 1)
        if self.vit_width % self.vit_heads:
            fail("vit_width", self.vit_width, f"a multiple of vit_heads = {self.vit_heads}")
        if self.lm_width % self.lm_heads or self.lm_heads % self.lm_kv_heads:
            fail("lm_heads", self.lm_heads, "dividing lm_width, a multiple of lm_kv_heads")

    # grid and n_patches (one tile's, no CLS), vit_head_dim, patch_features:
    # `fields.SquareVisionFields`

    @property
    def embed_rows(self) -> int:
        return self.lm_vocab + 8

    @property
    def tile_rows(self) -> int:
        """Rows per tile in the encoders: CLS + patches, padded to a multiple of 8."""
        n = self.n_patches + 1
        return n + (8 - n % 8) % 8

    @property
    def lm_head_dim(self) -> int:
        return self.lm_width // self.lm_heads

    @property
    def n_aspect(self) -> int:
        """Aspect-ratio ids 0 .. n_aspect (0: padding)."""
        return len(aspect_ratios(self.max_tiles))

    @property
    def vision_dim(self) -> int:
        """The projector's input: the last output and each intermediate one per channel."""
        return self.vit_width * (1 + len(self.intermediate))

    @property
    def n_vision_tokens(self) -> int:
        """I, the cross-attention keys of one image: max_tiles x (CLS + patches)."""
        return self.max_tiles * (self.n_patches + 1)


VISION_DEFAULTS = dict(hidden_size=1280, hidden_act="gelu", num_hidden_layers=32,
                       num_global_layers=8, attention_heads=16, num_channels=3,
                       intermediate_size=5120, image_size=448, patch_size=14, norm_eps=1e-5,
                       max_num_tiles=4, intermediate_layers_indices=[3, 7, 15, 23, 30],
                       supported_aspect_ratios=None)  # fmt: skip
TEXT_DEFAULTS = dict(vocab_size=128256, hidden_size=4096, hidden_act="silu", num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                     rms_norm_eps=1e-5, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38],
                     tie_word_embeddings=False)  # fmt: skip


def _rope(text: Mapping[str, Any]) -> tuple[float, tuple]:
    rope = hf_config.rope_params(text)
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = hf_config.rope_theta(rope, text, 500000.0)
    if kind == "default":
        return theta, ()
    if kind == "llama3":
        return theta, (float(rope["factor"]), float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]),
                       float(rope["original_max_position_embeddings"]))  # fmt: skip
    raise ConfigError(f"config.json: text_config rope type {kind!r} is not supported "
                      "(only 'default' and 'llama3')")  # fmt: skip


def from_hf(raw: Mapping[str, Any]) -> MllamaConfig:
    """The config of a checkpoint's `config.json` (as a dict); a ConfigError naming what
    is not a supported mllama."""
    fields.model_type(raw, ("mllama",))
    v = VISION_DEFAULTS | (raw.get("vision_config") or {})
    t = TEXT_DEFAULTS | (raw.get("text_config") or {})
    tiles = int(v["max_num_tiles"])
    ratios = v.get("supported_aspect_ratios")
    if ratios is not None and [tuple(r) for r in ratios] != list(aspect_ratios(tiles)):
        raise ConfigError(f"config.json: vision_config supported_aspect_ratios = {ratios!r} is "
                          "not supported (only the default for max_num_tiles)")  # fmt: skip
    if int(v["num_channels"]) != 3:
        raise ConfigError("config.json: vision_config num_channels must be 3")
    theta, llama3 = _rope(t)
    c = MllamaConfig(
        **hf_vlm.lm_fields(t, head_dim=False),
        vit_depth=int(v["num_hidden_layers"]), vit_global_depth=int(v["num_global_layers"]),
        vit_width=int(v["hidden_size"]), vit_heads=int(v["attention_heads"]),
        vit_mlp=int(v["intermediate_size"]), image_size=int(v["image_size"]),
        patch_size=int(v["patch_size"]), max_tiles=tiles, vit_eps=float(v["norm_eps"]),
        vit_act=str(v["hidden_act"]),
        intermediate=tuple(int(i) for i in v["intermediate_layers_indices"]),
        lm_rope_theta=theta, lm_rope_llama3=llama3, lm_act=str(t["hidden_act"]),
        cross_layers=tuple(int(i) for i in t["cross_attention_layers"]),
        tie_embeddings=hf_config.tied(raw, t),
        image_token_id=int(get(raw, "image_token_index", "image_token_id", default=128256)),
        dtype=hf_config.stored_dtype(raw, t),
    )  # fmt: skip
    vod = v.get("vision_output_dim")
    if vod is not None and int(vod) != c.vision_dim:
        raise ConfigError(f"config.json: vision_config vision_output_dim = {vod} is not "
                          f"hidden_size x (1 + len(intermediate_layers_indices)) = {c.vision_dim}")  # fmt: skip
    return c
