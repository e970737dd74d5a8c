"""Where each InternVL token sits: the ViT's learned position table as a tile reads it,
the pixel shuffle that packs 2 x 2 patches into one LM token, and the LM's 1-D rotary
ids.

The position table. InternViT adds `pos` [n, n, E] (n = image_size / patch: 32 at 448
px) to the patch embeddings once, at the input, and `pos_cls` to the CLS token. A tile
of s x s patches with s != n reads the table resampled to s x s as the reference does
(torch's bicubic, a = -0.75, align_corners False, not antialiased: `resample_table`);
s == n reads it as it is. `Edits.vit_rows / vit_cols` ([P] floats, P = s s, patches
row-major) set the (row, col) each patch reads on that s x s table, bilinearly
(`models.positions.read_table`): integer positions are its rows exactly (the width
mirror s - 1 - col is a permutation of its columns, so mirroring twice is the identity,
exactly), fractional ones interpolate between neighbours (a half-cell shift is a new
code, not a permutation), clamped to the table's edge. The CLS row is never moved.

The pixel shuffle (`pixel_shuffle`). The last block's patch tokens (CLS dropped), s x s
row-major, become (s / 2) x (s / 2) LM tokens, row-major: token (i, j) holds the four
patches (2i + m, 2j + k), m, k in {0, 1}, side by side in channel block 2m + k
(top-left, top-right, bottom-left, bottom-right). The reference's `pixel_shuffle`
transposes height and width twice, which cancels: the order is this one (tested on
the reference's output). A picture mirrored along its width therefore changes the LM's
image tokens in two ways: token (i, j) takes the place of (i, s/2 - 1 - j), and inside
each token the blocks swap left for right (0 <-> 1, 2 <-> 3: `MIRROR_BLOCKS`). Moving
whole LM tokens (`Edits.image_order`) does the first only. A tiled image (the
processor's default for photographs) mirrors its tile order too: the tiles' columns
reverse in each row, each tile mirrors in place, the thumbnail in place
(`mirror_order`; the resize commutes with the flip, so the tiles are the mirrored
tiles exactly).

LM ids (`models.positions.text_ids`): one id per token, counting each row's real
tokens from 0 (as `generate` does for left-padded rows; padding 0). The view gives them
as [B, 3, S] (three equal rows), as the contract's M-RoPE families do; the forward
reads one.

Axis names (`jaxmech.shapes`): P patches of a tile, I LM image tokens of a tile, E ViT
width, S LM tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# the channel-block permutation of a mirrored LM token (blocks 2m + k, `pixel_shuffle`)
MIRROR_BLOCKS = {"w": (1, 0, 3, 2), "h": (2, 3, 0, 1)}


def tile_side(n_patches: int) -> int:
    """s of a tile of P = s x s patches; ValueError unless P is an even square."""
    s = int(round(n_patches**0.5))
    if s * s != n_patches or s % 2:
        raise ValueError(f"pixels: {n_patches} patches per tile, expected s x s with s even")
    return s


def patch_grid(side: int):
    """(rows_P, cols_P) int32: each patch's (row, col) in a tile, row-major."""
    r, c = np.divmod(np.arange(side * side), side)
    return r.astype(np.int32), c.astype(np.int32)


def token_grid(side: int):
    """(rows_I, cols_I) int32: each LM image token's (row, col) in a tile's
    (s / 2) x (s / 2) token grid, in the LM's order (row-major)."""
    return patch_grid(side // 2)


def _cubic(t: np.ndarray, a: float = -0.75) -> np.ndarray:
    """torch's cubic convolution kernel (upsample_bicubic2d's a = -0.75), float64."""
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
    """float32 [n_out, n_in]: torch's bicubic resampling along one axis (align_corners
    False, no antialiasing: the source index (i + 0.5) n_in / n_out - 0.5, four taps
    clamped to the edge)."""
    out = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        real = (i + 0.5) * (n_in / n_out) - 0.5
        lo = int(np.floor(real))
        t = real - lo
        for tap, w in zip(range(lo - 1, lo + 3), _cubic(np.array([t + 1, t, 1 - t, 2 - t]))):
            out[i, min(max(tap, 0), n_in - 1)] += w
    return out.astype(np.float32)


def resample_table(pos_nxnxE, side: int):
    """[side, side, E] the table as a tile of side x side patches reads it (module
    docstring): itself at side == n, else bicubic-resampled."""
    n = pos_nxnxE.shape[0]
    if side == n:
        return pos_nxnxE
    m = jnp.asarray(bicubic_matrix(n, side), pos_nxnxE.dtype)
    return jnp.einsum("ra,abe,cb->rce", m, pos_nxnxE, m)


def pixel_shuffle(x_NxPxE, side: int):
    """[N, P / 4, 4E]: each 2 x 2 block of a tile's s x s patches as one token, blocks
    in channel order 2m + k (module docstring)."""
    N, _, E = x_NxPxE.shape
    h = side // 2
    x = x_NxPxE.reshape(N, h, 2, h, 2, E).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(N, h * h, 4 * E)


def mirror_channels(width: int, axis: str = "w") -> np.ndarray:
    """[4 width] the channel permutation that mirrors the 2 x 2 patch blocks inside an
    LM image token along `axis` ("w" or "h"): x[..., perm] of a token's features."""
    blocks = MIRROR_BLOCKS[axis]
    return np.concatenate([np.arange(width) + b * width for b in blocks])


def mirror_order(cols: int, rows: int, side: int, axis: str = "w") -> np.ndarray:
    """[T I] int32: for an image cut into cols x rows tiles (and the thumbnail when more
    than one), the image token each LM slot holds when the picture is mirrored along
    `axis`: the tiles' columns (rows) reversed, each tile's tokens mirrored in it, the
    thumbnail's in place. Slot order: the tiles row-major, then the thumbnail. (The
    mirrored picture's tokens also swap their 2 x 2 blocks: `mirror_channels`.)"""
    h = side // 2
    r, c = token_grid(side)
    inner = r * h + (h - 1 - c) if axis == "w" else (h - 1 - r) * h + c
    tiles = np.arange(rows * cols).reshape(rows, cols)
    tiles = tiles[:, ::-1] if axis == "w" else tiles[::-1]
    order = [t * h * h + inner for t in tiles.reshape(-1)]
    if rows * cols > 1:
        order.append(rows * cols * h * h + inner)
    return np.concatenate(order).astype(np.int32)
