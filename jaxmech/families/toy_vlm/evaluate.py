"""Accuracies and answer beliefs of a question-answering model on the scenes sets.

Per validation set (`data.tasks.scenes.SceneEvalSets`: seen_pair, unseen_pair, train_pair,
single) and relation of the task (`data.tasks.Task.answer_relations`; scenes: h
left/right, v above/below; video: t before/after): the accuracy (the answer word
beats the other word of its relation), and, on the unseen pairs, the mean probability
and log-probability of the answer word (`families.toy_vlm.loss.beliefs`). Rows are weighted by
the model's own set membership (`data.tasks.scenes.eval_masks`: seen and train pairs depend
on its sweepable settings), so one compiled evaluation serves every model of a sweep.

`unseen_min_acc` (the smallest unseen-pair accuracy over the relations) is the
progress metric: the target is both relations above 0.9 on unseen pairs.

With the spatial-ID loss on (`id_site` > 0), `id_loss_train` / `id_loss_unseen` are
its value (`families.toy_vlm.id_loss`) on probes built from `ID_EVAL_PAIRS` rows spread over the
training-pair / unseen-pair set (`id_eval_rows`): how far the pairs' IDs are from the target, for
labels trained in pairs and for validation labels.

Axis names (`jaxmech.shapes`): N rows of a set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Config, Settings
from jaxmech.data.tasks import get_task
from jaxmech.data.tasks.scenes import SceneEvalSets, eval_masks
from jaxmech.families.toy_vlm.id_loss import id_loss
from jaxmech.families.toy_vlm.loss import beliefs, logits

SETS = {"seen_pair": "seen", "unseen_pair": "unseen", "train_pair": "train", "single": "single"}
BELIEF_SETS = ("unseen",)
ID_SETS = {"train_pair": "id_loss_train", "unseen_pair": "id_loss_unseen"}
ID_EVAL_PAIRS = 8


def id_eval_rows(n_rows: int) -> np.ndarray:
    """The ID_EVAL_PAIRS rows of an eval set whose pairs probe the ID loss: spread evenly
    over the set (its rows are sorted by pair, so the first few share one pair)."""
    return np.linspace(0, n_rows - 1, ID_EVAL_PAIRS).astype(np.int32)


def relations(config: Config) -> tuple[tuple[str, int], ...]:
    """((metric name, relation id), ...) the task asks about."""
    return get_task(config.task.task_kind).answer_relations


def metric_names(config: Config) -> tuple[str, ...]:
    """The curves' metric columns, in order."""
    rels = [name for name, _ in relations(config)]
    names = ["unseen_min_acc"]
    names += [f"{short}_{r}_acc" for short in SETS.values() for r in rels]
    names += [f"{s}_{r}_{b}" for s in BELIEF_SETS for r in rels for b in ("p", "logp")]
    if config.model.id_site > 0:
        names += list(ID_SETS.values())
    return tuple(names)


def masked_mean(values_N, weight_N):
    """Mean of values over the rows with weight (0 when none)."""
    return (values_N * weight_N).sum() / jnp.maximum(weight_N.sum(), 1.0)


def evaluate_scenes(params, evals: SceneEvalSets, tables, settings: Settings, config) -> dict:
    """{metric: []} for one model (`metric_names`); a pure function, vmapped by training."""
    del tables
    masks = eval_masks(evals, settings)
    rels = relations(config)
    sets = [getattr(evals, name).examples for name in SETS]
    # one forward over the sets' rows: a quarter of the evaluation's code in a training
    # program (whose compile it dominated), the same per-row logits up to rounding
    joined = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *sets)
    every = beliefs(logits(params, joined), jnp.asarray(joined.answer_B))
    bounds = np.cumsum([0] + [len(batch.answer_B) for batch in sets])
    out = {}
    for (name, short), batch, lo, hi in zip(SETS.items(), sets, bounds[:-1], bounds[1:]):
        b = {k: v[lo:hi] for k, v in every.items()}
        for rel, r in rels:
            w = (masks[name] & (jnp.asarray(batch.relation_B) == r)).astype(jnp.float32)
            out[f"{short}_{rel}_acc"] = masked_mean(b["correct"], w)
            if short in BELIEF_SETS:
                out[f"{short}_{rel}_p"] = masked_mean(b["p"], w)
                out[f"{short}_{rel}_logp"] = masked_mean(b["logp"], w)
    out["unseen_min_acc"] = jnp.stack([out[f"unseen_{rel}_acc"] for rel, _ in rels]).min()
    if config.model.id_site > 0:
        for name, metric in ID_SETS.items():
            rows = jax.tree_util.tree_map(
                lambda a: jnp.asarray(a)[id_eval_rows(a.shape[0])], getattr(evals, name).examples
            )
            out[metric] = id_loss(params, rows, config.model.id_site, ID_EVAL_PAIRS)
    return out
