"""The InternVL (-hf) forward as one pure function of (params, inputs).

    tiles' patches --W_patch--> + CLS, + the learned position table (once)
        --> InternViT blocks (LayerNorm, layer scale) --> patch tokens (CLS dropped)
        --pixel shuffle--> 2 x 2 patches per token --projector--> image features
    tokens --E--> embeddings, each image's features placed at its <IMG_CONTEXT> tokens
        (its tiles in order, then the thumbnail) --> Qwen2 blocks (1-D rotary, causal,
        grouped-query) --lnf--> logits

Params: `params.py` (TransformerLens layout). Inputs: `Inputs` below, as the processor
(`processor.py`) makes them. Positions, the table and the pixel shuffle: `positions.py`.
Numerics as the reference: norms, the rotary rotation and the softmax in float32,
everything else in the params' dtype.

Named sites (each a point where `Edits.replace` / `Edits.add` act and `capture` reads;
the ViT's batch is every tile of every row, N = B T):

  vit/embed                     [N, 1 + P, E]  CLS and the patch embeddings (content)
  vit/pos                       [1 + P, E]     the position codes added to them (the
                                               CLS row, then each patch's)
  vit/{point}.{i}               resid_pre, q, k, v ([N, 1 + P, H, Dh]), attn_scores,
                                pattern ([N, H, 1 + P, 1 + P]), z, attn_out, resid_mid,
                                mlp_out, resid_post (no rotary: no rot_q / rot_k)
  proj/in                       [N, I, 4E]     the pixel-shuffled patch tokens
  proj/out                      [B, T I, D]    the image features the LM reads
  lm/embed                      [B, S, D]      the LM's input (image features placed)
  lm/{point}.{i}                as the ViT's, with rot_q / rot_k (k, v: Hkv heads)
  lm/final                      [B, S, D]      after the last norm

Position edits: `Edits.vit_rows / vit_cols` ([P] floats, the same in every tile) set the
(row, col) each patch reads on the position table (`models.positions.read_table`; the
CLS row stays); the ViT has no per-block positions (`vit_blocks` = 0). `Edits.lm_pos_ids` ([S],
[3, S] or [B, 3, S] with equal rows: one rotary id per token) replaces the LM's ids.
`Edits.image_order` ([T I]) makes image slot i read token image_order[i] whole: its 2 x
2 patch blocks stay as they are packed (a picture's mirror also swaps them inside each
token, `positions.mirror_channels`, and reorders a tiled picture's tiles,
`positions.mirror_order`: the `positions` docstring).

Partial runs: `last_row=True` runs the last LM block for the last row only (logits [B,
V]); `resume=Resume(...)` runs the LM from one block on the last rows only, the rows
before read from another run's keys and values (`models.decoder.Resume`).

Axis names (`jaxmech.shapes`): B sequences, T tiles per image, P patches per tile, I LM
tokens per tile, S LM tokens, E / D ViT / LM width, H heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.internvl import positions
from jaxmech.families.internvl.checks import check_edits, check_inputs
from jaxmech.families.internvl.config import InternVLConfig
from jaxmech.models.decoder import ACT, Resume, Sites, after, block_forward, inv_freq, layer_norm
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.models.generate import Decoding
from jaxmech.models.positions import read_table
from jaxmech.models.precision import matmul
from jaxmech.models.scan import run_blocks

__all__ = ["Inputs", "Resume", "decoding", "forward", "image_features", "position_codes", "vision"]

PROJ_EPS = 1e-5  # the projector's LayerNorm: torch's default eps


class Inputs(NamedTuple):
    """One batch for `forward` (every leaf leads with B; one image per sequence, each
    of T tiles; T = 0: no image).

    tokens_BxS: int32 token ids. pixels_BxTxPxF: each tile's patches, row-major, each
    flattened as (C, p, p) (`processor`). pos_BxS: int32 rotary ids
    (`models.positions.text_ids`). image_BxI: int32 the LM positions of the image's T x
    I tokens, in reading order. valid_BxS: bool, False at (left) padding.
    """

    tokens_BxS: Any
    pixels_BxTxPxF: Any
    pos_BxS: Any
    image_BxI: Any
    valid_BxS: Any


def position_codes(vit, side: int, edits: Edits = NO_EDITS):
    """[1 + P, E] the position codes a tile of side x side patches adds: the CLS row,
    then each patch's row of the table as the tile reads it (`positions`), at the
    edited (row, col) where `edits` set them."""
    table = positions.resample_table(vit["pos"], side)
    if edits.vit_rows is None and edits.vit_cols is None:
        patches = table.reshape(side * side, -1)
    else:
        rows, cols = positions.patch_grid(side)
        rows = rows if edits.vit_rows is None else edits.vit_rows
        cols = cols if edits.vit_cols is None else edits.vit_cols
        patches = read_table(table, rows, cols)
    return jnp.concatenate([vit["pos_cls"][None], patches.astype(vit["pos_cls"].dtype)], 0)


def vision(params, inputs: Inputs, c: InternVLConfig, edits: Edits, site) -> jax.Array:
    """[B, T I, D] the image features of every row's tiles, in order."""
    vit = params["vit"]
    B, T, P, F = inputs.pixels_BxTxPxF.shape
    side = positions.tile_side(P)
    px = inputs.pixels_BxTxPxF.reshape(B * T, P, F).astype(vit["W_patch"].dtype)
    patches = matmul(px, vit["W_patch"]) + vit["b_patch"]
    cls = jnp.broadcast_to(vit["cls"], (B * T, 1, c.vit_width)).astype(patches.dtype)
    x = site("vit/embed", jnp.concatenate([cls, patches], 1))
    x = x + site("vit/pos", position_codes(vit, side, edits))
    full = jnp.ones((1, P + 1, P + 1), bool)  # every token sees every token of its tile

    def block(w, x, s, i, _):
        return block_forward(w, x, None, full, s, "vit", i, c.vit_eps, ACT[c.vit_act])

    x, _ = run_blocks(vit, c.vit_depth, x, range(c.vit_depth), block, site)  # one scan
    h = site("proj/in", positions.pixel_shuffle(x[:, 1:], side))
    out = projector(params["proj"], h, c)
    return site("proj/out", out.reshape(B, T * out.shape[1], out.shape[2]))


def projector(m, x, c: InternVLConfig):
    """LayerNorm, Linear, activation, Linear: [N, I, 4E] -> [N, I, D]."""
    x, m = after(x, m)
    h = layer_norm(x, m["ln_w"], m["ln_b"], PROJ_EPS)
    h = ACT[c.proj_act](matmul(h, m["W1"]) + m["b1"])
    return matmul(h, m["W2"]) + m["b2"]


def forward(params, inputs: Inputs, edits: Edits | None = None, *, config: InternVLConfig,
            capture=False, rows=None, resume: Resume | None = None, last_row: bool = False):  # fmt: skip
    """(logits, aux): logits [B, S, V], or [B, V] at `rows` ([B] positions) or at the
    last token (`last_row`: the last block then runs that row only); aux the captured
    sites (module docstring). `resume`: run the LM from a block on the last rows only
    (`Resume`; `rows` still count from 0). Jittable with `config` static; vmappable
    over stacked edits."""
    return hf_vlm.placed_forward(params, inputs, edits, config, capture, rows, resume, last_row,
                                 checks=(check_inputs, check_edits), vision=vision, act="silu")  # fmt: skip


def image_features(params, inputs: Inputs, *, config: InternVLConfig) -> jax.Array:
    """[B, T I, D] the projector's output, unedited."""
    return vision(params, inputs, config, NO_EDITS, Sites(NO_EDITS, False))


def decoding(config: InternVLConfig) -> Decoding:
    """What `models.generate` needs of the LM (`hf_vlm.text_decoding`)."""
    freq = inv_freq(config.lm_head_dim, config.lm_rope_theta)
    return hf_vlm.text_decoding(forward, config, freq, "silu")
