"""Input and edit checks of the InternVL forward (`models.checks`, with InternVL's sites
and shapes): shapes always (static, also under `jax.jit`), values only when concrete
(`jaxmech.shapes`). Errors name the argument."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.internvl.config import InternVLConfig
from jaxmech.families.internvl.positions import tile_side
from jaxmech.models import checks
from jaxmech.models.checks import shape


def site_names(c: InternVLConfig) -> tuple[str, ...]:
    """Every named site of `c`'s forward (`model` docstring), in order (no rotary in the
    ViT: no rot_q / rot_k there)."""
    return hf_vlm.lm_site_names(c, ("vit/embed", "vit/pos"), ("proj/in", "proj/out"))


def check_inputs(inputs, c: InternVLConfig) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    B, S = shape(inputs.tokens_BxS)
    px = shape(inputs.pixels_BxTxPxF)
    if len(px) != 4 or px[0] != B:
        raise ValueError(f"pixels_BxTxPxF: shape {px}, expected ({B}, tiles, patches, features)")
    _, T, P, F = px
    if F != c.patch_features:
        raise ValueError(f"pixels_BxTxPxF: {F} features per patch, expected "
                         f"{c.patch_features} (channels x patch_size^2)")  # fmt: skip
    tile_side(P)
    checks.check_shapes(inputs, {"pos_BxS": (B, S), "image_BxI": (B, T * P // 4),
                                 "valid_BxS": (B, S)})  # fmt: skip
    if c.lm_rope_type == "dynamic" and S > c.lm_max_positions:
        raise ValueError(f"tokens_BxS: {S} tokens, more than max_position_embeddings = "
                         f"{c.lm_max_positions}, where dynamic rotary scaling would start")  # fmt: skip
    checks.check_image_positions(inputs.image_BxI, S)


def check_edits(edits, inputs, c: InternVLConfig) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    _, T, P, _ = shape(inputs.pixels_BxTxPxF)
    why = " (one position per patch of a tile; positions enter once, at the input)"
    examples = ("vit/pos", "proj/out", f"lm/resid_post.{c.lm_layers - 1}")
    hf_vlm.check_edits(edits, inputs, c, site_names, "InternVL", "internvl", why,
                       examples=examples, vit_shapes=[(P,)], n_image=T * P // 4)  # fmt: skip
