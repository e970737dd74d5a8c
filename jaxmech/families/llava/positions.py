"""Where each LLaVA token sits: the ViT's learned position table read at each patch's
(row, col), and the LM's one-dimensional rotary position ids.

The ViT (CLIP) adds its position table once, at the input: row 0 to the CLS token,
row 1 + r g + c to patch (r, c) of its g x g grid (row-major, the patches' order).
`table_at` reads the patch rows at any real (row, col) bilinearly between the four
nearest entries (clamped to the grid), so an integer position is its own row exactly
(x 1 + y 0), a mirror w - 1 - col is an exact column permutation and a half-cell shift
an interpolation of the table: paper 004's ViT position counterfactuals on a learned
table. The CLS row is never moved.

The LM (Llama) turns rotary pair i of every head by id x theta^(-2i / head_dim); the
ids count each row's real tokens from 0 (`lm_ids`, as the reference's `generate`
makes them), so a left-padded row reads as itself alone.

Axis names (`jaxmech.shapes`): P patches, S LM tokens, R rotary pairs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmech.models.decoder import inv_freq

__all__ = ["inv_freq", "lm_angles", "lm_ids", "patch_grid", "table_at"]


def patch_grid(g: int):
    """(rows_P, cols_P) float32: each patch's (row, col) on the g x g grid, row-major."""
    rows, cols = np.divmod(np.arange(g * g), g)
    return rows.astype(np.float32), cols.astype(np.float32)


def table_at(pos_table, rows_P, cols_P):
    """[P, E] the patch rows of `pos_table` [1 + g g, E] read at (rows, cols) [P]
    bilinearly (module docstring)."""
    g = round((pos_table.shape[0] - 1) ** 0.5)
    grid = pos_table[1:].reshape(g, g, -1)
    r = jnp.clip(jnp.asarray(rows_P, jnp.float32), 0, g - 1)
    c = jnp.clip(jnp.asarray(cols_P, jnp.float32), 0, g - 1)
    r0, c0 = jnp.floor(r).astype(jnp.int32), jnp.floor(c).astype(jnp.int32)
    r1, c1 = jnp.minimum(r0 + 1, g - 1), jnp.minimum(c0 + 1, g - 1)
    fr = (r - r0)[:, None].astype(grid.dtype)
    fc = (c - c0)[:, None].astype(grid.dtype)
    top = grid[r0, c0] * (1 - fc) + grid[r0, c1] * fc
    return top * (1 - fr) + (grid[r1, c0] * (1 - fc) + grid[r1, c1] * fc) * fr


def lm_ids(valid_BxS) -> np.ndarray:
    """[B, S] int32 the LM's position ids: each row's real tokens counted from 0
    (padding 0)."""
    valid = np.asarray(valid_BxS, bool)
    return np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)


def lm_angles(pos_BxS, inv_freq_R):
    """[B, S, R] float32 the LM's rotary angles."""
    return jnp.asarray(pos_BxS, jnp.float32)[..., None] * jnp.asarray(inv_freq_R)
