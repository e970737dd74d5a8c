"""The spatial-ID loss's maths (paper 003), shared by every family that trains with it
(the toy VLM's training loss, `families.toy_vlm.id_loss`; a checkpoint's fine-tune,
`reports.id_finetune`): the cosine of an ID predicted from object-word states against a
target ID, both centred over the cells.

Axis names (`jaxmech.shapes`): P object pairs, L cells, D width.
"""

from __future__ import annotations

import jax.numpy as jnp


def id_cos(states_PxLxD, target_LxD):
    """[P, L] cos(ID_pred, ID_true): states centred over the cells against the centred
    target (a small epsilon keeps the gradient finite at a zero vector)."""
    pred = states_PxLxD - states_PxLxD.mean(1, keepdims=True)
    target = target_LxD - target_LxD.mean(0)
    norm = lambda v: jnp.sqrt((v**2).sum(-1) + 1e-12)  # noqa: E731
    return (pred * target).sum(-1) / (norm(pred) * norm(target))
