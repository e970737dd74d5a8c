"""Explicit-parameter transformer blocks as pure functions of a params dict.

Block params (TransformerLens layout, head axis first; axis letters: `jaxmech.shapes`):
  W_Q, W_K, W_V [H, D, Dh]   b_Q, b_K, b_V [H, Dh]   W_O [H, Dh, D]   b_O [D]
  optional LayerNorm: ln1_w, ln1_b, ln2_w, ln2_b [D]
  optional MLP:       W_in [D, M], b_in [M], W_out [M, D], b_out [D]

Attention per head: softmax(mask((x W_Q + b_Q)(x W_K + b_K)^T / sqrt(Dh))) (x W_V + b_V),
then summed over heads through W_O, plus b_O. `block_forward` runs it in named steps:
the block's input (LayerNorm, and its split into parts), q / k / v (`project`, with the
factored first-layer fast path), the rotation (`rotate_qk`), the logits with term edits
(`attention_scores`), the causal mask and softmax (`attend`), and the MLP (`mlp`).

`attn_scores` in the intermediates are the scaled logits *before* the causal mask;
the mask is applied only inside the softmax. This keeps every logit term of
`analysis.decompose` defined everywhere and the sums exact.

Query rows: a block computes every row (`q_rows_BxQ=None`) or the rows `q_rows_BxQ`
([B, Q] int, e.g. each sequence's readout row); keys and values always see every row.

Rotary positions (RoPE, optional, per call): with angles `theta[s, i] = pos_s * f_i`
(R = Dh / 2 frequency pairs), each head's q and k (biases included) are rotated in the
planes (e_i, e_{i+R}) before the dot product, so the logit of query s and key t depends
on positions only through pos_t - pos_s. A per-head keep-weight scales the angles
(0: that head is not rotated).

Query / key argument order: every function taking both takes the query side first.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.models.edits import NO_EDITS, TERMS, Edits

LN_EPS = 1e-5


class FirstBlock(NamedTuple):
    """What the first block of a tower knows about its input x = E[tokens] + p_rows.

    tokens_BxS: int token ids; E_VxD: the token embedding; p_rows: position rows
    [S, D] or [B, S, D] (None in a rotary tower); e_part, p_part [B, S, D]: the token and
    position parts of x; factored: look q / k / v up from `E W` and `P W` (V + S rows)
    instead of projecting B * S rows (the training fast path; needs a block without
    LayerNorm and an unedited input; same values up to float reassociation);
    term_keep [H, 9] / vp_keep [H]: the term edits (`models.edits`), or None.
    extra_parts / term_names: a first block whose input has more named parts than E and
    P (the ViT of `families.toy_vlm.model`: content, row, column) lists them all in
    `extra_parts` (sum = x) with one-letter `term_names`; term_keep is then
    [H, (len(names) + 1)^2] in `term_order(term_names)`. None / ("E", "P"): the two
    parts e_part, p_part.
    """

    tokens_BxS: Any
    E_VxD: Any
    p_rows: Any
    e_part: Any
    p_part: Any
    factored: bool = False
    term_keep: Any = None
    vp_keep: Any = None
    extra_parts: Any = None
    term_names: tuple = ("E", "P")

    def parts(self):
        """The named input parts of the block (they sum to its input x)."""
        if self.extra_parts is not None:
            return list(self.extra_parts)
        return [self.e_part, self.p_part]


# Every attention block's parameters (layer norms and the MLP are optional).
BLOCK_KEYS = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "b_O")


def n_blocks(part) -> int:
    """The blocks of one model part (a params subtree with `block_0 .. block_{n-1}`, or
    stacked under `blocks`, `models.layout.BLOCKS`): every family's block count."""
    if "blocks" in part:
        return int(next(iter(part["blocks"].values())).shape[0])  # a leaf or its Rows
    return sum(1 for k in part if k.startswith("block_"))


def term_order(names=("E", "P")) -> tuple[str, ...]:
    """Query part x key part names, row-major over `names + ("B",)`; ("E", "P") gives
    `models.edits.TERMS`."""
    full = tuple(names) + ("B",)
    return tuple(a + b for a in full for b in full)


class Rotary(NamedTuple):
    """Rotary positions of a block: angles [S, R] or [B, S, R]; keep [H] or None."""

    angles: Any
    keep: Any = None


def _normalize_parts(x, eps: float):
    """(x - mean) * r and r = 1 / sqrt(var + eps), over the last axis."""
    centred = x - x.mean(-1, keepdims=True)
    r = jax.lax.rsqrt((centred**2).mean(-1, keepdims=True) + eps)
    return centred * r, r


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def normalize(x, eps: float = LN_EPS):
    """(x - mean) / sqrt(var + eps) over the last axis: LayerNorm without w and b.

    Its backward is written out, r * (g - mean(g) - y * mean(g * y)): autodiff's
    version of the same gradient has more ops (86 against 66 in StableHLO), which XLA's
    CPU backend fused into a slow layout copy; one toy VLM's gradient step is 1.2-1.3x
    faster with this one (BUILD_NOTES.md, Speed). Reverse mode only (grad, vjp,
    jacrev); forward mode (jvp, jacfwd) through it raises.
    """
    return _normalize_parts(x, eps)[0]


def _normalize_fwd(x, eps):
    y, r = _normalize_parts(x, eps)
    return y, (y, r)


def _normalize_bwd(eps, saved, g):
    del eps
    y, r = saved
    return (r * (g - g.mean(-1, keepdims=True) - y * (g * y).mean(-1, keepdims=True)),)


normalize.defvjp(_normalize_fwd, _normalize_bwd)


def layer_norm(x, w, b, eps: float = LN_EPS):
    """LayerNorm over the last axis with weight w and bias b."""
    return normalize(x, eps) * w + b


def rows_matmul(x, W_IxO):
    """x [..., I] @ W [I, O] with x's leading axes flattened into one row axis first.

    The same product as `x @ W`; flat, the weight's gradient is one plain [I, N] x
    [N, O] contraction, which XLA's CPU backend runs faster than the one over
    several row axes that `x @ W` gives (BUILD_NOTES.md, Speed).
    """
    return (x.reshape(-1, x.shape[-1]) @ W_IxO).reshape(x.shape[:-1] + W_IxO.shape[-1:])


def rotary_angles(ids_AxS, freqs_R, axis_R):
    """Angles [S, R]: pair i turns by `ids[axis[i], s] * freqs[i]` (ids float [A, S]):
    one id per token (A = 1), or several, e.g. (t, row, col), each turning its pairs."""
    picked = jnp.take(ids_AxS, axis_R.astype(jnp.int32), axis=0)  # [R, S]
    return picked.T * freqs_R


def ln_parts(x, parts, w, b):
    """LayerNorm of `x = sum(parts)` split into per-part contributions plus the bias.

    With the per-token scale frozen at its value for the full `x`, LayerNorm is linear
    in each part: LN(x) = sum_i w * (part_i - mean(part_i)) / s + b. Exact at this
    input; not a linear function of the inputs in general.
    """
    s = _normalize_parts(x, LN_EPS)[1]  # the same scale as `layer_norm`'s
    return [(p - p.mean(-1, keepdims=True)) * s * w for p in parts], b


def has_ln(block) -> bool:
    return "ln1_w" in block


def has_mlp(block) -> bool:
    return "W_in" in block


def select_rows(a, q_rows_BxQ, batched=True):
    """Rows `q_rows_BxQ` ([B, Q] int) of a [B, S, ...] array (or a shared [S, ...] one).

    Float arrays use a one-hot contraction over the short sequence (its gradient is a
    product rather than a scatter-add); int arrays a gather. Returns [B, Q, ...].
    """
    if not batched:
        return a[q_rows_BxQ]
    if jnp.issubdtype(a.dtype, jnp.floating):
        one_hot = jax.nn.one_hot(q_rows_BxQ, a.shape[1], dtype=a.dtype)
        return jnp.einsum("bqs,bs...->bq...", one_hot, a)
    idx = q_rows_BxQ.reshape(q_rows_BxQ.shape + (1,) * (a.ndim - 2))
    return jnp.take_along_axis(a, idx, axis=1)


def rotate(x, angles):
    """Rotates x [..., Dh] by `angles` [..., R] (R = Dh / 2) in the planes (e_i, e_{i+R})."""
    R = x.shape[-1] // 2
    x1, x2 = x[..., :R], x[..., R:]
    c, s = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def head_angles(angles, rope_keep=None):
    """Position angles [S, R] or [B, S, R] -> per head [..., S, H or 1, R] (x keep[h])."""
    a = angles[..., :, None, :]
    return a if rope_keep is None else a * rope_keep[:, None]


def _check_block_args(block, first, rotary):
    if rotary is not None and first is not None and first.term_keep is not None:
        raise ValueError(
            "term_keep ablates the E/P terms of unrotated logits; with rotary positions "
            "use rope_keep (or analysis.rope) instead"
        )
    if first is not None and first.factored and has_ln(block):
        raise ValueError("factored projections need a first block without LayerNorm")


def block_input(block, x_BxSxD, parts):
    """The block's attention input: (x_in, parts, bias_in).

    x_in is LN(x) with LayerNorm, else x; `parts` (or None) split x_in by input part
    (`ln_parts` with LayerNorm: then bias_in is LN's bias, else zeros [D]).
    """
    x_in = x_BxSxD
    bias_in = jnp.zeros((x_BxSxD.shape[-1],), x_BxSxD.dtype)
    if has_ln(block):
        x_in = layer_norm(x_BxSxD, block["ln1_w"], block["ln1_b"])
        if parts is not None:
            parts, bias_in = ln_parts(x_BxSxD, parts, block["ln1_w"], block["ln1_b"])
    return x_in, parts, bias_in


def project(W_HxDxDh, x_in, q_rows_BxQ=None, first=None):
    """x W per head without bias, [B, S or Q, H, Dh] (rows `q_rows_BxQ` when given).

    With `first.factored`, x = E[tokens] + p_rows is never formed: the projection is
    looked up from `E W` and `P W`.
    """

    def rows(a):
        return a if q_rows_BxQ is None else select_rows(a, q_rows_BxQ)

    if first is None or not first.factored:
        return jnp.einsum("bsd,hde->bshe", rows(x_in), W_HxDxDh)
    e = jnp.einsum("vd,hde->vhe", first.E_VxD, W_HxDxDh)[rows(first.tokens_BxS)]
    P_rows = first.p_rows
    if P_rows is None:
        return e
    if q_rows_BxQ is not None:
        P_rows = select_rows(P_rows, q_rows_BxQ, batched=P_rows.ndim == 3)
    return e + jnp.einsum("...sd,hde->...she", P_rows, W_HxDxDh)


def rotate_qk(q, k, rotary, q_rows_BxQ, edits, nm, aux):
    """q and k rotated by the rotary angles (edit points rot_q, rot_k); logs q, k too."""
    ang_k = head_angles(rotary.angles, rotary.keep)
    ang_q = ang_k
    if q_rows_BxQ is not None:
        batched = rotary.angles.ndim == 3
        ang_q = head_angles(select_rows(rotary.angles, q_rows_BxQ, batched), rotary.keep)
    aux[nm("q")], aux[nm("k")] = q, k
    q = edits(nm("rot_q"), rotate(q, ang_q))
    k = edits(nm("rot_k"), rotate(k, ang_k))
    aux[nm("rot_q")], aux[nm("rot_k")] = q, k
    return q, k


def values(block, x_in, parts, first):
    """x W_V + b_V per head, [B, S, H, Dh], minus the removed share of P W_V (vp_keep)."""
    v = project(block["W_V"], x_in, None, first) + block["b_V"]
    if first is not None and first.vp_keep is not None:
        pv = jnp.einsum("bsd,hde->bshe", parts[1], block["W_V"])
        v = v - (1.0 - first.vp_keep)[:, None] * pv
    return v


def attention_scores(block, q, k, parts, bias_in, q_rows_BxQ, first):
    """Scaled logits [B, H, Q, S], with the removed logit terms (term_keep) subtracted."""
    scale = block["W_Q"].shape[-1] ** -0.5
    scores = jnp.einsum("bqhe,bshe->bhqs", q, k) * scale
    if first is not None and first.term_keep is not None:
        # Subtract the removed terms from the logits computed anyway: an all-ones mask
        # subtracts exact zeros, so it gives the plain forward's values.
        parts_q = parts if q_rows_BxQ is None else [select_rows(p, q_rows_BxQ) for p in parts]
        scores = scores - _removed_logits(
            block, parts_q, parts, bias_in, first.term_keep, first.term_names
        )
    return scores


def window_mask(scores_BxHxQxS, visible):
    """Logits with the keys `visible` marks False set to -inf (None: unchanged).

    `visible`: bool, broadcastable to [B, H, Q, S] (e.g. [Q, S] for a window block);
    an all-True mask returns the logits unchanged bit for bit.
    """
    if visible is None:
        return scores_BxHxQxS
    return jnp.where(visible, scores_BxHxQxS, -jnp.inf)


def causal_mask(scores_BxHxQxS, causal, q_rows_BxQ=None):
    """Logits with keys after each query set to -inf (those the softmax must not see).

    `causal`: a Python bool (static), or a scalar array flag (0: no mask, else causal;
    traced values work, e.g. `params["static"]["causal_text"]`).
    """
    if isinstance(causal, (bool, np.bool_)) and not causal:
        return scores_BxHxQxS
    B, _, _, S = scores_BxHxQxS.shape
    if q_rows_BxQ is None:
        q_pos = jnp.broadcast_to(jnp.arange(S)[None], (B, S))
    else:
        q_pos = q_rows_BxQ
    visible = jnp.arange(S)[None, None, None, :] <= q_pos[:, None, :, None]
    if not isinstance(causal, (bool, np.bool_)):
        visible = visible | (causal == 0)
    return jnp.where(visible, scores_BxHxQxS, -jnp.inf)


def mlp(block, resid_mid_BxQxD):
    """The block's MLP output [B, Q, D] (reads LN(resid_mid) with LayerNorm), through
    the tanh approximation of GELU (GPT-2's and JAX's default; within ~1e-3 of the exact
    erf GELU, which a real checkpoint's `hidden_act` may ask for instead)."""
    h = resid_mid_BxQxD
    if has_ln(block):
        h = layer_norm(resid_mid_BxQxD, block["ln2_w"], block["ln2_b"])
    pre = rows_matmul(h, block["W_in"]) + block["b_in"]
    return rows_matmul(jax.nn.gelu(pre, approximate=True), block["W_out"]) + block["b_out"]


def block_forward(
    block,
    x_BxSxD,
    *,
    causal,
    q_rows_BxQ=None,
    edits: Edits = NO_EDITS,
    prefix: str = "",
    suffix: str = "",
    first: FirstBlock | None = None,
    rotary: Rotary | None = None,
    visible=None,
):
    """One transformer block.

    Args:
      block: block params (module docstring).
      x_BxSxD: residual stream in.
      causal: key j is visible to query i only if j <= i (bool, or a scalar flag
        array: `causal_mask`).
      q_rows_BxQ: int positions [B, Q] of the query rows to compute (None: all S
        rows). The output then has Q rows: the residual stream at those positions
        only. Exact, since keys and values still see every position.
      edits: named interventions, applied at `"{prefix}{point}{suffix}"`.
      prefix, suffix: e.g. `"vision/"` and `".0"` (the layer).
      first: the first block's input parts, fast path and term edits (`FirstBlock`);
        None for later blocks.
      rotary: rotary angles of every sequence position and per-head keep-weights
        (`Rotary`); q (of the computed rows) and k are rotated before the dot product.
        None: no rotation.
      visible: optional bool mask broadcastable to [B, H, Q, S] (keys each query may
        see, e.g. a window block's [Q, S]); applied with the causal mask inside the
        softmax only, like it. None: no extra mask.

    Returns:
      (resid_post_BxQxD, intermediates dict keyed `"{prefix}{point}{suffix}"`).
      q, k, v, z are [B, S or Q, H, Dh] (with rope also rot_q, rot_k: after the
      rotation); attn_scores, pattern [B, H, Q, S].
    """
    nm = lambda point: f"{prefix}{point}{suffix}"  # noqa: E731
    _check_block_args(block, first, rotary)
    aux = {}
    parts = None if first is None else first.parts()
    x_in, parts, bias_in = block_input(block, x_BxSxD, parts)
    q = edits(nm("q"), project(block["W_Q"], x_in, q_rows_BxQ, first) + block["b_Q"])
    k = edits(nm("k"), project(block["W_K"], x_in, None, first) + block["b_K"])
    if rotary is not None:
        q, k = rotate_qk(q, k, rotary, q_rows_BxQ, edits, nm, aux)
    v = edits(nm("v"), values(block, x_in, parts, first))
    scores = attention_scores(block, q, k, parts, bias_in, q_rows_BxQ, first)
    scores = edits(nm("attn_scores"), scores)
    masked = window_mask(causal_mask(scores, causal, q_rows_BxQ), visible)
    pattern = edits(nm("pattern"), jax.nn.softmax(masked, axis=-1))
    z = edits(nm("z"), jnp.einsum("bhqs,bshe->bqhe", pattern, v))
    attn_out = edits(nm("attn_out"), jnp.einsum("bqhe,hed->bqd", z, block["W_O"]) + block["b_O"])
    x_rows = x_BxSxD if q_rows_BxQ is None else select_rows(x_BxSxD, q_rows_BxQ)
    resid_mid = edits(nm("resid_mid"), x_rows + attn_out)
    if rotary is None:
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
        mlp_out = edits(nm("mlp_out"), mlp(block, resid_mid))
        aux[nm("mlp_out")] = mlp_out
        resid_post = resid_mid + mlp_out
    resid_post = edits(nm("resid_post"), resid_post)
    aux[nm("resid_post")] = resid_post
    return resid_post, aux


def _head_logit_terms(W_Q, b_Q, W_K, b_K, parts_q, parts_k, bias_in, names):
    """One head's logit terms (unscaled): query part a x key part b, each [B, Q, S].

    W_Q, W_K [D, Dh]; b_Q, b_K [Dh]; parts_q [B, Q, D] and parts_k [B, S, D] per named
    part; bias_in [D] is added to every input row (LayerNorm's bias), so it joins the
    bias part "B": q_B = b_Q + bias_in W_Q.
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


def _removed_logits(block, parts_q, parts_k, bias_in, term_keep_HxT, names=("E", "P")):
    """sum_t (1 - keep_t) * term_t over the terms of `term_order(names)` (nine E/P/B terms
    by default; scaled); [B, H, Q, S]."""
    terms = logit_terms(block, parts_q, parts_k, bias_in, names)
    drop = 1.0 - term_keep_HxT
    order = TERMS if tuple(names) == ("E", "P") else term_order(names)
    return sum(drop[None, :, i, None, None] * terms[t] for i, t in enumerate(order))
