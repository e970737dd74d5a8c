"""The config fields every checkpoint family shares, declared once with their checks.

A family's config is a frozen dataclass that inherits the vision tower's fields
(`VisionFields`, or `SquareVisionFields` where each image (or tile) is one square of
patches) and the language model's (`TextFields`, or `RotaryTextFields` where the LM has
one rotary base), and declares only what is its own. Its `__post_init__` calls
`_check_vision()` and `_check_text()` first (each names the first bad field, so a size
is known to be >= 1 before the family's own checks divide by it), then its own checks.

The defaults are one tiny model valid in every family (2 ViT blocks of width 32 on 28 px
images of 7 px patches, 2 LM layers of width 32, a 64-token vocabulary); each family's
own fields default to values that fit it. `from_hf` sets every field from a checkpoint's
config.json (`hf_vlm.vit_fields`, `hf_vlm.lm_fields`), so the defaults serve tests only;
it starts with `model_type`, the refusal of a config.json of another kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxmech.config import ConfigError, choice, fail, int_in
from jaxmech.models import hf_config
from jaxmech.models.scan import REMAT

# the MLP activations the families' forwards implement (Hugging Face's names)
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "silu")
VISION_SIZES = ("vit_depth", "vit_width", "vit_heads", "vit_mlp", "vit_in_chans", "patch_size")
TEXT_SIZES = ("lm_vocab", "lm_width", "lm_layers", "lm_heads", "lm_kv_heads", "lm_mlp")


@dataclasses.dataclass(frozen=True)
class VisionFields:
    """The vision tower's sizes that every family's ViT has."""

    vit_depth: int = 2  # transformer blocks
    vit_width: int = 32  # E, the residual stream's width
    vit_heads: int = 2
    vit_mlp: int = 64  # the MLP's hidden width
    vit_in_chans: int = 3  # a pixel's channels
    patch_size: int = 7  # a patch's side in pixels
    vit_eps: float = 1e-6  # the norms' epsilon
    vit_act: str = "gelu"  # the MLP's activation (`ACTIVATIONS`)

    @property
    def vit_head_dim(self) -> int:
        return self.vit_width // self.vit_heads

    def _check_vision(self) -> None:
        """Sizes >= 1, eps > 0, a known activation (a ConfigError naming the field)."""
        hf_config.check_positive(self, VISION_SIZES, ("vit_eps",))
        choice("vit_act", self.vit_act, ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class SquareVisionFields(VisionFields):
    """A ViT whose input is a square of `image_size` pixels (a CLIP / SigLIP /
    InternViT image, an mllama tile): its patch grid's derived sizes."""

    image_size: int = 28  # the input's side in pixels (the position table's extent)

    @property
    def grid(self) -> int:
        """Patches per side of the ViT's square input."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        """P, the ViT's patches (a CLS token not counted)."""
        return self.grid**2

    @property
    def patch_features(self) -> int:
        """One flattened patch's length: C x patch x patch, channel first."""
        return self.vit_in_chans * self.patch_size**2

    def _check_vision(self) -> None:
        super()._check_vision()
        int_in("image_size", self.image_size, 1)
        self._check_image()

    def _check_image(self) -> None:
        """The patches tile the image (a family with a stricter rule overrides this)."""
        if self.image_size % self.patch_size:
            fail("image_size", self.image_size, f"a multiple of patch_size = {self.patch_size}")


@dataclasses.dataclass(frozen=True)
class TextFields:
    """The language model's sizes and the fields about its tokens and storage that
    every family has."""

    lm_vocab: int = 64  # the output head's rows
    lm_width: int = 32  # D, the residual stream's width
    lm_layers: int = 2
    lm_heads: int = 4  # query heads
    lm_kv_heads: int = 2  # key / value heads (grouped-query attention: a divisor of lm_heads)
    lm_mlp: int = 64  # the MLP's hidden width
    lm_eps: float = 1e-6  # the RMSNorms' epsilon
    tie_embeddings: bool = False  # the output head is the embedding's transpose
    image_token_id: int = 60  # the token the image's features replace
    dtype: str = "float32"  # the checkpoint's stored dtype (informational)
    # what each scanned block (ViT and LM) keeps for a backward (`models.scan.REMAT`):
    # values unchanged, memory under a gradient only; a fine-tune sets it
    # (`dataclasses.replace`), from_hf never does
    remat: str = "off"

    @property
    def embed_rows(self) -> int:
        """The embedding's rows: the token ids a prompt may hold."""
        return self.lm_vocab

    def _check_text(self) -> None:
        """Sizes >= 1, eps > 0, an image token the embedding has, a known `remat` (a
        ConfigError naming the field)."""
        hf_config.check_positive(self, TEXT_SIZES, ("lm_eps",))
        int_in("image_token_id", self.image_token_id, 0, self.embed_rows - 1)
        choice("remat", self.remat, tuple(REMAT))


@dataclasses.dataclass(frozen=True)
class RotaryTextFields(TextFields):
    """A language model with one rotary base for every layer."""

    lm_rope_theta: float = 10000.0  # the rotary positions' base

    def _check_text(self) -> None:
        super()._check_text()
        hf_config.check_positive(self, (), ("lm_rope_theta",))


def model_type(raw: Mapping[str, Any], allowed: tuple[str, ...]) -> str:
    """config.json's `model_type` (`raw`: the file as a dict) if it is one of `allowed`;
    else a ConfigError naming it and what is allowed."""
    kind = raw.get("model_type")
    if kind not in allowed:
        raise ConfigError(f"config.json: model_type = {kind!r} is not supported: allowed "
                          + ("one of " if len(allowed) > 1 else "")
                          + ", ".join(map(repr, allowed)))  # fmt: skip
    return kind
