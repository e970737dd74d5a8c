"""Input and edit checks of the Gemma-3 forward (`models.checks`, with Gemma-3's sites
and shapes): shapes always (static, also under `jax.jit`), values only when concrete
(`jaxmech.shapes`). Errors name the argument."""

from __future__ import annotations

from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.models import checks
from jaxmech.models.checks import shape
from jaxmech.models.decoder import POINTS, UNROTATED_POINTS, block_sites


def site_names(c: Gemma3Config) -> tuple[str, ...]:
    """Every named site of `c`'s forward (`model` docstring), in order (no rotary in the
    ViT: no rot_q / rot_k there)."""
    vit = block_sites("vit", c.vit_depth, UNROTATED_POINTS)
    lm = block_sites("lm", c.lm_layers, POINTS)
    return ("vit/embed", *vit, "vit/final", "proj/pooled", "proj/out", "lm/embed", *lm,
            "lm/final")  # fmt: skip


def check_inputs(inputs, c: Gemma3Config) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    B, S = shape(inputs.tokens_BxS)
    Bp, P, F = shape(inputs.pixels_BxPxF)
    if Bp != B:
        raise ValueError(f"pixels_BxPxF: batch {Bp}, tokens have {B}")
    if P not in (0, c.n_patches) or F != c.patch_features:
        raise ValueError(
            f"pixels_BxPxF: {P} patches of {F} features, expected {c.n_patches} (or 0: no "
            f"image) of {c.patch_features} (channels x patch_size^2)"
        )
    n_image = c.mm_tokens if P else 0
    checks.check_shapes(inputs, {"image_BxI": (B, n_image), "pos_BxS": (B, S),
                                 "valid_BxS": (B, S)})  # fmt: skip
    checks.check_image_positions(inputs.image_BxI, S)


def check_edits(edits, inputs, c: Gemma3Config) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    examples = ("vit/resid_pre.0", "proj/out", f"lm/resid_post.{c.lm_layers - 1}")
    checks.check_names(edits, site_names(c), "Gemma-3", examples, "gemma3")
    B, S = shape(inputs.tokens_BxS)
    checks.check_vit_positions(edits, [(c.n_patches,)], ": the position each patch reads "
                               "the table at (positions enter once)")  # fmt: skip
    checks.check_lm_pos_ids(edits.lm_pos_ids, B, S, one_id="Gemma-3")
    checks.check_image_order(edits.image_order, shape(inputs.image_BxI)[1])
