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

from jaxmech.config import ConfigError, fail, int_in
from jaxmech.families import hf_vlm
from jaxmech.models import hf_config
from jaxmech.models.hf_config import get

SIZES = ("vit_depth", "vit_global_depth", "vit_width", "vit_heads", "vit_mlp", "image_size",
         "patch_size", "max_tiles", "lm_vocab", "lm_width", "lm_layers", "lm_heads",
         "lm_kv_heads", "lm_mlp")  # fmt: skip


def aspect_ratios(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """The supported tile arrangements, as the reference enumerates them (first index
    outer); aspect-ratio id k + 1 names entry k (0: no image)."""
    return tuple((a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1)
                 if a * b <= max_tiles)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MllamaConfig(hf_vlm.PatchGeometry):
    """One checkpoint's architecture (module docstring); defaults: the fixture's tiny one."""

    # vision tower
    vit_depth: int = 2  # local layers
    vit_global_depth: int = 1  # gated global layers
    vit_width: int = 32
    vit_heads: int = 2
    vit_mlp: int = 64
    image_size: int = 28  # one tile's side in pixels
    patch_size: int = 7
    max_tiles: int = 4
    vit_eps: float = 1e-5
    vit_act: str = "gelu"
    intermediate: tuple = (0, 1)  # local layers whose outputs join the features
    # language model (Llama with cross-attention layers)
    lm_vocab: int = 64  # lm_head rows; the embedding holds lm_vocab + 8
    lm_width: int = 32
    lm_layers: int = 4
    lm_heads: int = 4
    lm_kv_heads: int = 2
    lm_mlp: int = 64
    lm_eps: float = 1e-5
    lm_rope_theta: float = 500000.0
    # "llama3" rotary scaling: (factor, low_freq_factor, high_freq_factor, original
    # context) or () for the default rotary
    lm_rope_llama3: tuple = ()
    lm_act: str = "silu"
    cross_layers: tuple = (2,)
    tie_embeddings: bool = False
    image_token_id: int = 64
    dtype: str = "float32"

    def __post_init__(self):
        hf_config.check_positive(self, SIZES, ("vit_eps", "lm_eps", "lm_rope_theta"))
        for name in ("vit_act", "lm_act"):
            if getattr(self, name) not in ("gelu", "silu", "quick_gelu", "gelu_pytorch_tanh"):
                fail(name, getattr(self, name), "one of gelu, silu, quick_gelu, gelu_pytorch_tanh")
        int_in("image_token_id", self.image_token_id, 0, self.lm_vocab + 7)
        if self.image_size % self.patch_size:
            fail("image_size", self.image_size, f"a multiple of patch_size = {self.patch_size}")
        for i in self.intermediate:
            int_in("intermediate", i, 0, self.vit_depth - 1)
        for i in self.cross_layers:
            int_in("cross_layers", i, 0, self.lm_layers - 1)
        if self.vit_width % self.vit_heads:
            fail("vit_width", self.vit_width, f"a multiple of vit_heads = {self.vit_heads}")
        if self.lm_width % self.lm_heads or self.lm_heads % self.lm_kv_heads:
            fail("lm_heads", self.lm_heads, "dividing lm_width, a multiple of lm_kv_heads")

    vit_in_chans = 3  # (not a field: RGB only, `from_hf`)
    # grid and n_patches (one tile's, no CLS), vit_head_dim, patch_features:
    # `hf_vlm.PatchGeometry`

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
    if raw.get("model_type") != "mllama":
        raise ConfigError(f"config.json: model_type = {raw.get('model_type')!r} is not "
                          "supported: allowed 'mllama'")  # fmt: skip
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
