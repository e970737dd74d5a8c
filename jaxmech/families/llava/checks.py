"""Input and edit checks of the LLaVA forward: shapes always (static, also under
`jax.jit`), values only when concrete (`jaxmech.shapes`). Errors name the argument."""

from __future__ import annotations

import numpy as np

from jaxmech.families.llava.config import LlavaConfig
from jaxmech.models.decoder import POINTS, RESUME_SITES
from jaxmech.shapes import is_concrete

UNSUPPORTED = ("term_keep", "vp_keep", "rope_keep")
VIT_POINTS = tuple(p for p in POINTS if p not in ("rot_q", "rot_k"))  # no rotary in the ViT


def site_names(c: LlavaConfig) -> tuple[str, ...]:
    """Every named site of `c`'s forward (`model` docstring), in order."""
    vit = [f"vit/{p}.{i}" for i in range(c.vit_depth) for p in VIT_POINTS]
    lm = [f"lm/{p}.{i}" for i in range(c.lm_layers) for p in POINTS]
    return ("vit/embed", *vit, "proj/out", "lm/embed", *lm, "lm/final")


def _shape(x):
    return tuple(np.shape(x))


def check_inputs(inputs, c: LlavaConfig) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    B, S = _shape(inputs.tokens_BxS)
    Bp, P, F = _shape(inputs.pixels_BxPxF)
    if Bp != B:
        raise ValueError(f"pixels_BxPxF: batch {Bp}, tokens have {B}")
    if P not in (0, c.n_patches) or F != c.patch_features:
        raise ValueError(
            f"pixels_BxPxF: {P} patches of {F} features, expected {c.n_patches} (or 0: no "
            f"image) of {c.patch_features} (channels x patch_size^2)"
        )
    want = {"image_BxI": (B, P), "pos_BxS": (B, S), "valid_BxS": (B, S)}
    for name, shape in want.items():
        if _shape(getattr(inputs, name)) != shape:
            raise ValueError(f"{name}: shape {_shape(getattr(inputs, name))}, expected {shape}")
    if is_concrete(inputs.image_BxI) and P:
        image = np.asarray(inputs.image_BxI)
        if image.min() < 0 or image.max() >= S:
            raise ValueError(
                f"image_BxI: positions in [{image.min()}, {image.max()}], expected [0, {S})"
            )


def _check_names(edits, c: LlavaConfig) -> None:
    known = set(site_names(c))
    for field in ("replace", "add"):
        for name in getattr(edits, field):
            if name not in known:
                raise ValueError(
                    f"Edits.{field}[{name!r}]: not a site of this LLaVA (e.g. 'vit/resid_pre.0', "
                    f"'proj/out', 'lm/resid_post.{c.lm_layers - 1}')"
                )
    for field in UNSUPPORTED:
        if getattr(edits, field):
            raise ValueError(f"Edits.{field}: not supported by the llava family (its blocks "
                             "have no term decomposition or per-head rotary switch)")  # fmt: skip


def _check_lm_ids(ids, B: int, S: int) -> None:
    if _shape(ids) not in ((S,), (3, S), (B, 3, S)):
        raise ValueError(f"Edits.lm_pos_ids: shape {_shape(ids)}, expected ({S},), (3, {S}) or "
                         f"({B}, 3, {S})")  # fmt: skip
    if np.ndim(ids) > 1 and is_concrete(ids):
        x = np.asarray(ids)
        if not (x == x[..., :1, :]).all():
            raise ValueError("Edits.lm_pos_ids: the (t, row, col) rows differ; the LLaVA LM "
                             "has one position id per token (give [S] or equal rows)")  # fmt: skip


def check_edits(edits, inputs, c: LlavaConfig) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    _check_names(edits, c)
    B, S = _shape(inputs.tokens_BxS)
    n_image = _shape(inputs.image_BxI)[1]
    for field in ("vit_rows", "vit_cols"):
        x = getattr(edits, field)
        if x is not None and _shape(x) != (c.n_patches,):
            raise ValueError(f"Edits.{field}: shape {_shape(x)}, expected ({c.n_patches},): the "
                             "position each patch reads the table at (positions enter once)")  # fmt: skip
    if edits.lm_pos_ids is not None:
        _check_lm_ids(edits.lm_pos_ids, B, S)
    order = edits.image_order
    if order is not None:
        if _shape(order) != (n_image,):
            raise ValueError(f"Edits.image_order: shape {_shape(order)}, expected ({n_image},)")
        if is_concrete(order) and sorted(np.asarray(order).tolist()) != list(range(n_image)):
            raise ValueError(f"Edits.image_order: expected a permutation of 0..{n_image - 1}")


def check_resume(resume, inputs, c: LlavaConfig) -> None:
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
