"""Accuracies and answer beliefs of a question-answering model on the scenes sets.

Per validation set (`data.scenes.SceneEvalSets`: seen_pair, unseen_pair, train_pair,
single) and relation (h: left/right, v: above/below): the accuracy (the answer word
beats the other word of its relation), and, on the unseen pairs, the mean probability
and log-probability of the answer word (`models.answer.beliefs`). Rows are weighted by
the model's own set membership (`data.scenes.eval_masks`: seen and train pairs depend
on its sweepable settings), so one compiled evaluation serves every model of a sweep.

`unseen_min_acc` (the smaller of the two unseen-pair accuracies) is the progress
metric: issue 12's target is both relations above 0.9 on unseen pairs.

Axis names (`jaxmech.shapes`): N rows of a set.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.config import Settings
from jaxmech.data.scenes import RELATIONS, SceneEvalSets, eval_masks
from jaxmech.models.answer import beliefs, logits

SETS = {"seen_pair": "seen", "unseen_pair": "unseen", "train_pair": "train", "single": "single"}
BELIEF_SETS = ("unseen",)


def metric_names() -> tuple[str, ...]:
    """The curves' metric columns, in order."""
    names = ["unseen_min_acc"]
    names += [f"{short}_{r}_acc" for short in SETS.values() for r in RELATIONS]
    names += [f"{s}_{r}_{b}" for s in BELIEF_SETS for r in RELATIONS for b in ("p", "logp")]
    return tuple(names)


def masked_mean(values_N, weight_N):
    """Mean of values over the rows with weight (0 when none)."""
    return (values_N * weight_N).sum() / jnp.maximum(weight_N.sum(), 1.0)


def evaluate_scenes(params, evals: SceneEvalSets, tables, settings: Settings, config) -> dict:
    """{metric: []} for one model (`metric_names`); a pure function, vmapped by training."""
    del tables, config
    masks = eval_masks(evals, settings)
    out = {}
    for name, short in SETS.items():
        batch = getattr(evals, name).examples
        b = beliefs(logits(params, batch), jnp.asarray(batch.answer_B))
        for r, rel in enumerate(RELATIONS):
            w = (masks[name] & (jnp.asarray(batch.relation_B) == r)).astype(jnp.float32)
            out[f"{short}_{rel}_acc"] = masked_mean(b["correct"], w)
            if short in BELIEF_SETS:
                out[f"{short}_{rel}_p"] = masked_mean(b["p"], w)
                out[f"{short}_{rel}_logp"] = masked_mean(b["logp"], w)
    out["unseen_min_acc"] = jnp.minimum(out["unseen_h_acc"], out["unseen_v_acc"])
    return out
