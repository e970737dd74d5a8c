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
from jaxmech.families.qwen2_vl.checks import (
    RESUME_SITES,
    check_edits,
    check_inputs,
    check_resume,
)
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.models.attention import layer_norm as attention_layer_norm
from jaxmech.models.attention import rotate
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.models.order import low_precision, tie


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


class _Sites:
    """Applies the edits at each named site and keeps what `capture` asks for: True
    (every site), False (none) or names (a full name like "lm/resid_pre.3", or a name
    without its block like "lm/resid_pre" for every block)."""

    def __init__(self, edits: Edits, capture):
        self.edits, self.capture, self.aux = edits, capture, {}

    def __call__(self, name: str, x):
        x = self.edits(name, x)
        if self.capture is True or (
            self.capture and (name in self.capture or name.split(".")[0] in self.capture)
        ):
            self.aux[name] = x
        return x


def rms_norm(x, w, eps):
    """Qwen2's RMSNorm: float32 statistics, then the weight in the input's dtype."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
    return w * h.astype(x.dtype)


def layer_norm(x, w, b, eps):
    """LayerNorm (`models.attention`) in float32, back in the input's dtype."""
    return attention_layer_norm(x.astype(jnp.float32), w, b, eps).astype(x.dtype)


def _norm(block, prefix, x, eps):
    if f"{prefix}_b" in block:
        return layer_norm(x, block[f"{prefix}_w"], block[f"{prefix}_b"], eps)
    return rms_norm(x, block[f"{prefix}_w"], eps)


ACT = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def _rot(x, angles):
    """x [B, N, H, Dh] rotated by angles [B, N, R] in float32 (rotate-half layout)."""
    return rotate(x.astype(jnp.float32), angles[:, :, None, :]).astype(x.dtype)


def attention(block, x_in, angles, mask_BxNxN, site, part: str, i: int, cache=None, q_last=False):
    """One attention sublayer: [B, N, D] -> [B, N, D] (grouped-query where W_K has fewer
    heads than W_Q; bias b_O if the block has one). `cache`: (rotated keys, values) of
    the positions before these N rows, which the rows also attend to (`Resume`).
    `q_last`: only the last row queries ([B, 1, D] out)."""

    def at(point, x):
        return site(f"{part}/{point}.{i}", x)

    def proj(w, x):
        return jnp.einsum("bnd,hde->bnhe", x, block[f"W_{w}"]) + block[f"b_{w}"]

    q_in, q_angles = (x_in[:, -1:], angles[:, -1:]) if q_last else (x_in, angles)
    mask_BxNxN = mask_BxNxN[:, -1:] if q_last else mask_BxNxN
    q, k, v = at("q", proj("Q", q_in)), at("k", proj("K", x_in)), at("v", proj("V", x_in))
    q, k = at("rot_q", _rot(q, q_angles)), at("rot_k", _rot(k, angles))
    if cache is not None:
        k, v = (jnp.concatenate([c.astype(x.dtype), x], axis=1) for c, x in zip(cache, (k, v)))
    # grouped-query attention without copying k, v per query head: head h = c G + g
    # reads key / value head c (as the reference's repeat_kv)
    B, N, H, E = q.shape
    C = k.shape[2]
    qg = q.reshape(B, N, C, H // C, E)
    scores = jnp.einsum("bqcge,bkce->bcgqk", qg, k).reshape(B, H, N, k.shape[1])
    scores = at("attn_scores", scores * E**-0.5)
    logits = jnp.where(mask_BxNxN[:, None], scores.astype(jnp.float32), -jnp.inf)
    pattern = at("pattern", jax.nn.softmax(logits, -1).astype(v.dtype))
    pg = pattern.reshape(B, C, H // C, N, k.shape[1])
    z = at("z", jnp.einsum("bcgqk,bkce->bqcge", pg, v).reshape(B, N, H, E))
    out = jnp.einsum("bqhe,hed->bqd", z, block["W_O"])
    return out + block["b_O"] if "b_O" in block else out


def mlp(block, x, act):
    """The MLP: W_out(act(x W_gate) * x W_in) when gated, else W_out(act(x W_in)); biases
    where the block has them."""

    def lin(w, b):
        y = x @ block[w]
        return y + block[b] if b in block else y

    h = (
        act(lin("W_gate", "b_gate")) * lin("W_in", "b_in")
        if "W_gate" in block
        else act(lin("W_in", "b_in"))
    )
    y = h @ block["W_out"]
    return y + block["b_out"] if "b_out" in block else y


def after(x, weights):
    """(x, weights), low-precision `weights` computed after `x` (`models.order.tie`):
    XLA's CPU backend would otherwise convert every block's weights to float32 at the
    start and hold them all (5.5 GB of scratch at Qwen2-VL-2B's size); tied, each
    block's copy is made when the block runs. Float32 weights pass untouched."""
    return (x, tie(weights, x)) if low_precision(weights) else (x, weights)


def block_forward(
    block, x, angles, mask, site, part: str, i: int, eps, act, cache=None, q_last=False
):
    """One pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)); `q_last`: for the
    last row only ([B, 1, D] out; keys and values from every row)."""
    x, block = after(site(f"{part}/resid_pre.{i}", x), block)
    attn = attention(block, _norm(block, "ln1", x, eps), angles, mask, site, part, i, cache, q_last)
    x = x[:, -1:] if q_last else x
    x = site(f"{part}/resid_mid.{i}", x + site(f"{part}/attn_out.{i}", attn))
    out = site(f"{part}/mlp_out.{i}", mlp(block, _norm(block, "ln2", x, eps), act))
    return site(f"{part}/resid_post.{i}", x + out)


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
    h = _norm(m, "ln", x, 1e-6)
    h = h.reshape(h.shape[0], h.shape[1] // c.merge_size**2, c.merge_width)
    h = ACT["gelu"](h @ m["W1"] + m["b1"])
    return h @ m["W2"] + m["b2"]


def place_images(emb_BxSxD, feats_BxIxD, image_BxI):
    """The LM's input: token embeddings with the image features at their positions."""
    b = jnp.arange(emb_BxSxD.shape[0])[:, None]
    return emb_BxSxD.at[b, image_BxI].set(feats_BxIxD.astype(emb_BxSxD.dtype))


def _lm_pos(inputs: Inputs, edits: Edits):
    if edits.lm_pos_ids is None:
        return inputs.pos_Bx3xS
    e = jnp.asarray(edits.lm_pos_ids)
    e = jnp.broadcast_to(e, (3,) + e.shape) if e.ndim == 1 else e
    return jnp.broadcast_to(e, inputs.pos_Bx3xS.shape)


def lm_mask(valid_BxS):
    """[B, S, S] causal attention to the valid tokens (and each token to itself, so a
    padding row stays finite)."""
    S = valid_BxS.shape[1]
    causal = jnp.tril(jnp.ones((S, S), bool))
    return causal & (valid_BxS[:, None, :] | jnp.eye(S, dtype=bool))


class Resume(NamedTuple):
    """Run the LM from block `layer` on the rows from `start` on only, with the rows
    before them read from a run that is the same there (incremental decoding's cache):

    x_BxTxD: the residual entering block `layer` at rows start..S-1 (T = S - start).
    aux: a run's intermediates holding `lm/rot_k.{i}` and `lm/v.{i}` of every block i >=
      layer (`RESUME_SITES`); their rows before `start` serve as those rows' keys and
      values. Right when the run and this one agree on every row before `start`: a
      causal LM's rows there do not see the rows changed.

    `layer` and `start` are Python ints (static). The ViT and the blocks before `layer`
    are not run; the sites of the resumed blocks hold the T rows only."""

    layer: int
    start: int
    x_BxTxD: Any
    aux: dict


def language_model(lm, x, pos_Bx3xS, valid_BxS, c: QwenVLConfig, site, resume=None, last_row=False):
    """[B, S, D] the final-normed residual stream ([B, T, D] rows start.. when resumed;
    [B, 1, D] the last row with `last_row`: the last block's other rows are not run)."""
    freq = positions.inv_freq(c.lm_head_dim, c.lm_rope_theta)
    angles = positions.lm_angles(pos_Bx3xS, freq, c.lm_mrope_section)
    causal = lm_mask(jnp.asarray(valid_BxS, bool))
    first, s0 = (0, 0) if resume is None else (resume.layer, resume.start)
    angles, causal = angles[:, s0:], causal[:, s0:]
    for i in range(first, c.lm_layers):
        cache = None
        if resume is not None and s0:
            cache = tuple(resume.aux[f"{n}.{i}"][:, :s0] for n in RESUME_SITES)
        q_last = last_row and i == c.lm_layers - 1
        x = block_forward(lm[f"block_{i}"], x, angles, causal, site, "lm", i, c.lm_eps,
                          ACT["silu"], cache, q_last)  # fmt: skip
    return site("lm/final", rms_norm(x, lm["lnf_w"], c.lm_eps))


def unembed(lm, x):
    """Logits of the rows `x` [..., D]: x W_U, or x E^T for tied embeddings. Not tied to
    `x` (`after`): a table's runs share one float32 copy of the unembedding, 0.9 GB at
    Qwen2-VL-2B's size, where tied ones would each make their own."""
    if "W_U" in lm:
        return x @ lm["W_U"]
    return jnp.einsum("...d,vd->...v", x, lm["E"])


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
    site = _Sites(edits, capture)
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
    return vision(params, inputs, config, NO_EDITS, _Sites(NO_EDITS, False))
