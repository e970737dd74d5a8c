"""Relation and label-set accuracies on the fixed validation sets (SPEC.md).

Relation accuracy: an image is correct when its true caption is more similar than its
swapped caption (objects exchanged for pairs, left/right exchanged for singles); with
caption mode `left_right` both forms are scored and averaged. Label-set accuracy: the
true caption against the same caption with one label replaced by an absent label, on
the unseen-pair images. Chance is 0.5 for all four.

The caption table (every caption of the task) is embedded once per evaluation and the
images' captions are looked up by id. Everything is a pure function of params and
arrays, so it runs inside the training scan and under vmap over models and edits.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.config import Settings
from jaxmech.data.relations1d import EvalSets, seen_mask
from jaxmech.models.dual_encoder import encode_images, encode_texts
from jaxmech.models.edits import NO_EDITS, Edits

METRICS = ("single_acc", "seen_acc", "unseen_acc", "labelset_acc")


def _wins(img_NxK, txt_CxK, true_NxF, swap_NxF):
    """[N] fraction of forms where the true caption beats the swapped one."""
    s_true = jnp.einsum("nk,nfk->nf", img_NxK, txt_CxK[true_NxF])
    s_swap = jnp.einsum("nk,nfk->nf", img_NxK, txt_CxK[swap_NxF])
    return (s_true > s_swap).astype(jnp.float32).mean(-1)


def evaluate(
    params,
    evals: EvalSets,
    captions_CxT,
    settings: Settings,
    *,
    causal_text: bool = True,
    edits: Edits = NO_EDITS,
    vision_positions=None,
):
    """The four accuracies of one model.

    Args:
      params: one model's params.
      evals: fixed validation sets (`data.relations1d.build_eval_sets`).
      captions_CxT: the caption table (`DataTables.captions`).
      settings: the model's sweepable values (scalars; decide its seen-pair set).
      causal_text: the text encoder's mask.
      edits / vision_positions: interventions applied to both towers' forward.

    Returns:
      dict of scalars `single_acc, seen_acc, unseen_acc, labelset_acc` (seen_acc is NaN
      when the model has no seen-pair validation image).
    """
    txt, _ = encode_texts(
        params, jnp.asarray(captions_CxT), causal=causal_text, readout_only=True, edits=edits
    )

    def embed(images):
        return encode_images(
            params,
            jnp.asarray(images),
            positions=vision_positions,
            readout_only=True,
            edits=edits,
        )[0]

    single = _wins(embed(evals.single_images), txt, evals.single_true, evals.single_swap)
    seen = _wins(embed(evals.seen_images), txt, evals.seen_true, evals.seen_swap)
    img_u = embed(evals.unseen_images)
    unseen = _wins(img_u, txt, evals.unseen_true, evals.unseen_swap)
    labelset = _wins(img_u, txt, evals.labelset_true[:, None], evals.labelset_false[:, None])
    mask = seen_mask(evals, settings).astype(jnp.float32)
    return {
        "single_acc": single.mean(),
        "seen_acc": (seen * mask).sum() / mask.sum(),
        "unseen_acc": unseen.mean(),
        "labelset_acc": labelset.mean(),
    }
