"""The Llama-3.2-Vision (mllama) forward as one pure function of (params, inputs).

    tiles --W_patch--> + tanh(g) pre-tile embedding, + [CLS], + the gated position
        embedding ((1 - tanh(g)) table + tanh(g) tile table) --ln_pre--> padded to a
        multiple of 8 rows per tile --> local layers over all tiles of the image (the
        outputs of `intermediate` kept) --ln_post--> + tanh(g) post-tile embedding -->
        gated global layers (tanh-gated attention and MLP) --> padding dropped; the
        last output and the kept ones interleaved per channel --> Linear: the vision
        states [B, I, D] (I = T x (1 + P))
    tokens --E--> Llama layers (1D rotary, causal, grouped-query); at `cross_layers` a
        gated cross-attention layer instead: queries from the text (q_norm), keys and
        values from the vision states (k_norm), masked to the tiles each token may see
        (`xattn_BxSxT`), x + tanh(attn_gate) attn, then x + tanh(mlp_gate) row_mask MLP
        --lnf--> logits

The image never enters the token sequence: the `<|image|>` token is an ordinary
embedding, and the text reads the image only in the cross-attention layers. As the
reference, a row that may see no tile (before the `<|image|>` token) attends to every
vision token unmasked (padded tiles included), and only its MLP branch is zeroed (the
"full text row" mask); without an image the cross-attention layers change nothing (the
reference skips them): their attention has no keys and their MLP is zeroed.

The encoders' attention mask is the reference's: a query and a key are cut apart only
when both are padding (a padded tile or the rows added to reach a multiple of 8), so
real rows also attend to padding rows.

Named sites (`Edits.replace` / `Edits.add` act, `capture` reads):

  vit/embed                     [B, T, 1 + P, E]  patches, CLS, tile and position
                                embeddings, before ln_pre
  vit/{point}.{i}               local layer i ([B, T R, E], R = 1 + P padded to 8;
                                q, k, v [B, T R, H, Dh]; no rot_q / rot_k)
  vit_global/{point}.{i}        global layer i (attn_out, mlp_out after their tanh gates)
  vit/out                       [B, T, 1 + P, Ev]  the features the projector reads
  proj/out                      [B, I, D]  the vision states every cross-attention layer's
                                keys and values are computed from
  lm/embed                      [B, S, D]
  lm/{point}.{i}                a self-attention layer's sites (with rot_q / rot_k); at a
                                cross-attention layer: vision [B, I, D] (the states its
                                keys and values read: proj/out, or an edit's), resid_pre, q [B, S, H, Dh] (after
                                q_norm), k, v [B, I, Hkv, Dh] (k after k_norm),
                                attn_scores, pattern [B, H, S, I], z, attn_out (after the
                                gate), resid_mid, mlp_out (after the row mask and gate),
                                resid_post
  lm/final                      [B, S, D]  after the last norm

Position edits: `Edits.vit_rows / vit_cols` ([P]) read both per-patch tables at those
(row, col) in every tile (`positions.tables_at`); `Edits.lm_pos_ids` the LM's ids;
`Edits.image_order` ([I]) makes cross-attention key slot i read vision token
image_order[i] (the tile mask stays with the slot).

The LM's layers run under one `lax.scan`, a switch on each layer's kind (`layers`: one
self-attention and one cross-attention body compiled however many layers); edits and
captures stay per site name.

Partial runs: `last_row=True` runs the last layer for the last row only (on its own,
after the scan). `resume` is refused (no key / value cache through the cross-attention
layers).

Axis names (`jaxmech.shapes`): B sequences, T tiles, P patches of a tile, I vision
tokens, S LM tokens, E / D vision / LM width, H heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.mllama import positions
from jaxmech.families.mllama.checks import check_edits, check_inputs
from jaxmech.families.mllama.config import MllamaConfig
from jaxmech.families.mllama.layers import scan_kinds
from jaxmech.models import layout
from jaxmech.models.decoder import (
    ACT,
    Sites,
    after,
    block_forward,
    layer_norm,
    lm_mask,
    logits_at,
    mlp,
    rms_norm,
)
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.models.generate import Decoding
from jaxmech.models.positions import edited_ids, rotary_angles
from jaxmech.models.precision import einsum, matmul
from jaxmech.models.scan import run_blocks

__all__ = ["Inputs", "decoding", "forward", "vision"]


class Inputs(NamedTuple):
    """One batch for `forward` (every leaf leads with B; one image per sequence, or none
    in the whole batch: T = 0).

    tokens_BxS: int32 token ids. pixels_BxTxPxF: float32 the tiles' flattened patches
    (C, p, p), missing tiles 0 (`processor`). aspect_B: int32 the aspect-ratio id (1..;
    the reference's aspect_ratio_ids). tiles_BxT: bool the tiles that hold the image
    (aspect_ratio_mask). xattn_BxSxT: bool the tiles each token may attend to
    (cross_attention_mask). image_BxI: int32 the LM position of the row's `<|image|>`
    token, once per vision token (where the image is marked; I = 0 without an image).
    pos_BxS: int32 the LM's ids. valid_BxS: bool, False at (left) padding.
    """

    tokens_BxS: Any
    pixels_BxTxPxF: Any
    aspect_B: Any
    tiles_BxT: Any
    xattn_BxSxT: Any
    image_BxI: Any
    pos_BxS: Any
    valid_BxS: Any


def _gate(g):
    return jnp.tanh(g.astype(jnp.float32))


def _position_tables(vit, aspect_B, edits: Edits, c: MllamaConfig):
    """([1 + P, E] the learned table, [B, T, 1 + P, E] the tile tables) as read under the
    position edits (the CLS row fixed)."""
    pos, tile = vit["pos"], vit["tile_pos"][aspect_B]
    if edits.vit_rows is None and edits.vit_cols is None:
        return pos, tile
    rows, cols = positions.patch_grid(c.grid)
    rows = rows if edits.vit_rows is None else edits.vit_rows
    cols = cols if edits.vit_cols is None else edits.vit_cols
    pos = jnp.concatenate([pos[:1], positions.tables_at(pos[None], rows, cols)[0]], 0)
    B, T, N, E = tile.shape
    flat = tile.reshape(B * T, N, E)
    moved = positions.tables_at(flat, rows, cols)
    tile = jnp.concatenate([flat[:, :1], moved], 1).reshape(B, T, N, E)
    return pos, tile


def _vit_mask(tiles_BxT, c: MllamaConfig):
    """[B, T R, T R] the encoders' mask: False only where query and key are both padding."""
    R = c.tile_rows
    real_row = jnp.arange(R) < c.n_patches + 1
    pad = ~(tiles_BxT[:, :, None] & real_row[None, None]).reshape(tiles_BxT.shape[0], -1)
    return ~(pad[:, :, None] & pad[:, None, :])


def vision(params, inputs: Inputs, c: MllamaConfig, edits: Edits, site) -> jax.Array:
    """[B, I, D] the vision states (the projector's output)."""
    vit = params["vit"]
    aspect = jnp.asarray(inputs.aspect_B, jnp.int32)
    x = einsum("btpf,fe->btpe", inputs.pixels_BxTxPxF.astype(vit["W_patch"].dtype), vit["W_patch"])
    B, T, P, E = x.shape
    x = x + (_gate(vit["pre_tile_gate"]) * vit["pre_tile"][aspect][:, :, None]).astype(x.dtype)
    cls = jnp.broadcast_to(vit["cls"].astype(x.dtype), (B, T, 1, E))
    x = jnp.concatenate([cls, x], 2)
    pos, tile = _position_tables(vit, aspect, edits, c)
    g = _gate(vit["pos_gate"])
    x = x + ((1 - g) * pos).astype(x.dtype)
    x = site("vit/embed", x + (g * tile).astype(x.dtype))
    x = layer_norm(x, vit["ln_pre_w"], vit["ln_pre_b"], c.vit_eps)
    R = c.tile_rows
    x = jnp.pad(x, ((0, 0), (0, 0), (0, R - P - 1), (0, 0))).reshape(B, T * R, E)
    mask = _vit_mask(jnp.asarray(inputs.tiles_BxT, bool), c)
    act = ACT[c.vit_act]

    def local(w, x, s, i, _):
        return block_forward(w, x, None, mask, s, "vit", i, c.vit_eps, act)

    def gated(w, x, s, i, _):  # the gates as layer scales tanh(gate)
        b = dict(w)
        b["ls1"], b["ls2"] = (_gate(b.pop(n)).astype(x.dtype) for n in ("gate_attn", "gate_ffn"))
        return block_forward(b, x, None, mask, s, "vit_global", i, c.vit_eps, act)

    # each stack under one scan (`models.scan.run_blocks`), the intermediate outputs
    # the projector reads tapped
    taps = [f"vit/resid_post.{i}" for i in c.intermediate]
    x, kept = run_blocks(vit, c.vit_depth, x, range(c.vit_depth), local, site, taps=taps)
    x = layer_norm(x, vit["ln_post_w"], vit["ln_post_b"], c.vit_eps).reshape(B, T, R, E)
    post = _gate(vit["post_tile_gate"]) * vit["post_tile"][aspect][:, :, None]
    x = (x + post.astype(x.dtype)).reshape(B, T * R, E)
    n = c.vit_global_depth
    x, _ = run_blocks(vit, n, x, range(n), gated, site, prefix="global_block_")
    unpad = lambda h: h.reshape(B, T, R, -1)[:, :, : P + 1]  # noqa: E731
    inter = jnp.stack([unpad(kept[t]) for t in taps], -1).reshape(B, T, P + 1, -1)
    feats = site("vit/out", jnp.concatenate([unpad(x), inter], -1))
    feats, p = after(feats, params["proj"])
    out = matmul(feats.reshape(B, T * (P + 1), -1), p["W"]) + p["b"]
    return site("proj/out", out)


def cross_layer(block, x, vis_BxIxD, allowed_BxSxI, row_BxS, site, i: int, c: MllamaConfig,
                q_last: bool = False):  # fmt: skip
    """One gated cross-attention layer: [B, S, D] -> [B, S, D] ([B, 1, D] with `q_last`).
    `allowed_BxSxI` the keys each row may read (a row allowed none reads them all);
    `row_BxS` the rows whose MLP branch counts (the full-text-row mask)."""

    def at(point, v):
        return site(f"lm/{point}.{i}", v)

    x, block = after(at("resid_pre", x), block)
    h = rms_norm(x, block["ln1_w"], c.lm_eps)
    if q_last:
        h, x = h[:, -1:], x[:, -1:]
        allowed_BxSxI, row_BxS = allowed_BxSxI[:, -1:], row_BxS[:, -1:]
    eps = c.lm_eps
    q = at("q", rms_norm(einsum("bnd,hde->bnhe", h, block["W_Q"]), block["q_norm_w"], eps))
    vis = vis_BxIxD.astype(h.dtype)
    k = at("k", rms_norm(einsum("bnd,hde->bnhe", vis, block["W_K"]), block["k_norm_w"], eps))
    v = at("v", einsum("bnd,hde->bnhe", vis, block["W_V"]))
    B, N, H, Dh = q.shape
    C = k.shape[2]
    qg = q.reshape(B, N, C, H // C, Dh)
    scores = einsum("bqcge,bkce->bcgqk", qg, k).reshape(B, H, N, k.shape[1])
    scores = at("attn_scores", scores * Dh**-0.5)
    free = ~allowed_BxSxI.any(-1, keepdims=True)  # reads every key, as the reference
    logits = jnp.where((allowed_BxSxI | free)[:, None], scores.astype(jnp.float32), -jnp.inf)
    pattern = at("pattern", jax.nn.softmax(logits, -1).astype(v.dtype))
    pg = pattern.reshape(B, C, H // C, N, k.shape[1])
    z = at("z", einsum("bcgqk,bkce->bqcge", pg, v).reshape(B, N, H, Dh))
    attn = einsum("bqhe,hed->bqd", z, block["W_O"])
    x = at("resid_mid", x + at("attn_out", (_gate(block["attn_gate"]) * attn).astype(x.dtype)))
    out = mlp(block, rms_norm(x, block["ln2_w"], eps), ACT[c.lm_act])
    out = out * row_BxS[..., None].astype(out.dtype)
    out = at("mlp_out", (_gate(block["mlp_gate"]) * out).astype(x.dtype))
    return at("resid_post", x + out)


def forward(params, inputs: Inputs, edits: Edits | None = None, *, config: MllamaConfig,
            capture=False, rows=None, resume=None, last_row: bool = False):  # fmt: skip
    """(logits, aux): logits [B, S, V], or [B, V] at `rows` ([B] positions) or at the last
    token (`last_row`); aux the captured sites (module docstring). Jittable with `config`
    static; vmappable over stacked edits. `resume` is refused."""
    c = config
    if resume is not None:
        raise ValueError("resume: not supported by mllama (its cross-attention layers have "
                         "no key / value cache here); run the whole forward")  # fmt: skip
    edits = NO_EDITS if edits is None else edits
    check_inputs(inputs, c)
    check_edits(edits, inputs, c)
    site = Sites(edits, capture, c.remat)
    lm = params["lm"]
    x = site("lm/embed", lm["E"][inputs.tokens_BxS])
    B, S, D = x.shape
    T = inputs.pixels_BxTxPxF.shape[1]
    if T:
        vis = vision(params, inputs, c, edits, site)
        if edits.image_order is not None:
            vis = vis[:, jnp.asarray(edits.image_order)]
        xattn = jnp.asarray(inputs.xattn_BxSxT, bool)
        allowed = jnp.repeat(xattn, c.n_patches + 1, axis=2)  # [B, S, I]
    else:
        vis = jnp.zeros((B, 0, D), x.dtype)
        allowed = jnp.zeros((B, S, 0), bool)
    row = allowed.any(-1)
    angles = rotary_angles(edited_ids(inputs.pos_BxS, edits.lm_pos_ids),
                           positions.lm_inv_freq(c))  # fmt: skip
    causal = lm_mask(jnp.asarray(inputs.valid_BxS, bool))

    def self_block(w, x, s, i, q_last=False):
        return block_forward(w, x, angles, causal, s, "lm", i, c.lm_eps, ACT[c.lm_act], None,
                             q_last)  # fmt: skip

    def cross_block(w, x, s, i, q_last=False):
        return cross_layer(w, x, s(f"lm/vision.{i}", vis), allowed, row, s, i, c, q_last)

    # one scan, the layer's kind switched (`layers`); the last layer on its own under
    # `last_row` (it runs the last row only)
    kind_of = tuple("cross" if i in c.cross_layers else "self" for i in range(c.lm_layers))
    bodies = {"self": self_block, "cross": cross_block}
    end = c.lm_layers - 1 if last_row else c.lm_layers
    x = scan_kinds(lm, x, range(end), kind_of, bodies, site)
    if last_row:
        i = c.lm_layers - 1
        x = bodies[kind_of[i]](layout.block(lm, i), x, site, i, q_last=True)
    x = site("lm/final", rms_norm(x, lm["lnf_w"], c.lm_eps))
    return logits_at(lm, x, rows, None, last_row), site.aux


def decoding(config: MllamaConfig) -> Decoding:
    """What `models.generate` needs of the LM (`hf_vlm.text_decoding`)."""
    return hf_vlm.text_decoding(forward, config, positions.lm_inv_freq(config), config.lm_act)
