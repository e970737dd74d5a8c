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
ids count each row's real tokens from 0 (`models.positions.text_ids`, as the
reference's `generate` makes them), so a left-padded row reads as itself alone.

Axis names (`jaxmech.shapes`): P patches, S LM tokens, R rotary pairs.
"""

from __future__ import annotations

import numpy as np

from jaxmech.models.positions import read_table

__all__ = ["patch_grid", "table_at"]


def patch_grid(g: int):
    """(rows_P, cols_P) float32: each patch's (row, col) on the g x g grid, row-major."""
    rows, cols = np.divmod(np.arange(g * g), g)
    return rows.astype(np.float32), cols.astype(np.float32)


def table_at(pos_table, rows_P, cols_P):
    """[P, E] the patch rows of `pos_table` [1 + g g, E] read at (rows, cols) [P]
    bilinearly (module docstring; `models.positions.read_table` on its g x g grid)."""
    g = round((pos_table.shape[0] - 1) ** 0.5)
    return read_table(pos_table[1:].reshape(g, g, -1), rows_P, cols_P)
