"""Positions shared by the loaded families whose LM has 1-D rotary positions and whose
ViT reads a learned position table once, at its input: the LM's ids counted from each row's first real token, their rotary angles, an
edit's ids, and a table read at fractional (row, col) positions.

Shared because these are the same computation in each such family (the reference's
`generate` ids for left-padded rows; a table read bilinearly so that a mirror is an
exact permutation of its rows and a half-cell shift an interpolation). A family with
3-part (t, h, w) ids or a table resampled per image keeps those in its own package.

Axis names (`jaxmech.shapes`): B sequences, S LM tokens, R rotary pairs, P patches,
E width.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def text_ids(valid_BxS) -> np.ndarray:
    """[B, S] int32 rotary ids: each row's real tokens counted from 0, padding 0."""
    v = np.asarray(valid_BxS, bool)
    return np.where(v, np.cumsum(v, 1) - 1, 0).astype(np.int32)


def view_ids(first_B, B: int, S: int) -> np.ndarray:
    """[B, 3, S] int32 the ids of B rows of S tokens whose real tokens start at `first_B`
    (None: at 0), as a VLM view's `lm_position_ids` gives a 1-D rotary LM's: three equal
    rows (the contract's (t, row, col), which `Edits.lm_pos_ids` takes)."""
    first = np.zeros(B, np.int64) if first_B is None else np.asarray(first_B)
    ids = text_ids(np.arange(S)[None] >= first[:, None])
    return np.repeat(ids[:, None], 3, 1)


def edited_ids(pos_BxS, lm_pos_ids):
    """[B, S] the LM's ids under an edit: `pos_BxS` where `lm_pos_ids` is None, else the
    edit's ([S], or the first row of its [3, S] / [B, 3, S]: the rows are equal, as
    `models.checks.check_lm_pos_ids` requires) broadcast over the batch."""
    if lm_pos_ids is None:
        return pos_BxS
    e = jnp.asarray(lm_pos_ids)
    e = e if e.ndim == 1 else e[..., 0, :]
    return jnp.broadcast_to(e, pos_BxS.shape)


def rotary_angles(pos_BxS, inv_freq_R):
    """[B, S, R] float32 1-D rotary angles: each pair turned by the token's id."""
    return jnp.asarray(pos_BxS, jnp.float32)[..., None] * jnp.asarray(inv_freq_R)


def read_table(table_hxwxE, rows_P, cols_P):
    """[P, E] a position table [h, w, E] read at fractional (row, col) [P] bilinearly
    between the four nearest entries, clamped to its edge: integer positions read its
    entries exactly (x 1 + y 0), so a mirror w - 1 - col is an exact permutation."""
    h, w = table_hxwxE.shape[:2]
    r = jnp.clip(jnp.asarray(rows_P, jnp.float32), 0, h - 1)
    c = jnp.clip(jnp.asarray(cols_P, jnp.float32), 0, w - 1)
    r0, c0 = jnp.floor(r).astype(jnp.int32), jnp.floor(c).astype(jnp.int32)
    r1, c1 = jnp.minimum(r0 + 1, h - 1), jnp.minimum(c0 + 1, w - 1)
    fr = (r - r0)[:, None].astype(table_hxwxE.dtype)
    fc = (c - c0)[:, None].astype(table_hxwxE.dtype)
    top = table_hxwxE[r0, c0] * (1 - fc) + table_hxwxE[r0, c1] * fc
    bottom = table_hxwxE[r1, c0] * (1 - fc) + table_hxwxE[r1, c1] * fc
    return top * (1 - fr) + bottom * fr
