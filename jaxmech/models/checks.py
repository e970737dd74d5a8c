"""The argument checks every loaded checkpoint family's forward runs: the sites an `Edits`
names, the `Edits` fields a family does not read, the position / order edits' shapes,
a `Resume` against its inputs, the inputs' shapes against each other.

Shared so that every family refuses the same mistake in the same words, each error
naming the argument (`Edits.vit_cols`, `Resume.layer`, `image_BxI`, ...). A family
passes what differs as data: its site list, its name in messages, the shapes its
position edits take. Shapes are checked always (static, also under `jax.jit`), values
only when concrete (`jaxmech.shapes.is_concrete`).

Axis names (`jaxmech.shapes`): B sequences, S LM tokens, P ViT tokens, I image tokens.
"""

from __future__ import annotations

import numpy as np

from jaxmech.models.decoder import RESUME_SITES
from jaxmech.shapes import is_concrete

# `Edits` fields of the trained families' towers, which no loaded family's blocks read
UNSUPPORTED = ("term_keep", "vp_keep", "rope_keep")


def shape(x) -> tuple:
    """`x`'s shape as a tuple (arrays, tracers and nested lists alike)."""
    return tuple(np.shape(x))


def check_shapes(inputs, want: dict) -> None:
    """Each field `name` of `inputs` of shape `want[name]` (ValueError naming it)."""
    for name, expected in want.items():
        if shape(getattr(inputs, name)) != tuple(expected):
            raise ValueError(f"{name}: shape {shape(getattr(inputs, name))}, expected {expected}")


def check_image_positions(image_BxI, S: int) -> None:
    """The image tokens' LM positions within the S tokens (when concrete and any)."""
    if is_concrete(image_BxI) and np.size(image_BxI):
        image = np.asarray(image_BxI)
        if image.min() < 0 or image.max() >= S:
            raise ValueError(
                f"image_BxI: positions in [{image.min()}, {image.max()}], expected [0, {S})"
            )


def check_names(edits, sites, model: str, examples, family: str) -> None:
    """`Edits.replace` / `add` name only `sites` (the error says `model`'s and gives
    `examples`), and the fields no loaded family reads (`UNSUPPORTED`) are empty (the
    error names `family`)."""
    known = set(sites)
    for field in ("replace", "add"):
        for name in getattr(edits, field):
            if name not in known:
                raise ValueError(f"Edits.{field}[{name!r}]: not a site of this {model} "
                                 f"(e.g. {', '.join(map(repr, examples))})")  # fmt: skip
    for field in UNSUPPORTED:
        if getattr(edits, field):
            raise ValueError(f"Edits.{field}: not supported by the {family} family (its blocks "
                             "have no term decomposition or per-head rotary switch)")  # fmt: skip


def check_vit_positions(edits, shapes, why: str = "") -> None:
    """`Edits.vit_rows` / `vit_cols` of one of `shapes` where given (the error lists
    them, then `why`)."""
    for field in ("vit_rows", "vit_cols"):
        x = getattr(edits, field)
        if x is not None and shape(x) not in [tuple(s) for s in shapes]:
            expected = " or ".join(str(tuple(s)) for s in shapes)
            raise ValueError(f"Edits.{field}: shape {shape(x)}, expected {expected}{why}")


def check_lm_pos_ids(ids, B: int, S: int, one_id: str | None = None) -> None:
    """`Edits.lm_pos_ids` [S], [3, S] or [B, 3, S] where given; `one_id`: the model
    whose LM reads one id per token (1-D rotary), so the three rows must be equal
    (when concrete)."""
    if ids is None:
        return
    if shape(ids) not in ((S,), (3, S), (B, 3, S)):
        raise ValueError(f"Edits.lm_pos_ids: shape {shape(ids)}, expected ({S},), (3, {S}) or "
                         f"({B}, 3, {S})")  # fmt: skip
    if one_id and np.ndim(ids) > 1 and is_concrete(ids):
        x = np.asarray(ids)
        if not (x == x[..., :1, :]).all():
            raise ValueError(f"Edits.lm_pos_ids: the (t, row, col) rows differ; the {one_id} LM "
                             "has 1-D rotary positions, one id per token: its three rows must "
                             "be equal (or give [S])")  # fmt: skip


def check_image_order(order, n_image: int) -> None:
    """`Edits.image_order` a permutation of the I = `n_image` image tokens where given."""
    if order is None:
        return
    if shape(order) != (n_image,):
        raise ValueError(f"Edits.image_order: shape {shape(order)}, expected ({n_image},)")
    if is_concrete(order) and sorted(np.asarray(order).tolist()) != list(range(n_image)):
        raise ValueError(f"Edits.image_order: expected a permutation of 0..{n_image - 1}")


def check_resume(resume, tokens_BxS, n_layers: int, width: int) -> None:
    """A `models.decoder.Resume`'s block, start and residual against the inputs' tokens
    and an LM of `n_layers` blocks of `width`; its `aux` holding `RESUME_SITES` of every
    resumed block where rows before `start` are read (ValueError naming the field)."""
    B, S = shape(tokens_BxS)
    static = isinstance(resume.layer, (int, np.integer))  # else traced: every block read
    if static and not 0 <= resume.layer < n_layers:
        raise ValueError(f"Resume.layer = {resume.layer}: expected a block in [0, {n_layers})")
    if not 0 <= resume.start < S:
        raise ValueError(f"Resume.start = {resume.start}: expected a position in [0, {S})")
    want = (B, S - resume.start, width)
    if shape(resume.x_BxTxD) != want:
        raise ValueError(f"Resume.x_BxTxD: shape {shape(resume.x_BxTxD)}, expected {want}")
    missing = [f"{n}.{i}" for i in range(resume.layer if static else 0, n_layers)
               for n in RESUME_SITES
               if f"{n}.{i}" not in resume.aux]  # fmt: skip
    if resume.start and missing:
        raise ValueError(f"Resume.aux: lacks {missing[:3]} (capture `RESUME_SITES`)")
