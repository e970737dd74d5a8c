"""Input and edit checks of the Qwen-VL forward: shapes always (static, also under
`jax.jit`), values only when concrete (`jaxmech.shapes`). Errors name the argument."""

from __future__ import annotations

import numpy as np

from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.models.decoder import POINTS, RESUME_SITES
from jaxmech.shapes import is_concrete

UNSUPPORTED = ("term_keep", "vp_keep", "rope_keep")


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


def _shape(x):
    return tuple(np.shape(x))


def check_inputs(inputs, c: QwenVLConfig) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    B, S = _shape(inputs.tokens_BxS)
    P, F = _shape(inputs.pixels_BxPxF)[1:]
    if _shape(inputs.pixels_BxPxF)[0] != B:
        raise ValueError(f"pixels_BxPxF: batch {_shape(inputs.pixels_BxPxF)[0]}, tokens have {B}")
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
    for name, shape in want.items():
        if _shape(getattr(inputs, name)) != shape:
            raise ValueError(f"{name}: shape {_shape(getattr(inputs, name))}, expected {shape}")
    if is_concrete(inputs.image_BxI) and P:
        image = np.asarray(inputs.image_BxI)
        if image.min() < 0 or image.max() >= S:
            raise ValueError(
                f"image_BxI: positions in [{image.min()}, {image.max()}], expected [0, {S})"
            )


def _check_names(edits, c: QwenVLConfig) -> None:
    known = set(site_names(c))
    for field in ("replace", "add"):
        for name in getattr(edits, field):
            if name not in known:
                raise ValueError(
                    f"Edits.{field}[{name!r}]: not a site of this Qwen-VL "
                    f"(e.g. 'vit/resid_pre.0', 'merger/out', 'lm/resid_post.{c.lm_layers - 1}')"
                )
    for field in UNSUPPORTED:
        if getattr(edits, field):
            raise ValueError(
                f"Edits.{field}: not supported by the qwen2_vl family (its blocks have "
                "no term decomposition or per-head rotary switch)"
            )


def check_edits(edits, inputs, c: QwenVLConfig) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    _check_names(edits, c)
    B, S = _shape(inputs.tokens_BxS)
    P = _shape(inputs.pixels_BxPxF)[1]
    n_image = P // c.merge_size**2
    n = c.vit_depth + bool(c.vit_pos_table)  # the table, then every block
    for field in ("vit_rows", "vit_cols"):
        x = getattr(edits, field)
        if x is not None and _shape(x) not in ((P,), (n, P)):
            per = " (the position table's row, then one per block)" if c.vit_pos_table else ""
            raise ValueError(
                f"Edits.{field}: shape {_shape(x)}, expected ({P},) or ({n}, {P}){per}"
            )
    if edits.lm_pos_ids is not None and _shape(edits.lm_pos_ids) not in ((S,), (3, S), (B, 3, S)):
        raise ValueError(
            f"Edits.lm_pos_ids: shape {_shape(edits.lm_pos_ids)}, expected ({S},), "
            f"(3, {S}) or ({B}, 3, {S})"
        )
    order = edits.image_order
    if order is not None:
        if _shape(order) != (n_image,):
            raise ValueError(f"Edits.image_order: shape {_shape(order)}, expected ({n_image},)")
        if is_concrete(order) and sorted(np.asarray(order).tolist()) != list(range(n_image)):
            raise ValueError(f"Edits.image_order: expected a permutation of 0..{n_image - 1}")


def check_resume(resume, inputs, c: QwenVLConfig) -> None:
    """A `Resume`'s block, start and shapes against the inputs (ValueError naming it)."""
    B, S = np.shape(inputs.tokens_BxS)
    if not 0 <= resume.layer < c.lm_layers:
        raise ValueError(f"Resume.layer = {resume.layer}: expected a block in [0, {c.lm_layers})")
    if not 0 <= resume.start < S:
        raise ValueError(f"Resume.start = {resume.start}: expected a position in [0, {S})")
    want = (B, S - resume.start, c.lm_width)
    if np.shape(resume.x_BxTxD) != want:
        raise ValueError(f"Resume.x_BxTxD: shape {np.shape(resume.x_BxTxD)}, expected {want}")
    missing = [f"{n}.{i}" for i in range(resume.layer, c.lm_layers) for n in RESUME_SITES
               if f"{n}.{i}" not in resume.aux]  # fmt: skip
    if resume.start and missing:
        raise ValueError(f"Resume.aux: lacks {missing[:3]} (capture `RESUME_SITES`)")
