"""Rotary vision towers (`vision_pos = "rope"`): logit decomposition, CLS-row position
profiles, rotation ablation.

In a rotary block head h's logit of query s and key t is, with q, k the unrotated
projections (biases included), R = Dh / 2 frequency pairs (q^1_i, q^2_i) = (q_i,
q_{i+R}) and phi_i = f_i (pos_t - pos_s) (times the head's rope keep-weight):

    logit = rot(q_s) . rot(k_t) / sqrt(Dh)
          = sum_i [ a_i cos(phi_i) + b_i sin(phi_i) ] / sqrt(Dh),
    a_i = q^1_i k^1_i + q^2_i k^2_i,   b_i = q^2_i k^1_i - q^1_i k^2_i.

`rope_logit_parts` splits it into

    content  = sum_i a_i / sqrt(Dh)                          (= q . k, the logit at
               relative position 0, and the logit with the rotation switched off)
    position = sum_i [a_i (cos phi_i - 1) + b_i sin phi_i] / sqrt(Dh)
                                                          (zero at relative position 0)

so logits = content + position, per frequency pair too (`pair_content`,
`pair_position`). Both are linear in k, so they split further by the key's input parts:
k = E W_K (token) + b_K (bias) (+ R W_K, the residual written by earlier blocks, for
layer > 0): `content_E` (the EE + BE analogue: query against key token), `content_B`
(q . b_K: constant along each row, softmax-invariant), `position_E` (query against the
key token *through* the relative rotation: content x position, the EP analogue, but
multiplicative: its position dependence differs per key label) and `position_B`
(query against the rotated key bias: a pure function of relative position, the BP
analogue). The query side is not split: on the CLS row it is one vector (E_CLS W_Q +
b_Q; CLS has no position part), so an E/B split of it would not be identified.

Softmax is invariant only to row constants, so `position` also moves attention *within*
a row; ablating the rotation in a head (`Edits.rope_keep`, `rope_ablation_table`)
replaces that head's logits by `content` exactly (first block).

Axis names (`jaxmech.shapes`): B batch, H heads, Q query rows (= S), S keys, R rotary
frequency pairs, N labels, L image length, K models, A stacked edits.
All functions are pure functions of (params, inputs), jittable (`layer` static) and
vmappable.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmech.analysis.ablate import evaluate_edits
from jaxmech.analysis.heads import gradient_stats
from jaxmech.analysis.probes import single_object_images
from jaxmech.families.dual_encoder.checks import check_images
from jaxmech.families.dual_encoder.model import (
    encode,
    is_rotary,
    rope_angles,
    rope_positions,
    vision_inputs,
)
from jaxmech.models.attention import block_input, n_blocks
from jaxmech.models.edits import Edits
from jaxmech.models.layout import block as block_of


def _pair_terms(q_BxQxHxDh, k_BxSxHxDh):
    """a, b [B, H, Q, S, R]: the per-pair dot and cross products of unrotated q and k."""
    R = q_BxQxHxDh.shape[-1] // 2
    q1, q2 = q_BxQxHxDh[..., :R], q_BxQxHxDh[..., R:]
    k1, k2 = k_BxSxHxDh[..., :R], k_BxSxHxDh[..., R:]
    a = jnp.einsum("bqhf,bshf->bhqsf", q1, k1) + jnp.einsum("bqhf,bshf->bhqsf", q2, k2)
    b = jnp.einsum("bqhf,bshf->bhqsf", q2, k1) - jnp.einsum("bqhf,bshf->bhqsf", q1, k2)
    return a, b


def _check(params, images_BxL, layer: int, positions) -> None:
    check_images(params, images_BxL, positions)
    if not is_rotary(params["vision"]):
        raise ValueError(
            "rope_logit_parts needs a rotary vision tower (vision_pos = 'rope'); "
            "for a learned P use analysis.decompose"
        )
    n = n_blocks(params["vision"])
    if not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
        raise ValueError(f"layer = {layer!r}: the vision tower has layers 0..{n - 1}")


def _key_parts(block, aux, layer: int):
    """The key side split by input part: (names, k per part [B, S, H, Dh]).

    Parts: token E, residual R (layer > 0), bias B (b_K, plus LayerNorm's bias).
    """
    x_in = aux[f"vision/resid_pre.{layer}"]
    e_part = aux["vision/e_part"]
    parts, names = [e_part], ["E"]
    if layer > 0:
        parts.append(x_in - e_part)
        names.append("R")
    _, parts, bias_in = block_input(block, x_in, parts)
    k_parts = [jnp.einsum("bsd,hde->bshe", p, block["W_K"]) for p in parts]
    k_bias = block["b_K"] + jnp.einsum("d,hde->he", bias_in, block["W_K"])
    k_parts.append(jnp.broadcast_to(k_bias, k_parts[0].shape))
    names.append("B")
    return names, k_parts


def _relative_rotation(tower, rope_pos):
    """cos(phi) - 1 and sin(phi), [B or 1, 1, Q, S, R], phi = angle(key) - angle(query)."""
    angles = rope_angles(tower, rope_pos)  # [S, R] or [B, S, R]
    phi = angles[..., None, :, :] - angles[..., :, None, :]  # [..., Q, S, R]: key - query
    if phi.ndim == 3:
        phi = phi[None]
    phi = phi[:, None]  # [B or 1, 1, Q, S, R]
    cos_m1 = -2.0 * jnp.sin(0.5 * phi) ** 2  # cos(phi) - 1 without cancellation
    return cos_m1, jnp.sin(phi)


def _content_position(q, names, k_parts, cos_m1, sin, scale) -> dict:
    """Content / position parts per key part, per pair and in total (module docstring)."""
    out = {}
    pair_c = pair_p = 0.0
    for name, k in zip(names, k_parts):
        a, b = _pair_terms(q, k)
        pc = a * scale
        pp = (a * cos_m1 + b * sin) * scale
        out["content_" + name] = pc.sum(-1)
        out["position_" + name] = pp.sum(-1)
        pair_c, pair_p = pair_c + pc, pair_p + pp
    out["pair_content"], out["pair_position"] = pair_c, pair_p
    out["content"] = pair_c.sum(-1)
    out["position"] = pair_p.sum(-1)
    return out


def rope_logit_parts(params, images_BxL, *, layer: int = 0, positions=None) -> dict:
    """Content / relative-position split of a rotary vision block's logits (module doc).

    Args:
      params: one model's params with a rotary vision tower.
      images_BxL: int images (as `forward` accepts them).
      layer: which vision block (static under jit).
      positions: pixel positions as for `forward` (default 0..L-1; rotary position of
        pixel i is 1 + positions[i], CLS is at 0).

    Returns:
      dict of [B, H, S, S] (rows queries, columns keys): "logits" (the forward's own),
      "content", "position" (summing to the logits), "content_X" / "position_X" for
      key parts X in E, B (and R for layer > 0; they sum to "content" / "position"),
      "pair_content", "pair_position" [B, H, S, S, R], "rel_pos" [S, S] or [B, S, S]
      (pos_key - pos_query), and "visible" / "readout" as in `decompose` (so
      `decompose.row_variance_shares` applies).
    """
    _check(params, images_BxL, layer, positions)
    tower = params["vision"]
    B, L = images_BxL.shape
    tokens, _ = vision_inputs(tower, images_BxL, positions)
    rope_pos = rope_positions(L, positions)
    idx = jnp.zeros((B,), jnp.int32)
    _, aux = encode(tower, tokens, None, idx, name="vision", causal=False, rope_pos=rope_pos)
    block = block_of(tower, layer)
    names, k_parts = _key_parts(block, aux, layer)
    cos_m1, sin = _relative_rotation(tower, rope_pos)
    scale = block["W_Q"].shape[-1] ** -0.5
    q = aux[f"vision/q.{layer}"]
    out = {"logits": aux[f"vision/attn_scores.{layer}"]}
    out.update(_content_position(q, names, k_parts, cos_m1, sin, scale))
    out["rel_pos"] = rope_pos[..., None, :] - rope_pos[..., :, None]
    S = L + 1
    out["visible"] = jnp.ones((B, 1, S, S), bool)
    out["readout"] = idx
    return out


def cls_profiles(params, n_labels: int, image_len: int, positions=None) -> dict:
    """The CLS row's view of a lone object as the object moves, per head (first block).

    For every label and pixel p the single-object image's CLS-row logit to the
    object's key (rotary offset p + 1 from CLS). Its content part does not depend on p
    (no P), so all variation over p is the relative-position part.

    Returns:
      object_logit, object_position [labels, L, H]; profile [H, L] (mean over labels of
      the object logit, centred over p: the head's left/right signal); background
      [H, L] (the CLS-row logit to background keys of a blank image: a function of
      position only); slope, spearman [H] (of `profile`, logit per pixel / rank
      correlation); label_slope [labels, H]; sign_agree [H] (fraction of labels whose
      slope has the sign of the mean profile's); delta_label, delta_pe [H] and
      relational [H] (delta_pe > delta_label, as in `heads.head_roles`).
    """
    images = single_object_images(n_labels, image_len)  # [N * L, L], label-major
    parts = rope_logit_parts(params, images, positions=positions)
    obj_key = jnp.tile(jnp.arange(image_len), n_labels) + 1

    def at_object(a):  # CLS row at the object's key -> [labels, L, H]
        row = a[:, :, 0, :]  # [N, H, S]
        v = jnp.take_along_axis(row, obj_key[:, None, None], axis=2)[..., 0]
        return v.reshape(n_labels, image_len, -1)

    s = at_object(parts["logits"])
    pos_part = at_object(parts["position"])
    prof = s.mean(0).T  # [H, L]
    prof = prof - prof.mean(-1, keepdims=True)
    stats = gradient_stats(prof)
    label_slope = gradient_stats(jnp.moveaxis(s, 1, 2))["slope"]  # [labels, H]
    sign_agree = (jnp.sign(label_slope) == jnp.sign(stats["slope"])[None]).mean(0)
    blank = rope_logit_parts(params, jnp.zeros((1, image_len), jnp.int32), positions=positions)[
        "logits"
    ][0, :, 0, 1:]
    delta_label = s.std(0).mean(0)
    delta_pe = s.std(1).mean(0)
    return {
        "object_logit": s,
        "object_position": pos_part,
        "profile": prof,
        "background": blank,
        "slope": stats["slope"],
        "spearman": stats["spearman"],
        "label_slope": label_slope,
        "sign_agree": sign_agree,
        "delta_label": delta_label,
        "delta_pe": delta_pe,
        "relational": delta_pe > delta_label,
    }


def rope_keep_masks(n_heads: int) -> tuple[tuple[str, ...], jnp.ndarray]:
    """Named rotation ablations and their keep masks [A, H].

    `none`; `all heads` (no head rotated: the tower is permutation-invariant over
    pixels); `head h` (rotation off in head h only); `only h` (rotation kept in head h
    only).
    """
    eye = jnp.eye(n_heads, dtype=jnp.float32)
    names = ["none", "all heads"]
    masks = [jnp.ones((n_heads,)), jnp.zeros((n_heads,))]
    for h in range(n_heads):
        names.append(f"head {h}")
        masks.append(1.0 - eye[h])
    for h in range(n_heads):
        names.append(f"only {h}")
        masks.append(eye[h])
    return tuple(names), jnp.stack(masks).astype(jnp.float32)


def rope_ablation_table(params_K, settings_K, data, masks_AxH) -> dict:
    """Accuracies of K models with the rotation scaled by A keep masks, dict -> [K, A].

    `masks_AxH` ([A, H], or [A, Y, H] per block) go to `Edits.rope_keep`; one
    compiled call (`ablate.evaluate_edits`); the switches are those of `params_K["static"]`.
    """
    edits = Edits(rope_keep={"vision": jnp.asarray(masks_AxH, jnp.float32)})
    return evaluate_edits(params_K, settings_K, data, edits)
