"""Attention-logit decomposition (paper 000; SPEC "Attention-logit decomposition").

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
defined (and sum to the logits) everywhere, masked or not. The text tower's mask is
read from `params["static"]["causal_text"]` (as trained; `families.dual_encoder.checks.with_static`
makes a counterfactual, e.g. a bidirectional text tower).

Under `jax.jit`, `tower` and `layer` must be static (`static_argnames=("tower",
"layer")`: they choose which params and which block); params, inputs and positions
may be traced, and `decompose` vmaps over stacked seeds.

Axis names (`jaxmech.shapes`): B batch, H heads, Q query rows (= S here), S keys.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmech.families.dual_encoder.checks import check_captions, check_images, read_static
from jaxmech.families.dual_encoder.model import (
    encode,
    eot_index,
    is_rotary,
    text_inputs,
    vision_inputs,
)
from jaxmech.models.attention import block_input, logit_terms, n_blocks
from jaxmech.models.layout import block as block_of


def _check(params, x, tower: str, layer: int, positions) -> None:
    """The public-boundary checks of `decompose` (tower first: it picks the params)."""
    if tower not in ("vision", "text"):
        raise ValueError(f"tower = {tower!r}: expected 'vision' or 'text'")
    if tower == "vision":
        check_images(params, x, positions)
        if is_rotary(params["vision"]):
            raise ValueError(
                "the vision tower uses rotary positions (vision_pos = 'rope'): it has no P, "
                "so the E/P term decomposition does not apply; use jaxmech.analysis.rope"
            )
    else:
        check_captions(params, x, positions)
    n = n_blocks(params[tower])
    if not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
        raise ValueError(f"layer = {layer!r}: the {tower} tower has layers 0..{n - 1}")


def _run(params, x, tower: str, positions):
    """The tower's full forward (every query row) -> (aux, causal flag, readout rows [B])."""
    p = params[tower]
    if tower == "vision":
        tokens, rows = vision_inputs(p, x, positions)
        idx = jnp.zeros((x.shape[0],), jnp.int32)
        causal = False
    else:
        tokens, rows = text_inputs(p, x, positions)
        idx = eot_index(p, x)
        causal = read_static(params, "causal_text")
    _, aux = encode(p, tokens, rows, idx, name=tower, causal=causal, readout_only=False)
    return aux, causal, idx


def _visible(S: int, causal):
    """bool [S, S]: the logits the softmax sees (`causal`: bool or scalar flag array)."""
    lower = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
    if isinstance(causal, (bool, np.bool_)):
        return lower if causal else jnp.ones((S, S), bool)
    return lower | (causal == 0)


def _grouped(terms: dict, names) -> dict:
    """The paper's groups of the part x part terms: XX, XB, BX and QP (module docstring)."""
    xs = list(names)
    return {
        "XX": sum(terms[a + b] for a in xs for b in xs),
        "XB": sum(terms[a + "B"] for a in xs),
        "BX": sum(terms["B" + b] for b in xs),
        "QP": sum(terms[a + "P"] for a in (*xs, "B")),
    }


def decompose(
    params,
    x,
    *,
    tower: str = "vision",
    layer: int = 0,
    positions=None,
):
    """Every named term of one block's pre-softmax attention logits.

    Args:
      params: one model's params (vmap over a leading model axis for stacked seeds).
      x: int images [B, L] (vision) or caption tokens [B, T] (text), as `forward`
        accepts them.
      tower: "vision" or "text" (static under jit).
      layer: which block (0 = the first; static under jit).
      positions: position ids as for `forward` (default: natural order).

    Returns:
      dict of [B, H, S, S] arrays (rows are queries, columns keys): the part x part
      terms ("EE", "EP", ..., "BB"; with "R" terms for layer > 0), the groups "XX",
      "XB", "BX", "BB" and "QP", "logits" (the forward's own scaled logits, which the
      terms sum to), and "visible" (bool [B, 1, S, S]: the causal mask; all True for
      vision). Also "readout" [B] (the CLS / EOT row index).
    """
    _check(params, x, tower, layer, positions)
    aux, causal, idx = _run(params, x, tower, positions)
    e_part, p_part = aux[f"{tower}/e_part"], aux[f"{tower}/p_part"]
    x_in = aux[f"{tower}/resid_pre.{layer}"]
    parts, names = [e_part, p_part], ("E", "P")
    if layer > 0:
        parts.append(x_in - e_part - p_part)
        names = ("E", "P", "R")
    block = block_of(params[tower], layer)
    _, parts, bias_in = block_input(block, x_in, parts)
    terms = logit_terms(block, parts, parts, bias_in, names)
    out = {**terms, **_grouped(terms, names)}
    out["logits"] = aux[f"{tower}/attn_scores.{layer}"]
    S = x_in.shape[1]
    out["visible"] = jnp.broadcast_to(_visible(S, causal), (x.shape[0], 1, S, S))
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
