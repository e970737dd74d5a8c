"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL forward as one pure function of (params, inputs).

    patches --W_patch--> (+ the resampled position table) ViT blocks (2D rotary,
                  windows) --merger--> image features (+ DeepStack features)
    tokens --E--> embeddings, image features placed at the <|image_pad|> tokens
                  --> LM blocks (M-RoPE, causal, grouped-query; DeepStack features
                  added at the image tokens after blocks 0, 1, ...) --lnf--> logits

Params: `params.py` (TransformerLens layout). Inputs: `Inputs` below, as the processor
(`processor.py`) makes them. Positions: `positions.py`. Numerics as the reference: norms,
the rotary rotation and the softmax in float32, everything else in the params' dtype.

Named sites (each a point where `Edits.replace` / `Edits.add` act and `capture` reads):

  vit/embed                     [B, P, E]   the patch embedding
  vit/pos_embed                 [B, P, E]   the position table resampled (Qwen3-VL);
                                            vit/resid_pre.0 = embed + pos_embed
  vit/{point}.{i}               resid_pre, q, k, v ([B, P, H, Dh]), rot_q, rot_k,
                                attn_scores, pattern ([B, H, P, P]), z, attn_out,
                                resid_mid, mlp_out, resid_post
  vit/deepstack.{k}             [B, I, D]   DeepStack merger k's output (of ViT block
                                            vit_deepstack[k]; Qwen3-VL)
  merger/out                    [B, I, D]   the image features the LM reads
  lm/embed                      [B, S, D]   the LM's input (image features placed)
  lm/{point}.{i}                as the ViT's (k and v have Hkv heads)
  lm/resid_post_stack.{i}       [B, S, D]   Qwen3-VL, LM blocks i < len(vit_deepstack):
                                            block i's output with DeepStack feature i
                                            added at the image tokens
  lm/final                      [B, S, D]   after the last norm

The two sides of a DeepStack injection (TransformerLens's Qwen3-VL adapter warns that
patching its resid_post there drops the injection): `lm/resid_post.{i}` is block i's
output before the injection (what the reference's `hidden_states[i + 1]` hold),
`lm/resid_post_stack.{i}` after it, and `lm/resid_pre.{i + 1}` (what block i + 1
reads, and the layer the paper 003 reports patch) equals the latter. An edit at
`resid_post.{i}` is carried through the injection (the features are added to the
edited value); one at `resid_post_stack.{i}` or `resid_pre.{i + 1}` replaces the sum.

Position edits: `Edits.vit_rows / vit_cols` ([P] everywhere positions enter; [n_vit_blocks, P]
one row per block; with a position table, [1 + n_vit_blocks, P]: row 0 where the table
is read, then one per block; fractional values rotate by fractional angles and read the
table bilinearly) replace the rows / columns the ViT's positions read (windows stay
those of the physical patches); `Edits.lm_pos_ids` ([S], [3, S] or [B, 3, S]) replaces
the LM's (t, h, w) ids; `Edits.image_order` ([I]) makes image slot i read merged token
image_order[i] (and its DeepStack features).

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
from jaxmech.families.qwen2_vl.checks import check_edits, check_inputs
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.models.checks import check_resume
from jaxmech.models.decoder import (
    ACT,
    Resume,
    Sites,
    after,
    block_forward,
    is_static,
    logits_at,
    norm,
    place_images,
    run_lm,
)
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.models.generate import Decoding, continued_ids
from jaxmech.models.precision import einsum, matmul
from jaxmech.models.scan import run_blocks

__all__ = ["Inputs", "Resume", "decoding", "forward", "image_features", "language_model",
           "vision"]  # fmt: skip


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


def _vit_positions(inputs: Inputs, edits: Edits, c: QwenVLConfig):
    """(the (rows, cols) [B, P] the position table is read at, or None without one;
    per block the (rows, cols) its rotary positions read): edits override (module
    docstring), a [n, P] edit row j at the table (j = 0, with one) or block j (- 1)."""
    n = c.vit_depth + bool(c.vit_pos_table)
    entries = []
    for own, edit in ((inputs.rows_BxP, edits.vit_rows), (inputs.cols_BxP, edits.vit_cols)):
        e = None if edit is None else jnp.asarray(edit, jnp.float32)
        entries.append([own if e is None else
                        jnp.broadcast_to(e[j] if e.ndim == 2 else e, own.shape)
                        for j in range(n)])  # fmt: skip
    pairs = list(zip(*entries))
    return (pairs[0] if c.vit_pos_table else None), pairs[n - c.vit_depth :]


def _embed(vit, inputs: Inputs, c: QwenVLConfig, table_rc, site):
    """[B, P, E] the patch embedding (its bias where it has one) and, with a position
    table, the table resampled at `table_rc` added (sites `vit/embed`, `vit/pos_embed`)."""
    x = einsum("bpf,fe->bpe", inputs.pixels_BxPxF.astype(vit["W_patch"].dtype), vit["W_patch"])
    x = site("vit/embed", x + vit["b_patch"] if "b_patch" in vit else x)
    if table_rc is None:
        return x
    # each image's extent (h, w) in patches, from its own positions (not the edited ones)
    extent = jnp.stack(
        [jnp.max(a, 1, initial=0) + 1 for a in (inputs.rows_BxP, inputs.cols_BxP)], 1
    )
    index, weight = positions.table_taps(*table_rc, extent, c.vit_pos_side)
    pos = jnp.einsum("bpje,bpj->bpe", vit["pos_table"][index].astype(jnp.float32), weight)
    return x + site("vit/pos_embed", pos.astype(x.dtype))


def vision(params, inputs: Inputs, c: QwenVLConfig, edits: Edits, site):
    """([B, I, D] the merged image features, [[B, I, D]] the DeepStack features): the
    blocks under one `lax.scan` where the weights allow (`models.scan.run_blocks`; each
    block's positions and window choice its per-layer inputs), the DeepStack mergers
    reading their blocks' outputs after it."""
    vit = params["vit"]
    table_rc, block_rc = _vit_positions(inputs, edits, c)
    x = _embed(vit, inputs, c, table_rc, site)
    freq = positions.inv_freq(c.vit_head_dim // 2, c.vit_rope_theta)
    full = inputs.frame_BxP[:, :, None] == inputs.frame_BxP[:, None, :]
    windowed = inputs.window_BxP[:, :, None] == inputs.window_BxP[:, None, :]

    def block(w, x, s, i, rc_window):  # i: the index in site names (int or LAYER)
        (rows, cols), window = rc_window
        if isinstance(window, bool):
            mask = windowed if window else full
        else:  # a scanned block's choice, traced
            mask = jnp.where(window, windowed, full)
        angles = positions.vit_angles(rows, cols, freq)
        return block_forward(w, x, angles, mask, s, "vit", i, c.vit_eps, ACT[c.vit_act])

    taps = [f"vit/resid_post.{i}" for i in c.vit_deepstack]
    # per block: its (rows, cols) and whether it attends within windows
    window = [bool(c.vit_window) and i not in c.vit_full_blocks for i in range(c.vit_depth)]
    x, tapped = run_blocks(vit, c.vit_depth, x, range(c.vit_depth), block, site,
                           list(zip(block_rc, window)), taps)  # fmt: skip
    stack = []
    for k, name in enumerate(taps):
        m = params["deepstack"][f"merger_{k}"]
        stack.append(site(f"vit/deepstack.{k}", merger(m, tapped[name], c, post_shuffle=True)))
    return site("merger/out", merger(params["merger"], x, c)), stack


def merger(m, x, c: QwenVLConfig, post_shuffle: bool = False):
    """norm, each merge block of patches concatenated, Linear, GELU, Linear; the norm over
    the concatenation instead (`post_shuffle`: Qwen3-VL's DeepStack mergers)."""
    x, m = after(x, m)

    def shuffle(h):  # each merge block's patches concatenated
        return h.reshape(h.shape[0], h.shape[1] // c.merge_size**2, c.merge_width)

    h = norm(m, "ln", shuffle(x), 1e-6) if post_shuffle else shuffle(norm(m, "ln", x, 1e-6))
    h = ACT["gelu"](matmul(h, m["W1"]) + m["b1"])
    return matmul(h, m["W2"]) + m["b2"]


def _lm_pos(inputs: Inputs, edits: Edits):
    if edits.lm_pos_ids is None:
        return inputs.pos_Bx3xS
    e = jnp.asarray(edits.lm_pos_ids)
    e = jnp.broadcast_to(e, (3,) + e.shape) if e.ndim == 1 else e
    return jnp.broadcast_to(e, inputs.pos_Bx3xS.shape)


def _deepstack(stack, image_BxI, site):
    """`run_lm`'s `between`: after LM block i < len(stack), DeepStack feature i [B, I, D]
    added to the rows at the image tokens `image_BxI` (those the block ran: from row0)."""

    def between(i, x, row0):
        if i >= len(stack):
            return x
        at = jnp.asarray(image_BxI) - row0
        at = jnp.where(at >= 0, at, x.shape[1])  # rows not run: out of bounds, dropped
        b = jnp.arange(x.shape[0])[:, None]
        x = x.at[b, at].add(stack[i].astype(x.dtype), mode="drop")
        return site(f"lm/resid_post_stack.{i}", x)

    return between


def language_model(lm, x, pos_Bx3xS, valid_BxS, c: QwenVLConfig, site, resume=None,
                   last_row=False, stack=(), image_BxI=None):  # fmt: skip
    """[B, S, D] the final-normed residual stream under M-RoPE ids `pos_Bx3xS`
    (`models.decoder.run_lm`: [B, T, D] rows start.. when resumed; [B, 1, D] the last
    row with `last_row`), DeepStack features `stack` ([[B, I, D]]) added at the image
    tokens `image_BxI` after blocks 0, 1, ..."""
    freq = positions.inv_freq(c.lm_head_dim, c.lm_rope_theta)
    angles = positions.lm_angles(pos_Bx3xS, freq, c.lm_mrope_section, c.lm_mrope_interleaved)
    between = _deepstack(stack, image_BxI, site) if stack else None
    return run_lm(lm, x, angles, valid_BxS, c.lm_layers, c.lm_eps, site, resume, last_row,
                  between=between, n_between=len(stack))  # fmt: skip


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
    count from 0; resumed before a DeepStack injection, the ViT runs again for its
    features, and the cached rows must come from a run of these inputs). Jittable with
    `config` static; vmappable over stacked edits."""
    edits = NO_EDITS if edits is None else edits
    check_inputs(inputs, config)
    check_edits(edits, inputs, config)
    site = Sites(edits, capture, config.remat)
    lm = params["lm"]
    stack = []
    if resume is not None:
        check_resume(resume, inputs.tokens_BxS, config.lm_layers, config.lm_width)
    # resumed before a DeepStack injection, the ViT runs for its features
    K = len(config.vit_deepstack)
    if resume is None or (K and (not is_static(resume.layer) or resume.layer < K)):
        feats, stack = vision(params, inputs, config, edits, site)
        if edits.image_order is not None:
            order = jnp.asarray(edits.image_order)
            feats, stack = feats[:, order], [f[:, order] for f in stack]
    if resume is None:
        x = place_images(lm["E"][inputs.tokens_BxS], feats, inputs.image_BxI)
        x = site("lm/embed", x)
    else:
        x = resume.x_BxTxD
    pos = _lm_pos(inputs, edits)
    x = language_model(lm, x, pos, inputs.valid_BxS, config, site, resume, last_row, stack,
                       inputs.image_BxI)  # fmt: skip
    return logits_at(lm, x, rows, resume, last_row), site.aux


def image_features(params, inputs: Inputs, *, config: QwenVLConfig) -> jax.Array:
    """[B, I, D] the vision tower's output (the merger's), unedited."""
    return vision(params, inputs, config, NO_EDITS, Sites(NO_EDITS, False))[0]


def decoding(config: QwenVLConfig) -> Decoding:
    """What `models.generate` needs of the LM: generated token k of a row at M-RoPE ids
    (m + 1 + k) x 3, m the row's largest prompt id (text continuing after the image block:
    the reference's `rope_deltas`); no DeepStack injection (its features belong to the
    prompt's image tokens)."""
    freq = positions.inv_freq(config.lm_head_dim, config.lm_rope_theta)

    def angles(inputs: Inputs, step):
        ids = continued_ids(inputs.pos_Bx3xS, step)
        pos = jnp.broadcast_to(ids[:, None, None], (ids.shape[0], 3, 1))
        return positions.lm_angles(pos, freq, config.lm_mrope_section,
                                   config.lm_mrope_interleaved)  # fmt: skip

    return Decoding(forward, config.lm_layers, config.lm_eps, "silu", angles)
