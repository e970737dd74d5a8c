"""The Qwen2-VL / Qwen2.5-VL forward as one pure function of (params, inputs).

    patches --W_patch--> ViT blocks (2D rotary, windows) --merger--> image features
    tokens --E--> embeddings, image features placed at the <|image_pad|> tokens
                  --> LM blocks (M-RoPE, causal, grouped-query) --lnf--> logits

Params: `params.py` (TransformerLens layout). Inputs: `Inputs` below, as the processor
(`processor.py`) makes them. Positions: `positions.py`. Numerics as the reference: norms,
the rotary rotation and the softmax in float32, everything else in the params' dtype.

Named sites (each a point where `Edits.replace` / `Edits.add` act and `capture` reads):

  vit/embed                     [B, P, E]   the patch embedding
  vit/{point}.{i}               resid_pre, q, k, v ([B, P, H, Dh]), rot_q, rot_k,
                                attn_scores, pattern ([B, H, P, P]), z, attn_out,
                                resid_mid, mlp_out, resid_post
  merger/out                    [B, I, D]   the image features the LM reads
  lm/embed                      [B, S, D]   the LM's input (image features placed)
  lm/{point}.{i}                as the ViT's (k and v have Hkv heads)
  lm/final                      [B, S, D]   after the last norm

Position edits: `Edits.vit_rows / vit_cols` ([P] every block, or [n_vit_blocks, P] one
row per block; fractional values rotate by fractional angles) replace the rows / columns
the ViT's rotary positions read (windows stay those of the physical patches);
`Edits.lm_pos_ids` ([S], [3, S] or [B, 3, S]) replaces the LM's (t, h, w) ids;
`Edits.image_order` ([I]) makes image slot i read merged token image_order[i].

Partial runs: `forward(..., last_row=True)` runs the last LM block for the last row only
(logits [B, V]); `forward(..., resume=Resume(...))` runs the LM from one block on the
last rows only, the rows before read from another run's keys and values (a key / value
cache; the paper 003 methods' patches and steering resume there).

Axis names (`jaxmech.shapes`): B sequences, P patches, I merged image tokens, S LM
tokens, E / D ViT / LM width, H heads, Dh head width, R rotary pairs, V vocabulary.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmech.families.qwen2_vl import positions
from jaxmech.families.qwen2_vl.checks import check_edits, check_inputs, check_resume
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.models.decoder import (
    ACT,
    Resume,
    Sites,
    after,
    block_forward,
    norm,
    place_images,
    run_lm,
    unembed,
)
from jaxmech.models.edits import NO_EDITS, Edits

__all__ = ["Inputs", "Resume", "forward", "image_features", "language_model", "vision"]


class Inputs(NamedTuple):
    """One batch for `forward` (every leaf leads with B; one image per sequence).

    tokens_BxS: int32 token ids. pixels_BxPxF: the flattened patches (`processor`).
    pos_Bx3xS: int32 M-RoPE ids (`positions.mrope_ids`). image_BxI: int32 the LM
    positions of each image's merged tokens, in reading order. rows_BxP, cols_BxP,
    frame_BxP, window_BxP: int32 each patch's row, column, frame and attention window
    (`positions.patch_grid`, `window_ids`). valid_BxS: bool, False at (left) padding,
    which no token attends to.
    """

    tokens_BxS: Any
    pixels_BxPxF: Any
    pos_Bx3xS: Any
    image_BxI: Any
    rows_BxP: Any
    cols_BxP: Any
    frame_BxP: Any
    window_BxP: Any
    valid_BxS: Any


def _vit_positions(inputs: Inputs, edits: Edits, depth: int):
    """Per block the (rows, cols) [B, P] the rotary positions read (edits override)."""
    out = []
    for i in range(depth):
        rc = []
        for own, edit in ((inputs.rows_BxP, edits.vit_rows), (inputs.cols_BxP, edits.vit_cols)):
            if edit is None:
                rc.append(own)
            else:
                e = jnp.asarray(edit, jnp.float32)
                rc.append(jnp.broadcast_to(e[i] if e.ndim == 2 else e, own.shape))
        out.append(rc)
    return out


def vision(params, inputs: Inputs, c: QwenVLConfig, edits: Edits, site) -> jax.Array:
    """[B, I, D] the merged image features."""
    vit = params["vit"]
    x = site(
        "vit/embed",
        jnp.einsum("bpf,fe->bpe", inputs.pixels_BxPxF.astype(vit["W_patch"].dtype), vit["W_patch"]),
    )
    freq = positions.inv_freq(c.vit_head_dim // 2, c.vit_rope_theta)
    full = inputs.frame_BxP[:, :, None] == inputs.frame_BxP[:, None, :]
    windowed = inputs.window_BxP[:, :, None] == inputs.window_BxP[:, None, :]
    for i, (rows, cols) in enumerate(_vit_positions(inputs, edits, c.vit_depth)):
        mask = windowed if c.vit_window and i not in c.vit_full_blocks else full
        angles = positions.vit_angles(rows, cols, freq)
        x = block_forward(
            vit[f"block_{i}"], x, angles, mask, site, "vit", i, c.vit_eps, ACT[c.vit_act]
        )
    return site("merger/out", merger(params["merger"], x, c))


def merger(m, x, c: QwenVLConfig):
    """norm, each merge block of patches concatenated, Linear, GELU, Linear."""
    x, m = after(x, m)
    h = norm(m, "ln", x, 1e-6)
    h = h.reshape(h.shape[0], h.shape[1] // c.merge_size**2, c.merge_width)
    h = ACT["gelu"](h @ m["W1"] + m["b1"])
    return h @ m["W2"] + m["b2"]


def _lm_pos(inputs: Inputs, edits: Edits):
    if edits.lm_pos_ids is None:
        return inputs.pos_Bx3xS
    e = jnp.asarray(edits.lm_pos_ids)
    e = jnp.broadcast_to(e, (3,) + e.shape) if e.ndim == 1 else e
    return jnp.broadcast_to(e, inputs.pos_Bx3xS.shape)


def language_model(lm, x, pos_Bx3xS, valid_BxS, c: QwenVLConfig, site, resume=None, last_row=False):
    """[B, S, D] the final-normed residual stream under M-RoPE ids `pos_Bx3xS`
    (`models.decoder.run_lm`: [B, T, D] rows start.. when resumed; [B, 1, D] the last
    row with `last_row`)."""
    freq = positions.inv_freq(c.lm_head_dim, c.lm_rope_theta)
    angles = positions.lm_angles(pos_Bx3xS, freq, c.lm_mrope_section)
    return run_lm(lm, x, angles, valid_BxS, c.lm_layers, c.lm_eps, site, resume, last_row)


def forward(
    params,
    inputs: Inputs,
    edits: Edits | None = None,
    *,
    config: QwenVLConfig,
    capture=False,
    rows=None,
    resume: Resume | None = None,
    last_row: bool = False,
):
    """(logits, aux): logits [B, S, V], or [B, V] at `rows` ([B] positions, e.g. each
    sequence's last) or at the last token (`last_row`: the last block then runs that
    row only, and its sites hold it alone); aux the captured sites (module docstring).
    `resume`: run the LM from a block on the last rows only (`Resume`; `rows` still
    count from 0). Jittable with `config` static; vmappable over stacked edits."""
    edits = NO_EDITS if edits is None else edits
    check_inputs(inputs, config)
    check_edits(edits, inputs, config)
    site = Sites(edits, capture)
    lm = params["lm"]
    if resume is None:
        feats = vision(params, inputs, config, edits, site)
        if edits.image_order is not None:
            feats = feats[:, jnp.asarray(edits.image_order)]
        x = place_images(lm["E"][inputs.tokens_BxS], feats, inputs.image_BxI)
        x = site("lm/embed", x)
    else:
        check_resume(resume, inputs, config)
        x = resume.x_BxTxD
    pos = _lm_pos(inputs, edits)
    x = language_model(lm, x, pos, inputs.valid_BxS, config, site, resume, last_row)
    if last_row:
        x = x[:, -1]
    elif rows is not None:
        start = 0 if resume is None else resume.start
        x = x[jnp.arange(x.shape[0]), jnp.asarray(rows) - start]
    return unembed(lm, x), site.aux


def image_features(params, inputs: Inputs, *, config: QwenVLConfig) -> jax.Array:
    """[B, I, D] the vision tower's output (the merger's), unedited."""
    return vision(params, inputs, config, NO_EDITS, Sites(NO_EDITS, False))
