"""Where each mllama input sits: the vision tower's learned tables read at each patch's
(row, col), and the LM's one-dimensional rotary ids with Llama 3's frequency scaling.

The tower adds, per tile, (1 - tanh(g)) x a learned per-patch table [1 + P, E] plus
tanh(g) x the tile-specific table of the image's aspect-ratio id and the tile's index
[1 + P, E] (row 0 the CLS token's, 1 + r g + c patch (r, c) of the tile's g x g grid).
`tables_at` reads the patch rows of both at real (row, col) bilinearly
(`models.positions.read_table`): integer positions read rows exactly, a width mirror
g - 1 - col is an exact column permutation within every tile (the tile order is not
mirrored: the tile embeddings stay with their tiles), a half-cell shift an
interpolation. The CLS row never moves. The pre- / post-tile embeddings are one vector
per tile, with no position inside it.

The LM (Llama 3) turns rotary pair i by id x f_i, f_i = theta^(-2i / Dh) rescaled as
the reference's "llama3" rope (long wavelengths divided by `factor`, a smooth blend
between the low and high frequency bounds); ids count each row's real tokens from 0
(`models.positions.text_ids`).
"""

from __future__ import annotations

import math

import numpy as np

from jaxmech.models.decoder import inv_freq
from jaxmech.models.positions import read_table

__all__ = ["lm_inv_freq", "patch_grid", "tables_at"]


def lm_inv_freq(c) -> np.ndarray:
    """[Dh / 2] float32 the LM's rotary frequencies (module docstring)."""
    f = inv_freq(c.lm_head_dim, c.lm_rope_theta)
    if not c.lm_rope_llama3:
        return f
    factor, low, high, old = c.lm_rope_llama3
    f32 = np.float32
    wavelen = f32(2 * math.pi) / f
    low_wl, high_wl = f32(old / low), f32(old / high)
    scaled = np.where(wavelen > low_wl, f / f32(factor), f)
    smooth = (f32(old) / wavelen - f32(low)) / f32(high - low)
    blended = (1 - smooth) * scaled / f32(factor) + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, blended, scaled).astype(np.float32)


def patch_grid(g: int):
    """(rows_P, cols_P) float32: each patch's (row, col) on a tile's g x g grid."""
    rows, cols = np.divmod(np.arange(g * g), g)
    return rows.astype(np.float32), cols.astype(np.float32)


def tables_at(table_Nx1pPxE, rows_P, cols_P):
    """[N, P, E] the patch rows of N tables [N, 1 + g g, E] read at (rows, cols) [P]."""
    n, rows, E = table_Nx1pPxE.shape
    g = round((rows - 1) ** 0.5)
    grid = table_Nx1pPxE[:, 1:].reshape(n, g, g, E).transpose(1, 2, 0, 3).reshape(g, g, n * E)
    return read_table(grid, rows_P, cols_P).reshape(-1, n, E).transpose(1, 0, 2)
