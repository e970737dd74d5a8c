"""Input and edit checks of the InternVL forward: shapes always (static, also under
`jax.jit`), values only when concrete (`jaxmech.shapes`). Errors name the argument."""

from __future__ import annotations

import numpy as np

from jaxmech.families.internvl.config import InternVLConfig
from jaxmech.families.internvl.positions import tile_side
from jaxmech.models.decoder import POINTS, RESUME_SITES
from jaxmech.shapes import is_concrete

UNSUPPORTED = ("term_keep", "vp_keep", "rope_keep")
VIT_POINTS = tuple(p for p in POINTS if p not in ("rot_q", "rot_k"))  # no rotary in the ViT


def site_names(c: InternVLConfig) -> tuple[str, ...]:
    """Every named site of `c`'s forward (`model` docstring), in order."""
    vit = [f"vit/{p}.{i}" for i in range(c.vit_depth) for p in VIT_POINTS]
    lm = [f"lm/{p}.{i}" for i in range(c.lm_layers) for p in POINTS]
    return ("vit/embed", "vit/pos", *vit, "proj/in", "proj/out", "lm/embed", *lm, "lm/final")


def _shape(x):
    return tuple(np.shape(x))


def check_inputs(inputs, c: InternVLConfig) -> None:
    """Shapes of an `Inputs` against each other and the config."""
    B, S = _shape(inputs.tokens_BxS)
    px = _shape(inputs.pixels_BxTxPxF)
    if len(px) != 4 or px[0] != B:
        raise ValueError(f"pixels_BxTxPxF: shape {px}, expected ({B}, tiles, patches, features)")
    _, T, P, F = px
    if F != c.patch_features:
        raise ValueError(f"pixels_BxTxPxF: {F} features per patch, expected "
                         f"{c.patch_features} (channels x patch_size^2)")  # fmt: skip
    tile_side(P)
    want = {"pos_BxS": (B, S), "image_BxI": (B, T * P // 4), "valid_BxS": (B, S)}
    for name, shape in want.items():
        if _shape(getattr(inputs, name)) != shape:
            raise ValueError(f"{name}: shape {_shape(getattr(inputs, name))}, expected {shape}")
    if c.lm_rope_type == "dynamic" and S > c.lm_max_positions:
        raise ValueError(f"tokens_BxS: {S} tokens, more than max_position_embeddings = "
                         f"{c.lm_max_positions}, where dynamic rotary scaling would start")  # fmt: skip
    if is_concrete(inputs.image_BxI) and T:
        image = np.asarray(inputs.image_BxI)
        if image.min() < 0 or image.max() >= S:
            raise ValueError(f"image_BxI: positions in [{image.min()}, {image.max()}], "
                             f"expected [0, {S})")  # fmt: skip


def _check_names(edits, c: InternVLConfig) -> None:
    known = set(site_names(c))
    for field in ("replace", "add"):
        for name in getattr(edits, field):
            if name not in known:
                raise ValueError(f"Edits.{field}[{name!r}]: not a site of this InternVL (e.g. "
                                 f"'vit/pos', 'proj/out', 'lm/resid_post.{c.lm_layers - 1}')")  # fmt: skip
    for field in UNSUPPORTED:
        if getattr(edits, field):
            raise ValueError(f"Edits.{field}: not supported by the internvl family (its "
                             "blocks have no term decomposition or per-head rotary switch)")  # fmt: skip


def _check_lm_ids(ids, B: int, S: int) -> None:
    if _shape(ids) not in ((S,), (3, S), (B, 3, S)):
        raise ValueError(f"Edits.lm_pos_ids: shape {_shape(ids)}, expected ({S},), (3, {S}) "
                         f"or ({B}, 3, {S})")  # fmt: skip
    if len(_shape(ids)) > 1 and is_concrete(ids):
        x = np.asarray(ids)
        if not (x == x[..., :1, :]).all():
            raise ValueError("Edits.lm_pos_ids: the LM has 1-D rotary positions, one id per "
                             "token: its three rows must be equal")  # fmt: skip


def check_edits(edits, inputs, c: InternVLConfig) -> None:
    """Site names, and the position / order edits' shapes (and values when concrete)."""
    _check_names(edits, c)
    B, S = _shape(inputs.tokens_BxS)
    _, T, P, _ = _shape(inputs.pixels_BxTxPxF)
    for field in ("vit_rows", "vit_cols"):
        x = getattr(edits, field)
        if x is not None and _shape(x) != (P,):
            raise ValueError(f"Edits.{field}: shape {_shape(x)}, expected ({P},) (one position "
                             "per patch of a tile; positions enter once, at the input)")  # fmt: skip
    if edits.lm_pos_ids is not None:
        _check_lm_ids(edits.lm_pos_ids, B, S)
    order, n_image = edits.image_order, T * P // 4
    if order is not None:
        if _shape(order) != (n_image,):
            raise ValueError(f"Edits.image_order: shape {_shape(order)}, expected ({n_image},)")
        if is_concrete(order) and sorted(np.asarray(order).tolist()) != list(range(n_image)):
            raise ValueError(f"Edits.image_order: expected a permutation of 0..{n_image - 1}")


def check_resume(resume, inputs, c: InternVLConfig) -> None:
    """A `Resume`'s block, start and shapes against the inputs (ValueError naming it)."""
    B, S = _shape(inputs.tokens_BxS)
    if not 0 <= resume.layer < c.lm_layers:
        raise ValueError(f"Resume.layer = {resume.layer}: expected a block in [0, {c.lm_layers})")
    if not 0 <= resume.start < S:
        raise ValueError(f"Resume.start = {resume.start}: expected a position in [0, {S})")
    want = (B, S - resume.start, c.lm_width)
    if _shape(resume.x_BxTxD) != want:
        raise ValueError(f"Resume.x_BxTxD: shape {_shape(resume.x_BxTxD)}, expected {want}")
    missing = [f"{n}.{i}" for i in range(resume.layer, c.lm_layers) for n in RESUME_SITES
               if f"{n}.{i}" not in resume.aux]  # fmt: skip
    if resume.start and missing:
        raise ValueError(f"Resume.aux: lacks {missing[:3]} (capture `RESUME_SITES`)")
