"""The Gemma-3 forward as one pure function of (params, inputs).

    patches --W_patch + b--> + the learned position table (no CLS) --> SigLIP blocks
    --post_layernorm--> average pooling (k x k patches per token) --Gemma RMSNorm--> x @ W
    tokens --E x sqrt(D)--> embeddings, image features placed at the image tokens
      --> Gemma-3 blocks (sliding-window or global attention, each type its own rotary)
      --final norm--> x E^T: logits

Gemma-3's block: x + post_attn_norm(attn(norm1(x))), then + post_mlp_norm(mlp(norm2(x)));
every norm Gemma's RMSNorm (float32, times 1 + w, then the input's dtype), per-head q / k
norms before the rotary, scores scaled by query_pre_attn_scalar^(-1/2) (not the head
width), a gated gelu_pytorch_tanh MLP. The text embeddings are multiplied by sqrt(D)
taken to the weights' dtype (bf16: 5.65625 for D = 32), the image features are not.

Masks, as the reference's (transformers 5.25, `token_type_ids` given as its processor
returns them): a global layer lets token q see key k when (k <= q or both are image
tokens of the same image) and k is not padding; a sliding layer adds k > q - W (W the
window): a token sees W - 1 earlier tokens and itself, and every later token of its own
image (the window bounds only the past). `forward(..., bidirectional=False)` drops the
image blocks (the reference's mask without `token_type_ids`). Softcapping: the
reference's `Gemma3ForConditionalGeneration` never applies it (config module).

Named sites (each a point where `Edits.replace` / `Edits.add` act and `capture` reads):

  vit/embed                [B, P, E]  patch embeddings with positions
  vit/{point}.{i}          resid_pre, q, k, v ([B, P, H, Dh]), attn_scores, pattern, z,
                           attn_out, resid_mid, mlp_out, resid_post (no rotary)
  vit/final                [B, P, E]  after post_layernorm (what the projector reads)
  proj/pooled              [B, I, E]  the average-pooled patches (I = mm_tokens_per_image)
  proj/out                 [B, I, D]  the image features the LM reads
  lm/embed                 [B, S, D]  the LM's input (scaled text embeddings, images placed)
  lm/{point}.{i}           as the ViT's, with rot_q / rot_k (k, v: Hkv heads; q, k after
                           their norms); attn_out / mlp_out are the sublayers' outputs
                           after their post norms (what the residual adds)
  lm/final                 [B, S, D]  after the final norm

Position edits: `Edits.vit_rows / vit_cols` ([P]: positions enter once) read the table
at those (row, col) bilinearly (`models.positions.read_table`); `Edits.lm_pos_ids` ([S],
[3, S] or [B, 3, S] with equal rows) replaces the LM's ids (both rotary kinds);
`Edits.image_order` ([I]) makes image slot i read image token image_order[i].

Partial runs: `last_row=True` runs the last LM block for the last row only (logits [B,
V]); `resume=Resume(...)` runs the LM from one block on the last rows only, the rows
before read from another run's keys and values (the masks' rows cut alike).

Axis names (`jaxmech.shapes`): B sequences, P patches, I image tokens, S LM tokens, E / D
ViT / LM width, H heads, Dh head width, R rotary pairs, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.families import hf_vlm
from jaxmech.families.gemma3.checks import check_edits, check_inputs
from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.models.attention import rotate
from jaxmech.models.decoder import (
    ACT,
    Resume,
    Sites,
    after,
    block_forward,
    inv_freq,
    is_static,
    layer_norm,
    logits_at,
    mlp,
    resume_cache,
    stack,
    unembed,
)
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.models.generate import Decoding, cached_blocks, continued_ids
from jaxmech.models.positions import edited_ids, read_table, rotary_angles
from jaxmech.models.precision import einsum, matmul
from jaxmech.models.scan import run_blocks

__all__ = ["Inputs", "Resume", "decoding", "forward", "gemma_norm", "image_features", "lm_masks",
           "vision"]  # fmt: skip


# image_BxI: in the pooled token grid's order (they also form the bidirectional block)
Inputs = hf_vlm.PatchInputs


def gemma_norm(x, w, eps):
    """Gemma's RMSNorm: float32 statistics, times (1 + w) in float32, then x's dtype."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
    return (h * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _position_rows(vit, edits: Edits, c: Gemma3Config):
    """[P, E] the position table as read under the edits."""
    if edits.vit_rows is None and edits.vit_cols is None:
        return vit["pos"]
    g = c.grid
    rows, cols = (a.astype(np.float32) for a in np.divmod(np.arange(g * g), g))
    rows = rows if edits.vit_rows is None else edits.vit_rows
    cols = cols if edits.vit_cols is None else edits.vit_cols
    return read_table(vit["pos"].reshape(g, g, -1), rows, cols)


def pool(x_BxPxE, c: Gemma3Config):
    """[B, I, E] the average over each k x k square of the g x g patch grid (k =
    `c.pool`), tokens row-major on the pooled grid (the reference's AvgPool2d)."""
    B, _, E = x_BxPxE.shape
    t, k = c.token_grid, c.pool
    x = x_BxPxE.reshape(B, t, k, t, k, E).astype(jnp.float32)
    return x.mean((2, 4)).reshape(B, t * t, E).astype(x_BxPxE.dtype)


def vision(params, inputs: Inputs, c: Gemma3Config, edits: Edits, site) -> jax.Array:
    """[B, I, D] the projected image features."""
    vit = params["vit"]
    pixels = inputs.pixels_BxPxF.astype(vit["W_patch"].dtype)
    x = einsum("bpf,fe->bpe", pixels, vit["W_patch"]) + vit["b_patch"]
    x = site("vit/embed", x + _position_rows(vit, edits, c))
    mask = jnp.ones((x.shape[0], x.shape[1], x.shape[1]), bool)

    def block(w, x, s, i, _):
        return block_forward(w, x, None, mask, s, "vit", i, c.vit_eps, ACT[c.vit_act])

    x, _ = run_blocks(vit, c.vit_depth, x, range(c.vit_depth), block, site)  # one scan
    x = site("vit/final", layer_norm(x, vit["ln_post_w"], vit["ln_post_b"], c.vit_eps))
    pooled = site("proj/pooled", pool(x, c))
    p = params["proj"]
    pooled, p = after(pooled, p)
    out = matmul(gemma_norm(pooled, p["norm_w"], c.vit_eps), p["W"].astype(pooled.dtype))
    return site("proj/out", out)


def lm_masks(valid_BxS, image_BxI, c: Gemma3Config, bidirectional: bool = True):
    """{"full_attention", "sliding_attention"}: [B, S, S] bool masks (module docstring;
    each token also sees itself, so a padding row stays finite)."""
    valid = jnp.asarray(valid_BxS, bool)
    B, S = valid.shape
    q, k = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    seen = jnp.broadcast_to(k <= q, (B, S, S))
    image = jnp.asarray(image_BxI)
    if bidirectional and image.shape[1]:
        is_image = jnp.zeros((B, S), bool).at[jnp.arange(B)[:, None], image].set(True)
        seen = seen | (is_image[:, :, None] & is_image[:, None, :])
    eye = jnp.eye(S, dtype=bool)
    seen = seen & valid[:, None, :]
    return {"full_attention": seen | eye,
            "sliding_attention": (seen & (k > q - c.lm_window)) | eye}  # fmt: skip


def _rot(x, angles):
    """x [B, N, H, Dh] rotated by angles [B, N, R] in float32 (rotate-half layout)."""
    return rotate(x.astype(jnp.float32), angles[:, :, None, :]).astype(x.dtype)


def attention(block, x_in, angles, mask, site, i: int, c: Gemma3Config, cache=None,
              q_last=False):  # fmt: skip
    """Gemma-3's attention sublayer: [B, N, D] -> [B, N, D] (grouped-query, q / k norms
    before the rotary, scores scaled by query_pre_attn_scalar^(-1/2)); `cache`: keys and
    values of the rows before (`Resume`); `q_last`: the last row queries alone."""

    def at(point, x):
        return site(f"lm/{point}.{i}", x)

    def proj(w, x, norm=None):
        y = einsum("bnd,hde->bnhe", x, block[f"W_{w}"])
        return y if norm is None else gemma_norm(y, block[norm], c.lm_eps)

    q_in = x_in[:, -1:] if q_last else x_in
    mask = mask[:, -1:] if q_last else mask
    q = at("q", proj("Q", q_in, "q_norm_w"))
    k, v = at("k", proj("K", x_in, "k_norm_w")), at("v", proj("V", x_in))
    q = at("rot_q", _rot(q, angles[:, -1:] if q_last else angles))
    k = at("rot_k", _rot(k, angles))
    if cache is not None:
        k, v = (jnp.concatenate([a.astype(b.dtype), b], axis=1) for a, b in zip(cache, (k, v)))
    B, N, H, E = q.shape
    C = k.shape[2]
    qg = q.reshape(B, N, C, H // C, E)
    scores = einsum("bqcge,bkce->bcgqk", qg, k).reshape(B, H, N, k.shape[1])
    scores = at("attn_scores", scores * jnp.asarray(c.lm_query_scale**-0.5, scores.dtype))
    logits = jnp.where(mask[:, None], scores.astype(jnp.float32), -jnp.inf)
    pattern = at("pattern", jax.nn.softmax(logits, -1).astype(v.dtype))
    pg = pattern.reshape(B, C, H // C, N, k.shape[1])
    z = at("z", einsum("bcgqk,bkce->bqcge", pg, v).reshape(B, N, H, E))
    return einsum("bqhe,hed->bqd", z, block["W_O"])


def gemma_block(block, x, angles, mask, site, i: int, c: Gemma3Config, cache=None,
                q_last=False):  # fmt: skip
    """One Gemma-3 block (module docstring); `q_last`: the last row only ([B, 1, D])."""
    x, block = after(site(f"lm/resid_pre.{i}", x), block)
    attn = attention(block, gemma_norm(x, block["ln1_w"], c.lm_eps), angles, mask, site, i, c,
                     cache, q_last)  # fmt: skip
    attn = gemma_norm(attn, block["ln1_post_w"], c.lm_eps)
    x = x[:, -1:] if q_last else x
    x = site(f"lm/resid_mid.{i}", x + site(f"lm/attn_out.{i}", attn))
    out = mlp(block, gemma_norm(x, block["ln2_w"], c.lm_eps), ACT[c.lm_act])
    out = site(f"lm/mlp_out.{i}", gemma_norm(out, block["ln2_post_w"], c.lm_eps))
    return site(f"lm/resid_post.{i}", x + out)


def rotary(c: Gemma3Config, kind: str) -> np.ndarray:
    """[R] float32 the rotary frequencies of a layer type (linear scaling divides them)."""
    local = kind == "sliding_attention"
    theta = c.lm_local_theta if local else c.lm_global_theta
    factor = c.lm_local_factor if local else c.lm_global_factor
    return (inv_freq(c.lm_head_dim, theta) / np.float32(factor)).astype(np.float32)


def pick(c: Gemma3Config, table, layer):
    """A layer's entry of a {layer type: array} table (`layer` an int or traced)."""
    if is_static(layer):
        return table[c.lm_layer_types[layer]]
    sliding = np.array([k == "sliding_attention" for k in c.lm_layer_types])
    return jnp.where(jnp.asarray(sliding)[layer], table["sliding_attention"],
                     table["full_attention"])  # fmt: skip


def run_lm(lm, x, pos_BxS, masks, c: Gemma3Config, site, resume=None, last_row=False):
    """[B, S, D] the final-normed residual stream ([B, T, D] rows start.. when resumed;
    [B, 1, D] the last row with `last_row`): the blocks under one `lax.scan`
    (`models.decoder.stack`), each layer's type (sliding window or global: its mask and
    rotary table) switched by its index."""
    first, s0 = (0, 0) if resume is None else (resume.layer, resume.start)
    angles = {kind: rotary_angles(pos_BxS, rotary(c, kind))[:, s0:] for kind in masks}
    masks = {kind: m[:, s0:] for kind, m in masks.items()}

    def block(w, x, site_, i, cache_i, q_last=False, layer=None):
        return gemma_block(w, x, pick(c, angles, layer), pick(c, masks, layer), site_, i, c,
                           cache_i, q_last)  # fmt: skip

    cache = functools.partial(resume_cache, resume)
    x = stack(lm, x, c.lm_layers, first, site, block, lambda i, x, q: x, cache, last_row)
    return site("lm/final", gemma_norm(x, lm["lnf_w"], c.lm_eps))


def embed(lm, tokens_BxS, c: Gemma3Config):
    """[B, S, D] the text embeddings times sqrt(D) taken to the weights' dtype."""
    E = lm["E"]
    return E[tokens_BxS] * jnp.asarray(np.float32(c.lm_width**0.5), E.dtype)


def forward(params, inputs: Inputs, edits: Edits | None = None, *, config: Gemma3Config,
            capture=False, rows=None, resume: Resume | None = None, last_row: bool = False,
            bidirectional: bool = True):  # fmt: skip
    """(logits, aux): logits [B, S, V], or [B, V] at `rows` ([B] positions) or at the last
    token (`last_row`); aux the captured sites (module docstring). `resume`: run the LM
    from a block on the last rows only (`Resume`). `bidirectional`: the image tokens see
    each other both ways (the reference with `token_type_ids`, its processor's default).
    Jittable with `config` static; vmappable over stacked edits."""
    edits, site, x = hf_vlm.lm_start(params, inputs, edits, config, capture, resume,
                                     checks=(check_inputs, check_edits), vision=vision,
                                     images=hf_vlm.has_patches, embed=embed)  # fmt: skip
    lm = params["lm"]
    masks = lm_masks(inputs.valid_BxS, inputs.image_BxI, config, bidirectional)
    pos = edited_ids(inputs.pos_BxS, edits.lm_pos_ids)
    x = run_lm(lm, x, pos, masks, config, site, resume, last_row)
    return logits_at(lm, x, rows, resume, last_row), site.aux


def image_features(params, inputs: Inputs, *, config: Gemma3Config) -> jax.Array:
    """[B, I, D] the projector's output, unedited."""
    return vision(params, inputs, config, NO_EDITS, Sites(NO_EDITS, False))


def decode_step(c: Gemma3Config, params, inputs: Inputs, token_B, cache, valid_BxL, step):
    """One generated token through Gemma-3's blocks (`models.generate.decode_step`'s
    contract): at sequence slot S + step and rotary id m + 1 + step (m the row's largest
    prompt id), seeing the cache's written slots and itself, a sliding layer only the
    slots after S + step - W; no image block (the reference passes token_type_ids to the
    prefill only)."""
    lm = params["lm"]
    B, S = inputs.tokens_BxS.shape
    L = valid_BxL.shape[1]
    slot = S + step
    x = embed(lm, token_B[:, None], c)
    pos = continued_ids(inputs.pos_BxS, step)[:, None]
    seen = jnp.concatenate([valid_BxL, jnp.ones((B, 1), bool)], 1)  # the cache, itself
    index = jnp.concatenate([jnp.arange(L), jnp.full((1,), slot)])
    masks = {"full_attention": seen[:, None, :],
             "sliding_attention": (seen & (index > slot - c.lm_window))[:, None, :]}  # fmt: skip
    angles = {kind: rotary_angles(pos, rotary(c, kind)) for kind in masks}

    def block(w, x, site, i, cache_i, layer):
        return gemma_block(w, x, pick(c, angles, layer), pick(c, masks, layer), site, i, c,
                           cache_i)  # fmt: skip

    x, cache = cached_blocks(lm, x, cache, slot, c.lm_layers, block)  # one scan, as the forward
    logits = unembed(lm, gemma_norm(x, lm["lnf_w"], c.lm_eps)[:, 0]).astype(jnp.float32)
    return logits, cache, valid_BxL.at[:, slot].set(True)


def decoding(config: Gemma3Config) -> Decoding:
    """What `models.generate` needs: the forward (prefill) and Gemma-3's own step
    (`decode_step`), the global layers' rotary for generated tokens
    (`hf_vlm.text_decoding`)."""
    step = functools.partial(decode_step, config)
    return hf_vlm.text_decoding(forward, config, rotary(config, "full_attention"), config.lm_act,
                                step)  # fmt: skip
