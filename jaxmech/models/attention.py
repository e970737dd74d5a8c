"""Explicit-parameter transformer blocks as pure functions of a params dict.

Block params (TransformerLens layout, head axis first):
  W_Q, W_K, W_V [H, D, Dh]   b_Q, b_K, b_V [H, Dh]   W_O [H, Dh, D]   b_O [D]
  optional LayerNorm: ln1_w, ln1_b, ln2_w, ln2_b [D]
  optional MLP:       W_in [D, M], b_in [M], W_out [M, D], b_out [D]

Axis names: B batch, S sequence (keys), Q query rows, D d_model, H heads, Dh d_head.
Attention per head: softmax(mask((x W_Q + b_Q)(x W_K + b_K)^T / sqrt(Dh))) (x W_V + b_V),
then summed over heads through W_O, plus b_O.

`attn_scores` in the intermediates are the scaled logits *before* the causal mask;
the mask is applied only inside the softmax. This keeps every logit term of
`analysis.decompose` defined everywhere and the sums exact.

Rotary positions (RoPE, optional, per call): with angles `theta[s, i] = pos_s * f_i`
(F = Dh / 2 frequency pairs), each head's q and k (biases included) are rotated in the
planes (e_i, e_{i+F}) before the dot product, so the logit of query s and key t depends
on positions only through pos_t - pos_s. A per-head keep-weight scales the angles
(0: that head is not rotated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.models.edits import TERMS, Edits

LN_EPS = 1e-5


def layer_norm(x, w, b):
    """LayerNorm over the last axis with weight w and bias b."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + LN_EPS) * w + b


def ln_parts(x, parts, w, b):
    """LayerNorm of `x = sum(parts)` split into per-part contributions plus the bias.

    With the per-token scale frozen at its value for the full `x`, LayerNorm is linear
    in each part: LN(x) = sum_i w * (part_i - mean(part_i)) / s + b. Exact at this
    input; not a linear function of the inputs in general.
    """
    s = jax.lax.rsqrt(((x - x.mean(-1, keepdims=True)) ** 2).mean(-1, keepdims=True) + LN_EPS)
    return [(p - p.mean(-1, keepdims=True)) * s * w for p in parts], b


def has_ln(block) -> bool:
    return "ln1_w" in block


def has_mlp(block) -> bool:
    return "W_in" in block


def select_rows(a, q_rows, batched=True):
    """Rows `q_rows` of a [B, S, ...] array (or of a shared [S, ...] one) -> [B, Q, ...].

    `q_rows` is a static int (the same single row everywhere, e.g. CLS = 0: a slice) or
    an int array [B, Q] (e.g. each caption's EOT: a one-hot contraction over the short
    sequence for float arrays, whose gradient is a product rather than a scatter-add).
    """
    if isinstance(q_rows, int):
        return a[q_rows : q_rows + 1] if not batched else a[:, q_rows : q_rows + 1]
    if not batched:
        return a[q_rows]
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.einsum("bqs,bs...->bq...", jax.nn.one_hot(q_rows, a.shape[1], dtype=a.dtype), a)
    idx = q_rows.reshape(q_rows.shape + (1,) * (a.ndim - 2))
    return jnp.take_along_axis(a, idx, axis=1)


def rotate(x, angles):
    """Rotates x [..., Dh] by `angles` [..., Dh/2] in the planes (e_i, e_{i + Dh/2})."""
    F = x.shape[-1] // 2
    x1, x2 = x[..., :F], x[..., F:]
    c, s = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def head_angles(angles, rope_keep=None):
    """Position angles [S, F] or [B, S, F] -> per head [..., S, H or 1, F] (x keep[h])."""
    a = angles[..., :, None, :]
    return a if rope_keep is None else a * rope_keep[:, None]


def block_forward(
    block,
    x_BxSxD,
    *,
    causal: bool,
    q_rows_BxQ=None,
    edits: Edits,
    prefix: str,
    suffix: str = "",
    parts=None,
    factored=None,
    term_keep=None,
    vp_keep=None,
    rope_angles=None,
    rope_keep=None,
):
    """One transformer block.

    Args:
      block: block params (module docstring).
      x_BxSxD: residual stream in.
      causal: key j is visible to query i only if j <= i.
      q_rows_BxQ: int positions [B, Q] of the query rows to compute, or a static int
        for one row shared by the batch (None: all S rows). The output then has Q rows:
        the residual stream at those positions only. Exact, since keys and values still
        see every position.
      edits: named interventions, applied at `"{prefix}{point}{suffix}"`.
      prefix, suffix: e.g. `"vision/"` and `".0"` (the layer).
      parts: (E_part, P_part) [B, S, D] summing to x_BxSxD (first layer only), needed
        for `term_keep` / `vp_keep`.
      factored: (tokens_BxS, E_VxD, P_rows [S, D] or [B, S, D] or None) with
        x = E[tokens] + P_rows, for a first block without LayerNorm: Q, K and V are then
        looked up from `E W` and `P W` (V + S rows) instead of projecting B * S rows.
        Same values up to float reassociation; this is the training fast path. P_rows
        None: x = E[tokens] (a rotary tower has no additive positions).
      term_keep: [H, 9] keep-weights on the logit terms (`edits.TERMS`). Not with
        `rope_angles`: the terms are those of unrotated q and k.
      vp_keep: [H] keep-weights on P W_V in the values.
      rope_angles: rotary angles [S, F] or [B, S, F] (F = Dh / 2) of every sequence
        position: q (of the computed rows) and k are rotated by them before the dot
        product (module docstring). None: no rotation.
      rope_keep: [H] keep-weights scaling each head's angles (0: no rotation there).

    Returns:
      (resid_post_BxQxD, intermediates dict keyed `"{prefix}{point}{suffix}"`).
      q, k, v, z are [B, S or Q, H, Dh] (with rope also rot_q, rot_k: after the
      rotation); attn_scores, pattern [B, H, Q, S].
    """
    nm = lambda point: f"{prefix}{point}{suffix}"  # noqa: E731
    aux = {}
    B, S, D = x_BxSxD.shape
    d_head = block["W_Q"].shape[-1]
    scale = d_head**-0.5

    def take_rows(a):
        return a if q_rows_BxQ is None else select_rows(a, q_rows_BxQ)

    if rope_angles is None and rope_keep is not None:
        raise ValueError("rope_keep needs rope_angles: this block has no rotary positions")
    if rope_angles is not None and term_keep is not None:
        raise ValueError(
            "term_keep ablates the E/P terms of unrotated logits; with rotary positions "
            "use rope_keep (or analysis.rope) instead"
        )
    x_in = x_BxSxD
    bias_in = jnp.zeros((D,), x_BxSxD.dtype)
    if has_ln(block):
        if factored is not None:
            raise ValueError("factored projections need a first block without LayerNorm")
        x_in = layer_norm(x_BxSxD, block["ln1_w"], block["ln1_b"])
        if parts is not None:
            parts, bias_in = ln_parts(x_BxSxD, parts, block["ln1_w"], block["ln1_b"])

    def project(W, rows: bool):
        """x W per head, [B, S or Q, H, Dh] (without bias)."""
        if factored is None:
            return jnp.einsum("bsd,hde->bshe", take_rows(x_in) if rows else x_in, W)
        tokens, E, P_rows = factored
        t = take_rows(tokens) if rows else tokens
        e = jnp.einsum("vd,hde->vhe", E, W)[t]
        if P_rows is None:
            return e
        p = (
            select_rows(P_rows, q_rows_BxQ, batched=P_rows.ndim == 3)
            if rows and q_rows_BxQ is not None
            else P_rows
        )
        return e + jnp.einsum("...sd,hde->...she", p, W)

    q = edits(nm("q"), project(block["W_Q"], True) + block["b_Q"])
    k = edits(nm("k"), project(block["W_K"], False) + block["b_K"])
    if rope_angles is not None:
        ang_k = head_angles(rope_angles, rope_keep)
        ang_q = ang_k
        if q_rows_BxQ is not None:
            ang_q = head_angles(
                select_rows(rope_angles, q_rows_BxQ, batched=rope_angles.ndim == 3), rope_keep
            )
        aux[nm("q")], aux[nm("k")] = q, k
        q = edits(nm("rot_q"), rotate(q, ang_q))
        k = edits(nm("rot_k"), rotate(k, ang_k))
        aux[nm("rot_q")], aux[nm("rot_k")] = q, k
    v = project(block["W_V"], False) + block["b_V"]
    if vp_keep is not None:
        v = v - (1.0 - vp_keep)[:, None] * jnp.einsum("bsd,hde->bshe", parts[1], block["W_V"])
    v = edits(nm("v"), v)
    scores = jnp.einsum("bqhe,bshe->bhqs", q, k) * scale
    if term_keep is not None:
        # Subtract the removed terms from the logits computed anyway: an all-ones mask
        # subtracts exact zeros, so it is bit-identical to the plain forward.
        parts_q = parts if q_rows_BxQ is None else [take_rows(p) for p in parts]
        scores = scores - _removed_logits(block, parts, parts_q, bias_in, term_keep)
    scores = edits(nm("attn_scores"), scores)
    if causal:
        if q_rows_BxQ is None:
            q_pos = jnp.broadcast_to(jnp.arange(S)[None], (B, S))
        elif isinstance(q_rows_BxQ, int):
            q_pos = jnp.full((B, 1), q_rows_BxQ)
        else:
            q_pos = q_rows_BxQ
        visible = jnp.arange(S)[None, None, None, :] <= q_pos[:, None, :, None]
        masked = jnp.where(visible, scores, -jnp.inf)
    else:
        masked = scores
    pattern = edits(nm("pattern"), jax.nn.softmax(masked, axis=-1))
    z = edits(nm("z"), jnp.einsum("bhqs,bshe->bqhe", pattern, v))
    attn_out = edits(nm("attn_out"), jnp.einsum("bqhe,hed->bqd", z, block["W_O"]) + block["b_O"])
    resid_mid = edits(nm("resid_mid"), take_rows(x_BxSxD) + attn_out)
    if rope_angles is None:
        aux[nm("q")], aux[nm("k")] = q, k
    aux.update(
        {
            nm("v"): v,
            nm("attn_scores"): scores,
            nm("pattern"): pattern,
            nm("z"): z,
            nm("attn_out"): attn_out,
            nm("resid_mid"): resid_mid,
        }
    )
    resid_post = resid_mid
    if has_mlp(block):
        h = layer_norm(resid_mid, block["ln2_w"], block["ln2_b"]) if has_ln(block) else resid_mid
        mlp_out = jax.nn.gelu(h @ block["W_in"] + block["b_in"]) @ block["W_out"] + block["b_out"]
        mlp_out = edits(nm("mlp_out"), mlp_out)
        aux[nm("mlp_out")] = mlp_out
        resid_post = resid_mid + mlp_out
    resid_post = edits(nm("resid_post"), resid_post)
    aux[nm("resid_post")] = resid_post
    return resid_post, aux


def _head_logit_terms(W_Q, b_Q, W_K, b_K, parts_q, parts_k, bias_in, names):
    """One head's logit terms (unscaled): query part a x key part b, each [B, Q, S].

    W_Q, W_K [D, Dh]; b_Q, b_K [Dh]; parts_q [B, Q, D] and parts_k [B, S, D] per named
    part; bias_in [D] is added to every input row (LayerNorm's bias), so it joins the
    bias part B: q_B = b_Q + bias_in W_Q.
    """
    B, Q = parts_q[0].shape[:2]
    S = parts_k[0].shape[1]
    qs = [p @ W_Q for p in parts_q] + [jnp.broadcast_to(b_Q + bias_in @ W_Q, (B, Q, W_Q.shape[1]))]
    ks = [p @ W_K for p in parts_k] + [jnp.broadcast_to(b_K + bias_in @ W_K, (B, S, W_K.shape[1]))]
    return {
        qa_name + kb_name: jnp.einsum("bqe,bse->bqs", qa, kb)
        for qa_name, qa in zip(names, qs)
        for kb_name, kb in zip(names, ks)
    }


def logit_terms(block, parts_q, parts_k, bias_in, names=("E", "P")):
    """Every term of a block's pre-softmax logits, scaled by 1/sqrt(Dh).

    Args:
      block: block params (head axis first).
      parts_q: named parts of the query rows' input, each [B, Q, D] (after the
        LayerNorm split of `ln_parts` when the block has one).
      parts_k: the same parts for every key row, each [B, S, D].
      bias_in: [D] added to every input row (LayerNorm bias; zeros without LN).
      names: the parts' one-letter names; "B" (biases) is appended.

    Returns:
      dict "AB" -> [B, H, Q, S] for every query part A and key part B (e.g. "EP" =
      E W_QK P^T). They sum to the logits of `block_forward` up to float rounding.
    """
    names = tuple(names) + ("B",)
    per_head = jax.vmap(
        lambda wq, bq, wk, bk: _head_logit_terms(wq, bq, wk, bk, parts_q, parts_k, bias_in, names),
        out_axes=1,
    )
    terms = per_head(block["W_Q"], block["b_Q"], block["W_K"], block["b_K"])
    scale = block["W_Q"].shape[-1] ** -0.5
    return {k: v * scale for k, v in terms.items()}


def _removed_logits(block, parts_k, parts_q, bias_in, term_keep):
    """sum_t (1 - keep_t) * term_t over the nine E/P/B terms (scaled); [B, H, Q, S]."""
    terms = logit_terms(block, parts_q, parts_k, bias_in)
    drop = 1.0 - term_keep  # [H, 9]
    return sum(drop[None, :, i, None, None] * terms[t] for i, t in enumerate(TERMS))
