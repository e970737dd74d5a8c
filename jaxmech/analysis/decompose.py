"""Attention-logit decomposition (paper 000; SPEC.md "Attention-logit decomposition").

`decompose(params, x)` splits a block's pre-softmax logits, per head, into the terms
of its input's parts. For the first layer the input is `X = E + P` (token rows plus
position rows; the CLS row of P is zero unless `cls_position`), and with the biases:

    QK^T / sqrt(Dh) = EE + EP + PE + PP + EB + PB + BE + BP + BB

where `AB = (A W_Q)(B W_K)^T / sqrt(Dh)` for input parts A, B and `B` on the query
(key) side is `b_Q` (`b_K`). `EB`, `PB`, `BB` are constant along each row, so the
softmax ignores them. Grouped the paper's way (weight-bias split):

    XX = X W_QK X^T = EE + EP + PE + PP,  XB = EB + PB,  BX = BE + BP,  BB.

`QP` = EP + PP + BP is the query x key-position part: the whole query vector against
the keys' position rows. Unlike EP alone it does not depend on how the CLS query is
split between E and P (with `cls_position` the CLS token's E and P_0 rows are only
identified as a sum), so it is the parametrisation-independent position signal.

Deeper layers (`layer > 0`): the input is `E + P + R` with R the residual written by
earlier layers, and the terms include R (`ER`, `RP`, `RR`, `RB`, ...; 16 in all).

LayerNorm (`layernorm=True`): the block reads LN(x). With the per-token scale frozen at
its actual value, LN is linear in the parts: LN(x) = sum_A w (A - mean A) / s + b_ln.
The terms are of these centred, scaled parts, and the LN bias b_ln joins the B terms
(q_B = b_Q + b_ln W_Q). They still sum exactly to the logits at this input, but they
are not linear functions of E and P (the scale s depends on the whole token), so an
ablation of one term is a local, first-order statement.

Masks: for a causal tower, `visible` marks the logits the softmax sees; terms are
defined (and sum to the logits) everywhere, masked or not.

Axis names: B batch, H heads, Q query rows (= S here), S keys.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.models.attention import has_ln, ln_parts, logit_terms
from jaxmech.models.dual_encoder import (
    encode,
    eot_index,
    is_rotary,
    n_blocks,
    text_inputs,
    vision_inputs,
)


def _run(params, x, tower: str, positions, causal_text: bool):
    """The tower's full forward (every query row) -> (tower params, intermediates)."""
    p = params[tower]
    if tower == "vision":
        if is_rotary(p):
            raise ValueError(
                "the vision tower uses rotary positions (vision_pos = 'rope'): it has no P, "
                "so the E/P term decomposition does not apply; use jaxmech.analysis.rope"
            )
        tokens, rows = vision_inputs(p, x, positions)
        idx = jnp.zeros((x.shape[0],), jnp.int32)
        causal = False
    elif tower == "text":
        tokens, rows = text_inputs(p, x, positions)
        idx = eot_index(p, x)
        causal = causal_text
    else:
        raise ValueError(f"tower = {tower!r}: expected 'vision' or 'text'")
    _, aux = encode(p, tokens, rows, idx, name=tower, causal=causal, readout_only=False)
    return p, aux, causal, idx


def decompose(
    params,
    x,
    *,
    tower: str = "vision",
    layer: int = 0,
    positions=None,
    causal_text: bool = True,
):
    """Every named term of one block's pre-softmax attention logits.

    Args:
      params: one model's params (vmap over a leading model axis for stacked seeds).
      x: int images [B, L] (vision) or caption tokens [B, T] (text).
      tower: "vision" or "text".
      layer: which block (0 = the first).
      positions: position ids as for `forward` (default: natural order).
      causal_text: the text tower's mask (as trained).

    Returns:
      dict of [B, H, S, S] arrays (rows are queries, columns keys): the part x part
      terms ("EE", "EP", ..., "BB"; with "R" terms for layer > 0), the groups "XX",
      "XB", "BX", "BB" and "QP", "logits" (the forward's own scaled logits, which the
      terms sum to), and "visible" (bool [B, 1, S, S]: the causal mask; all True for
      vision). Also "readout" [B] (the CLS / EOT row index).
    """
    p, aux, causal, idx = _run(params, x, tower, positions, causal_text)
    n = n_blocks(p)
    if not 0 <= layer < n:
        raise ValueError(f"layer = {layer}: the {tower} tower has layers 0..{n - 1}")
    e_part, p_part = aux[f"{tower}/e_part"], aux[f"{tower}/p_part"]
    x_in = aux[f"{tower}/resid_pre.{layer}"]
    parts, names = [e_part, p_part], ("E", "P")
    if layer > 0:
        parts.append(x_in - e_part - p_part)
        names = ("E", "P", "R")
    block = p[f"block_{layer}"]
    bias_in = jnp.zeros((x_in.shape[-1],), x_in.dtype)
    if has_ln(block):
        parts, bias_in = ln_parts(x_in, parts, block["ln1_w"], block["ln1_b"])
    terms = logit_terms(block, parts, parts, bias_in, names)
    xs = list(names)
    out = dict(terms)
    out["XX"] = sum(terms[a + b] for a in xs for b in xs)
    out["XB"] = sum(terms[a + "B"] for a in xs)
    out["BX"] = sum(terms["B" + b] for b in xs)
    out["QP"] = sum(terms[a + "P"] for a in (*xs, "B"))
    out["logits"] = aux[f"{tower}/attn_scores.{layer}"]
    S = x_in.shape[1]
    if causal:
        visible = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
    else:
        visible = jnp.ones((S, S), bool)
    out["visible"] = jnp.broadcast_to(visible, (x.shape[0], 1, S, S))
    out["readout"] = idx
    return out


def part_terms(terms: dict) -> tuple[str, ...]:
    """The names of the part x part terms in a `decompose` result (they sum to logits)."""
    return tuple(k for k in terms if len(k) == 2 and set(k) <= set("EPRB"))


def row_variance_shares(terms: dict, names=None) -> dict:
    """Each term's share of the readout row's logit variance across visible keys, per head.

    share_t = sum_images cov_keys(term_t, logits) / sum_images var_keys(logits), with the
    covariance over the keys the readout query sees. Shares of terms that sum to the
    logits sum to 1; row-constant terms (EB, PB, BB, XB) get 0; a negative share means
    the term works against the rest.

    Returns dict name -> [H].
    """
    names = names or (part_terms(terms) + ("XX", "XB", "BX", "QP"))
    idx = terms["readout"]

    def row(a):  # [B, H, S] at the readout row
        return jnp.take_along_axis(a, idx[:, None, None, None], axis=2)[:, :, 0]

    vis = row(terms["visible"]).astype(jnp.float32)  # [B, 1, S]
    n_vis = vis.sum(-1, keepdims=True)

    def centred(a):
        a = row(a)
        return (a - (a * vis).sum(-1, keepdims=True) / n_vis) * vis

    full = centred(terms["logits"])
    var = (full * full).sum(-1).sum(0)  # [H]
    return {t: (centred(terms[t]) * full).sum(-1).sum(0) / var for t in names}
