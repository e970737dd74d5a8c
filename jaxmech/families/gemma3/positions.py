"""Where each Gemma-3 token sits: SigLIP's learned position table read at each patch's
(row, col), the pooled image tokens' patches, and the LM's 1-D rotary ids.

SigLIP adds its position table once, at the input: row r g + c to patch (r, c) of its
g x g grid (row-major, the patches' order; no CLS). `table_at` reads it at any real
(row, col) bilinearly (`models.positions.read_table`: an integer position is its own
row exactly, a mirror g - 1 - col an exact column permutation, a half-cell shift an
interpolation): paper 004's ViT position counterfactuals on a learned table, as for
LLaVA. The projector averages each k x k square of patches into one LM image token
(k = g / sqrt(mm_tokens_per_image)), so image token (i, j) of the t x t token grid
pools patches (k i + m, k j + n); `position_basis` is those k x k table rows side by
side (row-major in the square).

The LM turns rotary pair i of every head by id x theta^(-2i / head_dim) / factor, the
sliding layers with their base (`rope_local_base_freq`) and the global ones with theirs
(linear scaling: `factor`); the ids count each row's real tokens from 0
(`models.positions.text_ids`, as the reference's `generate` makes them).

Axis names (`jaxmech.shapes`): P patches, I image tokens, E ViT width.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.models.positions import read_table

__all__ = ["patch_grid", "pooled_patches", "position_basis", "table_at"]


def patch_grid(g: int):
    """(rows_P, cols_P) float32: each patch's (row, col) on the g x g grid, row-major."""
    rows, cols = np.divmod(np.arange(g * g), g)
    return rows.astype(np.float32), cols.astype(np.float32)


def table_at(pos_table, rows_P, cols_P):
    """[P, E] the table [g g, E] read at (rows, cols) [P] bilinearly (module docstring)."""
    g = round(pos_table.shape[0] ** 0.5)
    return read_table(pos_table.reshape(g, g, -1), rows_P, cols_P)


def pooled_patches(c: Gemma3Config) -> np.ndarray:
    """[I, k k] int the patches each image token averages, row-major in its square."""
    t, k, g = c.token_grid, c.pool, c.grid
    i, j = np.divmod(np.arange(t * t), t)
    m, n = np.divmod(np.arange(k * k), k)
    return (k * i[:, None] + m[None]) * g + (k * j[:, None] + n[None])


def position_basis(params, c: Gemma3Config):
    """[I, k k E] each image token's ViT position features: its k x k patches' table
    rows side by side."""
    pos = params["vit"]["pos"]
    return jnp.asarray(pos)[pooled_patches(c)].reshape(c.mm_tokens, -1)
