"""Relation and label-set accuracies on the fixed validation sets (SPEC).

Relation accuracy: an image is correct when its true caption is more similar than its
swapped caption (objects exchanged for pairs, left/right exchanged for singles); with
caption mode `left_right` both forms are scored and averaged. Label-set accuracy: the
true caption against the same caption with one label replaced by an absent label, on
the unseen-pair images. Chance is 0.5 for all four.

Every task kind's sets are `data.tasks.grouped.GroupedEvalSets` and take one path. The four
SPEC metrics are means over all rows of a set (a 2D image counts once per relation it
is scored under); sets split by group (`GROUPED_SETS`: the 2D and three-object tasks)
add `<set>_<group>_acc` (`unseen_h_acc`, `unseen_v_acc`, `seen_zm_acc`, ...). The 1D
sets have one row per image and no split, so their metrics are the plain fractions.

The caption table (every caption of the task) is embedded once per evaluation and the
images' captions are looked up by id. Everything is a pure function of params and
arrays, so it runs inside the training scan and under vmap over models and edits.

Axis names (`jaxmech.shapes`): N rows of a set, I distinct images of a set, L image
length, C captions, T caption length, F caption forms per row, Z embedding width.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmech.config import Settings
from jaxmech.data.tasks import grouped
from jaxmech.data.tasks.grouped import GroupedEvalSets
from jaxmech.families.dual_encoder.model import encode_images, encode_texts
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.shapes import is_concrete

METRICS = ("single_acc", "seen_acc", "unseen_acc", "labelset_acc")
SETS = ("single", "seen", "unseen")
# The fields of a GroupedEvalSets that hold caption ids (rows of the caption table).
CAPTION_ID_FIELDS = (
    "single_true",
    "single_swap",
    "seen_true",
    "seen_swap",
    "unseen_true",
    "unseen_swap",
    "labelset_true",
    "labelset_false",
)


def _wins(img_NxZ, txt_CxZ, true_NxF, swap_NxF):
    """[N] fraction of forms where the true caption beats the swapped one."""
    s_true = jnp.einsum("nz,nfz->nf", img_NxZ, txt_CxZ[true_NxF])
    s_swap = jnp.einsum("nz,nfz->nf", img_NxZ, txt_CxZ[swap_NxF])
    return (s_true > s_swap).astype(jnp.float32).mean(-1)


def check_inputs(evals, captions_CxT, settings) -> None:
    """Raises a ValueError naming the argument unless `evals` is a `GroupedEvalSets`,
    `captions_CxT` an int [C, T] table whose rows every caption id of `evals` indexes,
    and `settings` one model's `Settings` of scalars. Shapes are checked always (they
    are static under jit / vmap), values only when concrete."""
    if not isinstance(evals, GroupedEvalSets):
        raise ValueError(
            f"evals is a {type(evals).__name__}: expected a data.tasks.grouped.GroupedEvalSets "
            "(the task's build_eval_sets)"
        )
    if np.ndim(captions_CxT) != 2:
        raise ValueError(
            f"captions_CxT has shape {np.shape(captions_CxT)}: expected an int [C, T] caption "
            "table (tables.captions)"
        )
    dtype = captions_CxT.dtype if hasattr(captions_CxT, "dtype") else np.asarray(captions_CxT).dtype
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"captions_CxT has dtype {dtype}: expected int token ids [C, T]")
    for name in CAPTION_ID_FIELDS:
        _check_ids(f"evals.{name}", getattr(evals, name), np.shape(captions_CxT)[0])
    if not isinstance(settings, Settings):
        raise ValueError(f"settings is a {type(settings).__name__}: expected a config.Settings")
    for field, value in settings._asdict().items():
        if np.ndim(value) != 0:
            raise ValueError(
                f"settings.{field} has shape {np.shape(value)}: expected a scalar (one "
                "model's settings; vmap evaluate over models for stacked [K] settings)"
            )


def _check_ids(name: str, ids, n_captions: int) -> None:
    """Caption ids must be rows of the caption table (a gather would clamp them)."""
    if not is_concrete(ids) or np.size(ids) == 0:
        return
    a = np.asarray(ids)
    if a.min() < 0 or a.max() >= n_captions:
        raise ValueError(
            f"{name} has caption ids in [{a.min()}, {a.max()}]: expected ids in "
            f"[0, {n_captions - 1}], rows of captions_CxT (are evals and captions from "
            "the same task?)"
        )


def evaluate(
    params,
    evals: GroupedEvalSets,
    captions_CxT,
    settings: Settings,
    *,
    edits: Edits = NO_EDITS,
    vision_positions=None,
):
    """The accuracies of one model.

    Args:
      params: one model's params (the text tower's causal mask is read from them).
      evals: fixed validation sets, a `GroupedEvalSets` (`build_eval_sets` of the task).
      captions_CxT: int [C, T], the caption table (`tables.captions`).
      settings: the model's sweepable values as scalars (decide its seen-pair set); a
        stacked [K] `Settings` needs vmap over models.
      edits / vision_positions: interventions applied to both towers' forward.

    Returns:
      dict of scalars `single_acc, seen_acc, unseen_acc, labelset_acc` (seen_acc is NaN
      when the model has no seen-pair validation row), plus the per-group accuracies of
      the sets the eval-set type splits (`data.tasks.grouped.metric_names`).

    Raises:
      ValueError naming the argument when `evals`, `captions_CxT` or `settings` is not
      of the expected kind (checked before tracing; values only on concrete inputs).

    Under `jax.jit` / `vmap` every argument may be traced (no static arguments): the
    eval-set type, which names the groups, travels with the pytree.
    """
    check_inputs(evals, captions_CxT, settings)
    txt_CxZ, _ = encode_texts(params, jnp.asarray(captions_CxT), readout_only=True, edits=edits)

    def embed(images_IxL):
        return encode_images(
            params,
            jnp.asarray(images_IxL),
            positions=vision_positions,
            readout_only=True,
            edits=edits,
        )[0]

    wins, group, seen_mask = _row_wins(embed, txt_CxZ, evals, settings)
    return _accuracies(wins, group, seen_mask, type(evals))


def _row_wins(embed, txt_CxZ, evals: GroupedEvalSets, settings: Settings):
    """Per set (single, seen, unseen, labelset): wins [N], groups [N] and the seen
    mask [N_v] (float 0/1: the model's seen-pair rows)."""
    wins, group = {}, {}
    for name in SETS:
        img_NxZ = embed(getattr(evals, f"{name}_images"))[
            jnp.asarray(getattr(evals, f"{name}_index"))
        ]
        true_NxF, swap_NxF = getattr(evals, f"{name}_true"), getattr(evals, f"{name}_swap")
        wins[name] = _wins(img_NxZ, txt_CxZ, true_NxF, swap_NxF)
        group[name] = jnp.asarray(getattr(evals, f"{name}_group"))
        if name == "unseen":
            true, false = evals.labelset_true[:, None], evals.labelset_false[:, None]
            wins["labelset"] = _wins(img_NxZ, txt_CxZ, true, false)
    group["labelset"] = group["unseen"]
    return wins, group, grouped.seen_mask(evals, settings).astype(jnp.float32)


def _accuracies(wins, group, seen_mask, evals_type: type) -> dict:
    """Mean wins per set (`<set>_acc`; over the model's rows for `seen`) and per (split
    set, group)."""
    # Every row of single / unseen / labelset counts: a plain mean. It rounds like the
    # jitted training program does (XLA multiplies by the reciprocal of a constant row
    # count) and keeps the 1D metrics exactly as they were; sum / weight-sum would round
    # once, exactly, and can differ from it in the last bit when run eagerly.
    out = {
        f"{s}_acc": (wins[s] * seen_mask).sum() / seen_mask.sum() if s == "seen" else wins[s].mean()
        for s in wins
    }
    weight = {s: jnp.ones_like(wins[s]) for s in wins} | {"seen": seen_mask}
    for s in evals_type.GROUPED_SETS:
        for g, gname in enumerate(evals_type.GROUPS):
            w = weight[s] * (group[s] == g)
            out[f"{s}_{gname}_acc"] = (wins[s] * w).sum() / w.sum()
    return out
