"""Relation and label-set accuracies on the fixed validation sets (SPEC.md).

Relation accuracy: an image is correct when its true caption is more similar than its
swapped caption (objects exchanged for pairs, left/right exchanged for singles); with
caption mode `left_right` both forms are scored and averaged. Label-set accuracy: the
true caption against the same caption with one label replaced by an absent label, on
the unseen-pair images. Chance is 0.5 for all four.

The 2D and three-object tasks (`data.grouped.GroupedEvalSets`) add accuracies per
group of rows, `<set>_<group>_acc` (`unseen_h_acc`, `unseen_v_acc`, `seen_zm_acc`, ...);
their four SPEC metrics are means over all rows of a set (a 2D image counts once per
relation it is scored under). The 1D path is unchanged.

The caption table (every caption of the task) is embedded once per evaluation and the
images' captions are looked up by id. Everything is a pure function of params and
arrays, so it runs inside the training scan and under vmap over models and edits.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.config import Settings
from jaxmech.data import grouped
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
      evals: fixed validation sets (`build_eval_sets` of the task's generator; the
        type selects the 1D or the grouped evaluation).
      captions_CxT: the caption table (`DataTables.captions`).
      settings: the model's sweepable values (scalars; decide its seen-pair set).
      causal_text: the text encoder's mask.
      edits / vision_positions: interventions applied to both towers' forward.

    Returns:
      dict of scalars `single_acc, seen_acc, unseen_acc, labelset_acc` (seen_acc is NaN
      when the model has no seen-pair validation image), plus the per-group accuracies
      of grouped sets (`data.grouped.metric_names`).
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

    if isinstance(evals, grouped.GroupedEvalSets):
        return _evaluate_grouped(embed, txt, evals, settings)
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


def _evaluate_grouped(embed, txt, evals, settings):
    """`evaluate` on `GroupedEvalSets`: the four metrics and one per (set, group)."""
    wins, weight, group = {}, {}, {}
    for name in ("single", "seen", "unseen"):
        img = embed(getattr(evals, f"{name}_images"))[jnp.asarray(getattr(evals, f"{name}_index"))]
        wins[name] = _wins(img, txt, getattr(evals, f"{name}_true"), getattr(evals, f"{name}_swap"))
        weight[name] = jnp.ones_like(wins[name])
        group[name] = jnp.asarray(getattr(evals, f"{name}_group"))
        if name == "unseen":
            true, false = evals.labelset_true[:, None], evals.labelset_false[:, None]
            wins["labelset"] = _wins(img, txt, true, false)
    weight["seen"] = grouped.seen_mask(evals, settings).astype(jnp.float32)
    weight["labelset"], group["labelset"] = weight["unseen"], group["unseen"]
    out = {f"{s}_acc": (wins[s] * weight[s]).sum() / weight[s].sum() for s in wins}
    for s in type(evals).GROUPED_SETS:
        for g, gname in enumerate(type(evals).GROUPS):
            w = weight[s] * (group[s] == g)
            out[f"{s}_{gname}_acc"] = (wins[s] * w).sum() / w.sum()
    return out
