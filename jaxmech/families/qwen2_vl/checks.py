"""Input and edit checks of the Qwen-VL forward (`models.checks`, with Qwen's sites and
shapes): shapes always (static, also under `jax.jit`), values only when concrete
(`jaxmech.shapes`). Errors name the argument."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.models import checks
from jaxmech.models.checks import shape
from jaxmech.models.decoder import POINTS


def site_names(c: QwenVLConfig) -> tuple[str, ...]:
    """Every named site of `c`'s forward (`model` docstring), in order."""
    vit = ["vit/embed"] + ["vit/pos_embed"] * bool(c.vit_pos_table)
    for i in range(c.vit_depth):
        vit += [f"vit/{p}.{i}" for p in POINTS]
        if i in c.vit_deepstack:
            vit.append(f"vit/deepstack.{c.vit_deepstack.index(i)}")
    lm = []
    for i in range(c.lm_layers):
        lm += [f"lm/{p}.{i}" for p in POINTS]
        lm += [f"lm/resid_post_stack.{i}"] * (i < len(c.vit_deepstack))
    return (*vit, "merger/out", "lm/embed", *lm, "lm/final")


def check_inputs(inputs, c: QwenVLConfig) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    B, S = shape(inputs.tokens_BxS)
    P, F = shape(inputs.pixels_BxPxF)[1:]
    if shape(inputs.pixels_BxPxF)[0] != B:
        raise ValueError(f"pixels_BxPxF: batch {shape(inputs.pixels_BxPxF)[0]}, tokens have {B}")
    if F != c.patch_features:
        raise ValueError(
            f"pixels_BxPxF: {F} features per patch, expected {c.patch_features} "
            "(channels x temporal_patch_size x patch_size^2)"
        )
    unit = c.merge_size**2
    if P % unit:
        raise ValueError(f"pixels_BxPxF: {P} patches, expected a multiple of merge_size^2 = {unit}")
    want = {"pos_Bx3xS": (B, 3, S), "image_BxI": (B, P // unit), "valid_BxS": (B, S)}
    want |= {n: (B, P) for n in ("rows_BxP", "cols_BxP", "frame_BxP", "window_BxP")}
    checks.check_shapes(inputs, want)
    checks.check_image_positions(inputs.image_BxI, S)


def check_edits(edits, inputs, c: QwenVLConfig) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    P = shape(inputs.pixels_BxPxF)[1]
    n = c.vit_depth + bool(c.vit_pos_table)  # the table, then every block
    per = " (the position table's row, then one per block)" if c.vit_pos_table else ""
    examples = ("vit/resid_pre.0", "merger/out", f"lm/resid_post.{c.lm_layers - 1}")
    hf_vlm.check_edits(edits, inputs, c, site_names, "Qwen-VL", "qwen2_vl", per,
                       examples=examples, vit_shapes=[(P,), (n, P)], n_image=P // c.merge_size**2,
                       one_id=False)  # fmt: skip
