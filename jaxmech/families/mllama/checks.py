"""Input and edit checks of the mllama forward (`models.checks`, with its sites and
shapes): shapes always (static, also under `jax.jit`), values only when concrete.
Errors name the argument."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.mllama.config import MllamaConfig
from jaxmech.models import checks
from jaxmech.models.checks import shape
from jaxmech.models.decoder import POINTS, UNROTATED_POINTS


def site_names(c: MllamaConfig) -> tuple[str, ...]:
    """Every named site of `c`'s forward (`model` docstring), in order."""
    vit = [f"vit/{p}.{i}" for i in range(c.vit_depth) for p in UNROTATED_POINTS]
    glob = [f"vit_global/{p}.{i}" for i in range(c.vit_global_depth) for p in UNROTATED_POINTS]
    lm = [f"lm/{p}.{i}" for i in range(c.lm_layers)
          for p in (("vision",) + UNROTATED_POINTS if i in c.cross_layers else POINTS)]  # fmt: skip
    return ("vit/embed", *vit, *glob, "vit/out", "proj/out", "lm/embed", *lm, "lm/final")


def check_inputs(inputs, c: MllamaConfig) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    B, S = shape(inputs.tokens_BxS)
    Bp, T, P, F = shape(inputs.pixels_BxTxPxF)
    if Bp != B:
        raise ValueError(f"pixels_BxTxPxF: batch {Bp}, tokens have {B}")
    if T not in (0, c.max_tiles) or P != c.n_patches or F != c.patch_features:
        raise ValueError(
            f"pixels_BxTxPxF: {T} tiles of {P} patches of {F} features, expected "
            f"{c.max_tiles} (or 0: no image) tiles of {c.n_patches} patches of "
            f"{c.patch_features} (channels x patch_size^2)"
        )
    I = c.n_vision_tokens if T else 0  # noqa: E741
    checks.check_shapes(inputs, {"aspect_B": (B,), "tiles_BxT": (B, T), "xattn_BxSxT": (B, S, T),
                                 "image_BxI": (B, I), "pos_BxS": (B, S), "valid_BxS": (B, S)})  # fmt: skip
    checks.check_image_positions(inputs.image_BxI, S)


def check_edits(edits, inputs, c: MllamaConfig) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    why = ": the position each patch of a tile reads both position tables at"
    hf_vlm.check_edits(edits, inputs, c, site_names, "mllama", "mllama", why)
