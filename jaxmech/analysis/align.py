"""Image-text alignment of label embeddings up to a rotation (paper 000, text side).

Paper 000 reports that the image and text embeddings of the same label have a low
cosine similarity as they are, but an orthogonal map fitted on labels 1..15 aligns the
two sides on the held-out labels 16..20: the towers agree up to a rotation.

Which embeddings (`kind`):

* `"token"` (the paper's claim, the default): the raw token-embedding rows, vision
  `E[label]` against text `E[label]` (the text id of label k is k, `data.tasks.vocab`), both
  [n_labels, d_model]. The two E matrices never meet in the loss (only through the
  towers' weights), so there is no reason for them to agree coordinate-wise; a rotation
  that transfers to labels it was not fitted on says their *geometry* (how labels sit
  relative to each other) is shared.
* `"output"`: what the towers emit after `W_proj` (L2-normalised) for single-object
  inputs: the image embedding of the label alone, averaged over all pixel positions
  (the side component of left and right positions cancels), against the text
  embedding of its single-object caption: with `text_caption="side"` the mean of
  `X is on the left` and `X is on the right` (the captions single objects are trained
  with under `single_captions = "side"`), with `"label"` the caption `X`. The CLIP loss
  aligns this space directly, so the identity should already do well; it is the
  sanity anchor for the token-level result (the rotation found should then be ~I).

d_model = d_embed = 128 by default, so both pairs are square and R is [W, W].

Controls, on the held-out labels: 100 (configurable) Haar-random orthogonal maps
(what a rotation that knows nothing does: cosine ~ 0 +- 1/sqrt(D)), and the Procrustes
fit with the fit labels' correspondence shuffled (what fitting *any* rotation to the two
label clouds gives, e.g. by aligning their shared mean direction). Retrieval (nearest
text label among the held-out labels for each mapped image label; chance
1 / n_test) and the mismatched-label cosine say whether the alignment is label-specific.

Note on rank: with J fit labels < W, `A^T B` has rank <= J and the map is fixed only on
the span of the fit labels' embeddings; outside it R is an arbitrary (SVD-dependent)
orthogonal completion. A held-out label can only align through the part of its
embedding that lies in that span; `span_img` / `span_txt` report that fraction of its
squared norm, and `cos_after_span` scores the in-span part alone.

Axis names (`jaxmech.shapes`): N labels (rows of an embedding set), J fit labels, U
test (held-out) labels, W the embeddings' width (d_model for token rows, d_embed for
tower outputs), O random orthogonal maps, K models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.analysis.probes import single_object_images
from jaxmech.data.tasks.vocab import Vocab
from jaxmech.families.dual_encoder.model import encode_images, encode_texts

KINDS = ("token", "output")
TEXT_CAPTIONS = ("side", "label")


def procrustes(A_NxW, B_NxW):
    """The orthogonal R [W, W] minimising ||A R - B||_F (orthogonal Procrustes, via SVD).

    With `U S V^T = svd(A^T B)`, `R = U V^T` (det may be -1: the optimum over O(D)).

    Raises:
      ValueError: unless A and B are 2D with the same shape [N, W], N >= 1.
    """
    A_NxW, B_NxW = jnp.asarray(A_NxW), jnp.asarray(B_NxW)
    if A_NxW.ndim != 2 or B_NxW.shape != A_NxW.shape or A_NxW.shape[0] < 1:
        raise ValueError(
            f"procrustes needs A and B of the same shape [N, W] with N >= 1, got "
            f"{A_NxW.shape} and {B_NxW.shape}"
        )
    # full_matrices=False: the same factors for the square A^T B, but on CPU the
    # full_matrices=True path is ~10x slower in this jaxlib.
    U, _, Vt = jnp.linalg.svd(A_NxW.T @ B_NxW, full_matrices=False)
    return U @ Vt


def haar_rotations(key, n: int, d: int):
    """n Haar-random orthogonal matrices [O, W, W] = [n, d, d] (QR of a Gaussian, signs
    fixed)."""
    Z = jax.random.normal(key, (n, d, d))
    Q, Rr = jnp.linalg.qr(Z)
    return Q * jnp.sign(jnp.diagonal(Rr, axis1=-2, axis2=-1))[:, None, :]


def _unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True).clip(1e-12)


def _cos_rows(a, b):
    return (_unit(a) * _unit(b)).sum(-1)


def label_embeddings(
    params,
    n_labels: int,
    image_len: int,
    *,
    kind: str = "token",
    text_caption: str = "side",
):
    """Image-side and text-side embeddings of labels 1..n_labels (module doc, `kind`).

    Args:
      params: one model's params.
      n_labels: labels of the task (vision E has n_labels + 2 rows).
      image_len: L (for the single-object images of `kind="output"`).
      kind: "token" (raw E rows, [N, d_model]) or "output" (tower outputs after
        W_proj, L2-normalised, [N, d_embed]).
      text_caption: "side" or "label" (caption form for `kind="output"`).

    The text tower's mask is `params["static"]["causal_text"]` (as trained;
    `families.dual_encoder.checks.with_static` makes a counterfactual).

    Under `jax.jit`, `n_labels`, `image_len`, `kind` and `text_caption` must be static.

    Returns:
      (img_NxW, txt_NxW), row i for label i + 1.
    """
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r}: expected one of {KINDS}")
    if text_caption not in TEXT_CAPTIONS:
        raise ValueError(f"text_caption = {text_caption!r}: expected one of {TEXT_CAPTIONS}")
    v = Vocab(n_labels)
    if params["vision"]["E"].shape[0] != v.image_vocab_size:
        raise ValueError(
            f"n_labels = {n_labels} but the vision E has {params['vision']['E'].shape[0]} "
            f"rows (expected n_labels + 2 = {v.image_vocab_size})"
        )
    labels = jnp.arange(1, n_labels + 1)
    if kind == "token":
        return params["vision"]["E"][labels], params["text"]["E"][labels]
    images = single_object_images(n_labels, image_len)  # [N * L, L], label-major
    img, _ = encode_images(params, images, readout_only=True)
    img = _unit(img.reshape(n_labels, image_len, -1).mean(1))
    if text_caption == "side":
        forms = [
            [lab, "is", "on", "the", rel]
            for lab in range(1, n_labels + 1)
            for rel in ("left", "right")
        ]
    else:
        forms = [[lab] for lab in range(1, n_labels + 1)]
    caps = jnp.asarray([v.encode(f) for f in forms], jnp.int32)
    txt, _ = encode_texts(params, caps, readout_only=True)
    txt = _unit(txt.reshape(n_labels, len(forms) // n_labels, -1).mean(1))
    return img, txt


def _retrieval(mapped_UxW, txt_UxW):
    sims = _unit(mapped_UxW) @ _unit(txt_UxW).T
    return (sims.argmax(1) == jnp.arange(sims.shape[0])).mean()


def _in_span(fit_JxW, test_UxW):
    """The test rows projected onto the row span of fit, [U, W]."""
    _, s, Vt = jnp.linalg.svd(fit_JxW, full_matrices=False)
    keep = (s > 1e-5 * s.max()).astype(fit_JxW.dtype)
    return ((test_UxW @ Vt.T) * keep) @ Vt


def _span_fraction(fit_JxW, test_UxW):
    """Fraction of ||test||^2 in the row span of fit (mean over test rows)."""
    proj = _in_span(fit_JxW, test_UxW)
    return ((proj**2).sum(-1) / (test_UxW**2).sum(-1).clip(1e-30)).mean()


def align_labels(img_NxW, txt_NxW, fit_idx_J, test_idx_U, rotations_OxWxW, perms_OxJ) -> dict:
    """Fit R on the fit rows, score the test rows, with random-map and shuffled controls.

    Args:
      img_NxW, txt_NxW: image-side and text-side embeddings, row-matched.
      fit_idx_J, test_idx_U: int row indices (disjoint).
      rotations_OxWxW: random orthogonal maps (`haar_rotations`).
      perms_OxJ: permutations of range(J) for the shuffled-correspondence fits (their
        count need not equal the number of rotations).

    Returns dict: scalars cos_before, cos_after (mean test cosine of matching labels,
    identity map / fitted map), cos_after_span (the same with the test rows first
    projected onto the fit rows' span: free of the arbitrary completion of R outside
    it), cos_after_other (mismatched test labels, after),
    cos_fit_after (fit labels, after), retrieval_before, retrieval_after, span_img,
    span_txt; and [O] arrays cos_random, retrieval_random (random maps),
    cos_shuffled, retrieval_shuffled (fits with the correspondence shuffled).
    """
    img_NxW, txt_NxW = jnp.asarray(img_NxW), jnp.asarray(txt_NxW)
    if img_NxW.ndim != 2 or img_NxW.shape != txt_NxW.shape:
        raise ValueError(
            f"img and txt must have the same shape [N, W], got {img_NxW.shape}, {txt_NxW.shape}"
        )
    W = img_NxW.shape[1]
    if rotations_OxWxW.ndim != 3 or rotations_OxWxW.shape[1:] != (W, W):
        raise ValueError(f"rotations must be [O, {W}, {W}], got {rotations_OxWxW.shape}")
    A, B = img_NxW[fit_idx_J], txt_NxW[fit_idx_J]
    At, Bt = img_NxW[test_idx_U], txt_NxW[test_idx_U]
    R = procrustes(A, B)
    mapped = At @ R
    U = At.shape[0]
    sims = _unit(mapped) @ _unit(Bt).T
    off = 1.0 - jnp.eye(U)
    shuffled_R = jax.vmap(lambda p: procrustes(A, B[p]))(perms_OxJ)
    rand_mapped = jnp.einsum("ud,rde->rue", At, rotations_OxWxW)
    shuf_mapped = jnp.einsum("ud,rde->rue", At, shuffled_R)
    return {
        "cos_before": _cos_rows(At, Bt).mean(),
        "cos_after": _cos_rows(mapped, Bt).mean(),
        "cos_after_other": (sims * off).sum() / off.sum().clip(1.0),
        "cos_after_span": _cos_rows(_in_span(A, At) @ R, Bt).mean(),
        "cos_fit_after": _cos_rows(A @ R, B).mean(),
        "retrieval_before": _retrieval(At, Bt),
        "retrieval_after": _retrieval(mapped, Bt),
        "span_img": _span_fraction(A, At),
        "span_txt": _span_fraction(B, Bt),
        "cos_random": _cos_rows(rand_mapped, Bt[None]).mean(-1),
        "retrieval_random": jax.vmap(_retrieval, (0, None))(rand_mapped, Bt),
        "cos_shuffled": _cos_rows(shuf_mapped, Bt[None]).mean(-1),
        "retrieval_shuffled": jax.vmap(_retrieval, (0, None))(shuf_mapped, Bt),
    }


def alignment_study(
    params,
    fit_labels_J,
    test_labels_U,
    rotations_OxWxW,
    perms_OxJ,
    *,
    n_labels: int,
    image_len: int,
    kind: str = "token",
    text_caption: str = "side",
) -> dict:
    """`align_labels` on one model's `label_embeddings` (vmap over stacked models).

    Args:
      params: one model's params.
      fit_labels_J, test_labels_U: 1-based labels (default use: 1..15 and 16..20).
      rotations_OxWxW, perms_OxJ: the controls (`align_labels`), shared by all models.
      n_labels, image_len, kind, text_caption: as in `label_embeddings`.

    Returns: `align_labels`'s dict.
    """
    img, txt = label_embeddings(params, n_labels, image_len, kind=kind, text_caption=text_caption)
    return align_labels(
        img,
        txt,
        jnp.asarray(fit_labels_J) - 1,
        jnp.asarray(test_labels_U) - 1,
        rotations_OxWxW,
        perms_OxJ,
    )


def control_maps(key, n_random: int, n_shuffled: int, d: int, n_fit: int):
    """The shared controls: Haar rotations [n_random, d, d], permutations [n_shuffled, n_fit]."""
    k_rot, k_perm = jax.random.split(key)
    keys = jax.random.split(k_perm, n_shuffled)
    perms = jax.vmap(lambda k: jax.random.permutation(k, n_fit))(keys)
    return haar_rotations(k_rot, n_random, d), perms
