"""Input and edit checks of the Gemma-3 forward (`models.checks`, with Gemma-3's sites
and shapes): shapes always (static, also under `jax.jit`), values only when concrete
(`jaxmech.shapes`). Errors name the argument."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.models import checks
from jaxmech.models.checks import shape


def site_names(c: Gemma3Config) -> tuple[str, ...]:
    """Every named site of `c`'s forward (`model` docstring), in order (no rotary in the
    ViT: no rot_q / rot_k there)."""
    return hf_vlm.lm_site_names(c, ("vit/embed",), ("vit/final", "proj/pooled", "proj/out"))


def check_inputs(inputs, c: Gemma3Config) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    hf_vlm.check_patches(inputs, c)
    B, S = shape(inputs.tokens_BxS)
    P = shape(inputs.pixels_BxPxF)[1]
    n_image = c.mm_tokens if P else 0
    checks.check_shapes(inputs, {"image_BxI": (B, n_image), "pos_BxS": (B, S),
                                 "valid_BxS": (B, S)})  # fmt: skip
    checks.check_image_positions(inputs.image_BxI, S)


def check_edits(edits, inputs, c: Gemma3Config) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    why = ": the position each patch reads the table at (positions enter once)"
    hf_vlm.check_edits(edits, inputs, c, site_names, "Gemma-3", "gemma3", why)
