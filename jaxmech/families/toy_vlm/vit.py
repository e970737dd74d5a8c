"""The ViT of the autoregressive VLM (`families.toy_vlm.model`): cells, 2D positions, windows.

An image is `L = grid_h * grid_w` cells in row-major order (cell (r, c) is index
r * W + c). A cell's content is the sum of three embedding rows,
`label_E[label] + colour_E[colour] + facing_E[facing]` (row 0 of each: background).
No CLS token: the ViT returns one vector per cell.

Positions (which one is read off the params, `position_kind`):
  learned2d  `vit/row_P [grid_h, D]` and `vit/col_P [grid_w, D]`, added; a fractional
             position interpolates linearly between neighbouring rows (clamped).
  sincos2d   fixed sin-cos codes, rows in channels [0, D/2), columns in [D/2, D):
             `scale * [sin(p f), cos(p f)]` with f = `static/sincos_freqs [D/4]`,
             scale = `static/sincos_scale` (init_P * sqrt 2, so a channel's RMS equals
             a learned table's); added, never trained.
  rope2d     no additive position: q and k of every block are rotated, frequency pair
             i by `(row if static/vit_rope_axis[i] == 0 else col) * vit_rope_freqs[i]`
             (half the pairs per axis), so logits depend on (row, col) offsets only.

Window blocks (Qwen2.5-VL style; `static/vit_window` w > 0 and `static/vit_global`
[n_layers] flags present): a non-global block's query sees only keys in its own
w x w window of the physical grid (`floor(row / w), floor(col / w)`; position
overrides do not move windows). Global blocks see every cell.

Video (`static/cell_frames` [L] present, `vit_frames`): grid row f is frame f, every
block attends within its frame only, and the cells' rows are 0 (a frame is one row
of grid_w cells; a learned row table has one row): the ViT knows where in a frame,
never when.

Axis names (`jaxmech.shapes`): B images, L cells, D d_model, H heads, R frequency pairs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmech.models.attention import FirstBlock, Rotary, block_forward, n_blocks, rotary_angles

POSITION_KINDS = ("learned2d", "sincos2d", "rope2d")


def read(params, key: str):
    """`params["static"][key]` with a stopped gradient (constants are never trained)."""
    return jax.lax.stop_gradient(params["static"][key])


def position_kind(params) -> str:
    """Which 2D position code the ViT uses, read off the params (`POSITION_KINDS`)."""
    if "row_P" in params["vit"]:
        return "learned2d"
    if "sincos_freqs" in params["static"]:
        return "sincos2d"
    return "rope2d"


def cell_grid(grid_h: int, grid_w: int):
    """(rows [L], cols [L]) f32: each cell's row and column, row-major."""
    idx = jnp.arange(grid_h * grid_w)
    return (idx // grid_w).astype(jnp.float32), (idx % grid_w).astype(jnp.float32)


def sincos_freqs(d_model: int):
    """The D/4 frequencies of one axis' sin-cos code: 10000^(-i / (D/4))."""
    n = d_model // 4
    return 10000.0 ** (-jnp.arange(n, dtype=jnp.float32) / n)


def rope2d_tables(d_head: int, base: float):
    """(freqs [R], axis [R]) of 2D RoPE: the first R/2 pairs rotate by row (axis 0), the
    rest by column (axis 1); each half spans base^(-2j / (R/2)), j < R/2 (Qwen2-VL ViT)."""
    half = d_head // 4
    f = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / (2 * half))
    axis = jnp.concatenate([jnp.zeros(half), jnp.ones(half)]).astype(jnp.float32)
    return jnp.concatenate([f, f]), axis


def _interp_rows(P, pos):
    """Rows of P at float positions [L]: linear interpolation between neighbouring rows;
    a position beyond the table reads its edge row (the position is clamped first, so
    -0.5 reads P[0], not the +0.5 row; `checks.check_edits` refuses positions more than
    half a cell outside).

    At an integer position the row is `1 * P[i] + 0 * P[i + 1]`, exactly P[i]."""
    n = P.shape[0]
    p = jnp.clip(pos, 0.0, n - 1.0)
    lo = jnp.floor(p).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, n - 1)
    frac = (p - lo)[:, None]
    return (1.0 - frac) * P[lo] + frac * P[hi]


def _sincos(pos, params, first_half: bool, d_model: int):
    """The sin-cos code [L, D] of positions `pos` in one half of the channels."""
    ang = pos[:, None] * read(params, "sincos_freqs")
    code = read(params, "sincos_scale") * jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], -1)
    pad = jnp.zeros((pos.shape[0], d_model - code.shape[1]), code.dtype)
    return jnp.concatenate([code, pad] if first_half else [pad, code], axis=-1)


def position_parts(params, rows_L, cols_L):
    """(row_part, col_part) [L, D]: the additive row and column codes (zeros for rope2d)."""
    vit = params["vit"]
    D = vit["label_E"].shape[1]
    kind = position_kind(params)
    if kind == "learned2d":
        return _interp_rows(vit["row_P"], rows_L), _interp_rows(vit["col_P"], cols_L)
    if kind == "sincos2d":
        return _sincos(rows_L, params, True, D), _sincos(cols_L, params, False, D)
    # rope2d: no additive code (the positions may be per block: [n_layers, L])
    zeros = jnp.zeros((rows_L.shape[-1], D), vit["label_E"].dtype)
    return zeros, zeros


def window_visible(params, layer: int):
    """bool [L, L] keys each query of block `layer` sees (None: every cell).

    Window blocks see their own window (module docstring); in a video (`cell_frames`)
    every block sees only its own frame, on top of that."""
    static = params["static"]
    if "vit_window" not in static and "cell_frames" not in static:
        return None
    visible = True
    if "vit_window" in static:
        w = jnp.maximum(read(params, "vit_window"), 1.0)
        rows, cols = read(params, "cell_rows"), read(params, "cell_cols")
        wr, wc = jnp.floor(rows / w), jnp.floor(cols / w)
        same = (wr[:, None] == wr[None, :]) & (wc[:, None] == wc[None, :])
        open_all = (read(params, "vit_global")[layer] > 0) | (read(params, "vit_window") == 0)
        visible = same | open_all
    if "cell_frames" in static:
        frames = read(params, "cell_frames")
        visible = visible & (frames[:, None] == frames[None, :])
    return visible


def vit_positions(params, edits):
    """The row and column positions [L] the ViT sees (overrides or the cells' own)."""
    rows = read(params, "cell_rows") if edits.vit_rows is None else edits.vit_rows
    cols = read(params, "cell_cols") if edits.vit_cols is None else edits.vit_cols
    return jnp.asarray(rows, jnp.float32), jnp.asarray(cols, jnp.float32)


def vit_inputs(params, labels_BxL, colours_BxL, facings_BxL, edits, aux):
    """(content, row_part, col_part), each [B, L, D], edited and logged in `aux`."""
    vit = params["vit"]
    content = vit["label_E"][labels_BxL] + vit["colour_E"][colours_BxL]
    content = edits("vit/content", content + vit["facing_E"][facings_BxL])
    row_L, col_L = position_parts(params, *vit_positions(params, edits))
    row = edits("vit/row_part", jnp.broadcast_to(row_L, content.shape))
    col = edits("vit/col_part", jnp.broadcast_to(col_L, content.shape))
    aux.update({"vit/content": content, "vit/row_part": row, "vit/col_part": col})
    return content, row, col


def vit_rotary(params, edits, layer: int = 0):
    """Block `layer`'s `Rotary` (rope2d), or None. Positions given per block ([n_layers,
    L] overrides) are read at `layer`."""
    if position_kind(params) != "rope2d":
        return None
    rows, cols = vit_positions(params, edits)
    pick = lambda x: x[layer] if x.ndim == 2 else x  # noqa: E731
    ids = jnp.stack([pick(rows), pick(cols)])
    return Rotary(rotary_angles(ids, read(params, "vit_rope_freqs"), read(params, "vit_rope_axis")))


def n_vit_blocks(params) -> int:
    return n_blocks(params["vit"])


def vit_forward(params, labels_BxL, colours_BxL, facings_BxL, edits):
    """The ViT: cell tokens [B, L, D] out (the last block's resid_post), and its aux."""
    aux = {}
    parts = vit_inputs(params, labels_BxL, colours_BxL, facings_BxL, edits, aux)
    first = None
    if "vit" in edits.term_keep:
        content, row, col = parts
        first = FirstBlock(
            None, None, None, content, row, term_keep=edits.term_keep["vit"],
            extra_parts=parts, term_names=("C", "R", "K"),
        )  # fmt: skip
    x = edits("vit/resid_pre.0", parts[0] + parts[1] + parts[2])
    n = n_vit_blocks(params)
    for layer in range(n):
        aux[f"vit/resid_pre.{layer}"] = x
        x, block_aux = block_forward(
            params["vit"][f"block_{layer}"],
            x,
            causal=False,
            edits=edits,
            prefix="vit/",
            suffix=f".{layer}",
            first=first if layer == 0 else None,
            rotary=vit_rotary(params, edits, layer),
            visible=window_visible(params, layer),
        )
        aux.update(block_aux)
        if layer < n - 1:
            x = edits(f"vit/resid_pre.{layer + 1}", x)
    return x, aux


def sincos_scale(init_P: float) -> float:
    """The sin-cos code's amplitude: a channel's RMS then equals init_P (a learned table's)."""
    return init_P * math.sqrt(2.0)
