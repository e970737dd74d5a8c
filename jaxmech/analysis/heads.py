"""Head roles and the CLS-row EP gradient (paper 000).

* `cls_row_profiles(params)`: per head, the CLS query's EP, BP, PP and QP terms against
  every pixel key position, `[H, L]` each. The CLS token is the same in every image, so
  these rows depend on the params only (computed by `decompose` on a blank image).
* `gradient_stats(profile)`: per head, the least-squares slope (logit per pixel) and
  the Spearman rank correlation with position (+1: rises monotonically to the right).
* `head_roles(params, task)`: per head, how much the CLS-row logit to a lone object's key
  varies across labels (`delta_label`: std over labels, mean over positions) and across
  positions (`delta_pe`: std over positions, mean over labels). A head is
  `relational` when delta_pe > delta_label, else `label-specific`.

All are pure functions of params, vmappable over stacked models.

Axis names (`jaxmech.shapes`): K models, H heads, L image length, N labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis.decompose import decompose
from jaxmech.analysis.probes import single_object_images


def cls_row_profiles(params, image_len: int, positions=None) -> dict:
    """CLS-row terms over the pixel keys, dict name -> [H, L] (EP, BP, PP, QP)."""
    blank = jnp.zeros((1, image_len), jnp.int32)
    t = decompose(params, blank, positions=positions)
    return {k: t[k][0, :, 0, 1:] for k in ("EP", "BP", "PP", "QP")}


def _ranks(x):
    return jnp.argsort(jnp.argsort(x, axis=-1), axis=-1).astype(jnp.float32)


def _corr(a, b):
    a = a - a.mean(-1, keepdims=True)
    b = b - b.mean(-1, keepdims=True)
    return (a * b).sum(-1) / jnp.sqrt((a * a).sum(-1) * (b * b).sum(-1)).clip(1e-30)


def gradient_stats(profile_HxL) -> dict:
    """Slope (logit per pixel) and Spearman correlation with position, each [H]."""
    L = profile_HxL.shape[-1]
    pos = jnp.arange(L, dtype=jnp.float32)
    pc = pos - pos.mean()
    slope = ((profile_HxL - profile_HxL.mean(-1, keepdims=True)) * pc).sum(-1) / (pc * pc).sum()
    spearman = _corr(_ranks(profile_HxL), jnp.broadcast_to(pos, profile_HxL.shape))
    return {
        "slope": slope,
        "spearman": spearman,
        "range": profile_HxL.max(-1) - profile_HxL.min(-1),
    }


def head_roles(params, n_labels: int, image_len: int) -> dict:
    """delta_label, delta_pe [H] and relational [H] bool from single-object images."""
    images = single_object_images(n_labels, image_len)  # [N * L, L], label-major
    logits = decompose(params, images)["logits"]  # [N * L, H, S, S]
    # CLS row, key = the object's own column (pixel p is key p + 1)
    obj_key = jnp.tile(jnp.arange(image_len), n_labels) + 1
    s = jnp.take_along_axis(logits[:, :, 0, :], obj_key[:, None, None], axis=2)[..., 0]
    s = s.reshape(n_labels, image_len, -1)  # [labels, positions, H]
    delta_label = s.std(0).mean(0)
    delta_pe = s.std(1).mean(0)
    return {"delta_label": delta_label, "delta_pe": delta_pe, "relational": delta_pe > delta_label}


def head_table(params_K, n_labels: int, image_len: int) -> dict:
    """Per model and head: roles and CLS-row EP / QP gradient stats, each [K, H]."""

    def one(params):
        roles = head_roles(params, n_labels, image_len)
        prof = cls_row_profiles(params, image_len)
        ep = gradient_stats(prof["EP"])
        qp = gradient_stats(prof["QP"])
        return {
            **roles,
            "ep_slope": ep["slope"],
            "ep_spearman": ep["spearman"],
            "ep_range": ep["range"],
            "qp_slope": qp["slope"],
            "qp_spearman": qp["spearman"],
            "ep_profile": prof["EP"],
            "bp_profile": prof["BP"],
            "qp_profile": prof["QP"],
        }

    return jax.lax.map(one, params_K)


def strongest_heads(heads: dict) -> dict:
    """Per model, the head with the largest |CLS-row EP slope|: index, slope, Spearman.

    Args: heads, a `head_table` ({name: [K, H]}). Returns {name: [K]}.
    """
    slope = np.asarray(heads["ep_slope"])
    h = np.abs(slope).argmax(1)
    k = np.arange(slope.shape[0])
    return {
        "head": h,
        "ep_slope": slope[k, h],
        "ep_gradient": np.asarray(heads["ep_spearman"])[k, h],
        "qp_slope": np.asarray(heads["qp_slope"])[k, h],
    }
