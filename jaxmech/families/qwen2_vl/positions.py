"""Where each Qwen-VL token sits: the ViT's patch rows / columns, frames and windows, and
the LM's three-part (t, h, w) M-RoPE position ids, computed here from the inputs alone.

Patch order. The processor flattens an image of `grid = (t, h, w)` patches in merge-block
order: frame, then merged row, merged column, then the merge_size x merge_size patches
of that block row-major. Every per-patch array here follows that order, so a block of
merge_size^2 consecutive patches is one merged (LM) token.

M-RoPE ids (`mrope_ids`), per sequence: text tokens count up from 0 with all three ids
equal; an image's merged tokens get (s + f, s + row, s + col) with s the next free id
and (f, row, col) in the merged grid (a video's f times its time interval, floored:
Qwen2.5-VL spaces its frames by tokens_per_second x seconds per temporal patch); the
text after it resumes at s + max(h, w) / merge_size, as the reference does for videos
too (the ids are not the token count). Rotary angles: frequency pair i of the LM
(R = head_dim / 2 pairs, f_i = theta^(-2i / head_dim)) turns by the id of the section
it falls in (`mrope_section`, e.g. [16, 24, 24]: t the highest frequencies, then h, then
w), or, interleaved (Qwen3-VL's, `mrope_axes`), h on pairs 1, 4, 7, ... and w on 2, 5,
8, ... below 3 x their sections, t on the rest. The ViT's pairs: the first head_dim / 4
turn by the patch row, the rest by the column, at f_i = theta^(-4i / head_dim).

Qwen3-VL's learned position table (`table_taps`): an n x n grid of vectors read at each
patch's (row, col) mapped onto it as `linspace(0, n - 1, h)[row]` (the corners onto the
corners: row * (n - 1) / (h - 1)), bilinearly from the four nearest cells, clamped at
the border. A fractional or mirrored (row, col) is read the same way, so a shift by half
a patch moves the vector read.

Axis names (`jaxmech.shapes`): P patches, I merged image tokens, S LM tokens, R pairs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.models.attention import rotary_angles
from jaxmech.models.decoder import inv_freq

__all__ = ["inv_freq", "lm_angles", "merged_grid", "mrope_axes", "mrope_ids", "patch_grid",
           "table_taps", "vit_angles", "window_ids"]  # fmt: skip


def patch_grid(grid, merge: int):
    """(rows_P, cols_P, frame_P) int32 of a `(t, h, w)` patch grid in merge-block order."""
    t, h, w = (int(g) for g in grid)
    if h % merge or w % merge:
        raise ValueError(
            f"grid = {tuple(grid)}: expected h and w multiples of merge_size = {merge}"
        )
    r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = r.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = c.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    frame = np.repeat(np.arange(t), h * w)
    return (
        np.tile(rows, t).astype(np.int32),
        np.tile(cols, t).astype(np.int32),
        frame.astype(np.int32),
    )


def window_ids(grid, merge: int, window: int):
    """[P] int32, the attention window of each patch: windows of `window` x `window`
    patches per frame (Qwen2.5-VL: 8, i.e. 4 x 4 merged tokens), counted row-major from
    the top-left; the last window row / column may be cut by the image's edge. window = 0:
    one window per frame."""
    rows, cols, frame = patch_grid(grid, merge)
    if window == 0:
        return frame
    t, h, w = (int(g) for g in grid)
    per_row = -(-w // window)
    per_frame = -(-h // window) * per_row
    return (frame * per_frame + (rows // window) * per_row + cols // window).astype(np.int32)


def merged_grid(grid, merge: int):
    """(frame_I, row_I, col_I) int32 of each merged token, in the LM's order."""
    t, h, w = (int(g) for g in grid)
    f, r, c = np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge), indexing="ij")
    return (
        f.reshape(-1).astype(np.int32),
        r.reshape(-1).astype(np.int32),
        c.reshape(-1).astype(np.int32),
    )


def _image_runs(ids, image_token_id: int, sizes):
    """(start, length) of each image's (or video's) tokens in one sequence, in order;
    `sizes` are their merged-token counts."""
    at = np.flatnonzero(ids == image_token_id)
    runs, k = [], 0
    for n in sizes:
        if k + n > len(at) or at[k + n - 1] - at[k] != n - 1:
            raise ValueError(
                f"input_ids: expected {n} consecutive image tokens for image "
                f"{len(runs)} (image_token_id = {image_token_id})"
            )
        runs.append((int(at[k]), n))
        k += n
    if k != len(at):
        raise ValueError(f"input_ids: {len(at)} image tokens, but the grids account for {k}")
    return runs


def mrope_ids(
    input_ids_BxS, grids, image_token_id: int, merge: int, images_per_row=None, valid_BxS=None,
    time_intervals=None,
):  # fmt: skip
    """[B, 3, S] int32, the LM's (t, h, w) position ids (module docstring); padding 0.

    Args:
      input_ids_BxS: token ids.
      grids: `(t, h, w)` patch grids of the images (or videos) in reading order, row
        after row.
      image_token_id: the `<|image_pad|>` id (`<|video_pad|>`'s for videos): each image
        or video is one run of its merged tokens.
      merge: the merger's spatial merge size.
      images_per_row: [B] how many of `grids` each row has (default: one each).
      valid_BxS: bool, the tokens that are not padding (default: all); ids count the
        valid tokens only, wherever the padding is.
      time_intervals: per grid, the time ids between its temporal patches (default 1;
        Qwen2.5-VL's videos: tokens_per_second x seconds per temporal patch), floored.
    """
    ids = np.asarray(input_ids_BxS)
    B, S = ids.shape
    valid = np.ones((B, S), bool) if valid_BxS is None else np.asarray(valid_BxS, bool)
    per_row = [1] * B if images_per_row is None else [int(n) for n in images_per_row]
    if sum(per_row) != len(grids):
        raise ValueError(f"grids: {len(grids)} grids for {sum(per_row)} images in the batch")
    out = np.zeros((B, 3, S), np.int32)
    g = 0
    for b in range(B):
        mine = [tuple(int(x) for x in grids[g + k]) for k in range(per_row[b])]
        g += per_row[b]
        row = ids[b][valid[b]]
        runs = _image_runs(row, image_token_id, [t * h * w // merge**2 for t, h, w in mine])
        steps = [1.0] * len(mine) if time_intervals is None else time_intervals[g - len(mine) : g]
        out[b][:, valid[b]] = _row_ids(len(row), runs, mine, merge, steps)
    return out


def _row_ids(S: int, runs, grids, merge: int, steps):
    ids = np.zeros((3, S), np.int32)
    pos, next_id = 0, 0
    for (start, n), grid, step in zip(runs, grids, steps):
        ids[:, pos:start] = next_id + np.arange(start - pos)
        next_id += start - pos
        f, r, c = merged_grid(grid, merge)
        t = np.floor(f * np.float64(step)).astype(np.int64)  # as the reference's .long()
        ids[:, start : start + n] = next_id + np.stack([t, r, c])
        next_id += max(grid[1], grid[2]) // merge
        pos = start + n
    ids[:, pos:] = next_id + np.arange(S - pos)
    return ids


def mrope_axes(section, interleaved: bool = False) -> np.ndarray:
    """[R] which id (0 t, 1 h, 2 w) turns each of the R = sum(section) frequency pairs:
    contiguous sections, or interleaved (h on pairs 1::3 and w on 2::3, each below 3 x
    its section; t on the rest), as the reference's `apply_interleaved_mrope`."""
    section = [int(n) for n in section]
    if not interleaved:
        return np.repeat(np.arange(3), section)
    axis = np.zeros(sum(section), np.int64)
    for a in (1, 2):
        axis[a : min(3 * section[a], len(axis)) : 3] = a
    return axis


def lm_angles(pos_Bx3xS, inv_freq_R, section, interleaved: bool = False):
    """[B, S, R] float32, the LM's rotary angles: pair i turned by its id (`mrope_axes`)."""
    axis = mrope_axes(section, interleaved)
    pos = jnp.asarray(pos_Bx3xS, jnp.float32)
    return jax.vmap(rotary_angles, (0, None, None))(pos, jnp.asarray(inv_freq_R), axis)


def vit_angles(rows_BxP, cols_BxP, inv_freq):
    """[B, P, R] float32, the ViT's rotary angles (rows on the first half of the pairs)."""
    ids = jnp.stack([rows_BxP, cols_BxP], 1).astype(jnp.float32)  # [B, 2, P]
    freqs = np.concatenate([inv_freq, inv_freq])
    axis = np.repeat(np.arange(2), len(inv_freq))
    return jax.vmap(rotary_angles, (0, None, None))(ids, jnp.asarray(freqs), axis)


def _axis_taps(x, size, side: int):
    """Per patch the two table cells along one axis and their weights ([..., 2] each):
    position x of `size` mapped to x (side - 1) / (size - 1), clamped at the border."""
    src = x.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    low = jnp.floor(src)
    offset = jnp.arange(2, dtype=jnp.float32)
    taps = jnp.clip(low[..., None] + offset, 0, side - 1).astype(jnp.int32)
    return taps, jnp.maximum(1.0 - jnp.abs(src[..., None] - low[..., None] - offset), 0.0)


def table_taps(rows_BxP, cols_BxP, extent_Bx2, side: int):
    """(index [B, P, 4] int32, weight [B, P, 4] float32): the cells of a row-major
    side x side table each patch reads at (rows, cols) (floats: edited positions) and
    their bilinear weights, for images of extent (h, w) patches (module docstring)."""
    extent = jnp.asarray(extent_Bx2)
    hi, hw = _axis_taps(jnp.asarray(rows_BxP), extent[:, :1], side)
    wi, ww = _axis_taps(jnp.asarray(cols_BxP), extent[:, 1:], side)
    index = hi[..., :, None] * side + wi[..., None, :]
    weight = hw[..., :, None] * ww[..., None, :]
    return index.reshape(index.shape[:-2] + (4,)), weight.reshape(weight.shape[:-2] + (4,))
