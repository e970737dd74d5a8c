"""The first ViT block's attention logits of the VLM, split into 16 terms (App. O).

The ViT's input (`families.toy_vlm.vit`) is the sum of three parts: the cell content C
(label + colour + facing rows), the row position code R and the column position code
K (learned2d or sincos2d; rope2d has no additive position, so no split). With the
biases B (b_Q on the query side, b_K on the key side), the first block's pre-softmax
logits are

    QK^T / sqrt(Dh) = sum over a, b in {C, R, K, B} of  ab = (a W_Q)(b W_K)^T / sqrt(Dh)

e.g. `RR` (row code attending to row code: the vertical gradient), `KK` (horizontal),
`CK` (a content query reading column codes). With LayerNorm the parts are LayerNorm's
per-token linear split at this input (`models.attention.ln_parts`, as
`analysis.decompose`): exact sums, first-order ablations. `Edits.term_keep["vit"]`
removes terms inside the forward in the same `VIT_TERMS` order (`models.edits`).

Axis names (`jaxmech.shapes`): B images, H heads, L cells (queries x keys).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.families.toy_vlm import vit as vit2d
from jaxmech.families.toy_vlm.checks import check_cells, check_edits, check_params
from jaxmech.families.toy_vlm.vit import read
from jaxmech.models.attention import block_input, logit_terms
from jaxmech.models.edits import VIT_TERMS, Edits


def vit_logit_terms(params, labels_BxL, colours_BxL, facings_BxL, *, vit_rows=None, vit_cols=None):
    """The 16 terms of the first ViT block's scaled logits, and the logits themselves.

    Args:
      params: one VLM's params (`families.toy_vlm.model`; vmap over stacked ones).
      labels_BxL, colours_BxL, facings_BxL: int cells, as `toy_vlm.model.forward` takes them.
      vit_rows, vit_cols: optional float [L] position overrides (`Edits`).

    Returns:
      dict of [B, H, L, L] (rows queries, columns keys): "CC", "CR", ..., "BB"
      (`models.edits.VIT_TERMS`; they sum to "logits" up to float rounding) and
      "logits" (the forward's `vit/attn_scores.0`).
    """
    check_params(params)
    check_cells(params, labels_BxL, colours_BxL, facings_BxL)
    if vit2d.position_kind(params) == "rope2d":
        raise ValueError(
            "vit_logit_terms: this ViT uses rope2d (no additive row / column codes), so "
            "the C / R / K split does not apply"
        )
    edits = Edits(vit_rows=vit_rows, vit_cols=vit_cols)
    check_edits(params, edits, 1)
    aux = {}
    parts = vit2d.vit_inputs(params, labels_BxL, colours_BxL, facings_BxL, edits, aux)
    block = params["vit"]["block_0"]
    _, parts, bias_in = block_input(block, sum(parts), list(parts))
    terms = logit_terms(block, parts, parts, bias_in, ("C", "R", "K"))
    _, aux = vit2d.vit_forward(params, labels_BxL, colours_BxL, facings_BxL, edits)
    return {**terms, "logits": aux["vit/attn_scores.0"]}


def term_gradients(params, labels_BxL, colours_BxL, facings_BxL):
    """Where the first ViT block's horizontal and vertical gradients live, per term.

    For each term, each image and each query cell holding an object, the least-squares
    slope (logit per cell) of the term's logit over the keys' columns (`h`) and rows
    (`v`); on a full grid the two fits are independent. Averaged over those queries:

    Returns:
      {"h": [16, H], "v": [16, H]} the mean signed slope, and {"h_abs", "v_abs"} the
      mean absolute slope, per term (`VIT_TERMS` order) and head. A signed mean near
      the absolute one is a gradient every object query shares (000's "relational"
      EP term); a small signed mean with a large absolute one is label-specific.
    """
    terms = vit_logit_terms(params, labels_BxL, colours_BxL, facings_BxL)
    query_BxL = (labels_BxL > 0).astype(jnp.float32)
    out = {}
    for axis, coord in (("h", read(params, "cell_cols")), ("v", read(params, "cell_rows"))):
        centred_L = coord - coord.mean()
        weight_L = centred_L / jnp.sum(centred_L**2)
        slopes = jnp.stack(
            [jnp.einsum("bhqk,k->bhq", terms[t], weight_L) for t in VIT_TERMS]
        )  # [16, B, H, L]
        w = query_BxL[None, :, None, :]
        n = jnp.maximum(w.sum((1, 3)), 1.0)
        out[axis] = (slopes * w).sum((1, 3)) / n
        out[f"{axis}_abs"] = (jnp.abs(slopes) * w).sum((1, 3)) / n
    return out
