"""Steering the toy VLM with its spatial IDs (seed 003, issue 13, part 3).

At one LM site `lm/resid_pre.{y}`, add to the object word X's residual (question slot
`spatial_ids.X_SLOT`) the ID difference

    alpha * (Delta_y(target) - Delta_y(source))

where `Delta_y` is the model's spatial ID (`analysis.spatial_ids.spatial_ids`), source
is X's true cell and target a chosen cell: the model should then answer as if X stood
at the target. `alpha` multiplies the raw ID difference (the paper's convention, where
5 was its grid-searched value); the report also gives the added vector's norm relative
to the residual's, so alphas can be compared across models.

Controls, each matched per example to the steering vector's norm: Gaussian noise, and
a Gaussian direction projected off the ID subspace (`id_span_projector`: the span of
`Delta_y` over the cells that holds `energy` of its variance).

Axis names (`jaxmech.shapes`): B examples, L cells, D d_model, V vocabulary, A alphas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.analysis.spatial_ids import X_SLOT
from jaxmech.data.scenes import SceneBatch
from jaxmech.models.answer import logits, margin
from jaxmech.models.edits import VLMEdits

KINDS = ("id", "noise", "orthogonal")


def at_word(vectors_BxD, n_cells: int, n_question: int, slot: int = X_SLOT):
    """[B, S, D]: each example's vector at question slot `slot`, zeros elsewhere."""
    B, D = vectors_BxD.shape
    out = jnp.zeros((B, n_cells + n_question, D), vectors_BxD.dtype)
    return out.at[:, n_cells + slot].set(vectors_BxD)


def steered_logits(params, batch: SceneBatch, site: int, vectors_BxD, slot: int = X_SLOT):
    """[B, V] the logits with `vectors_BxD` added to `lm/resid_pre.{site}` at the word
    in question slot `slot` (a zero vector is a no-op)."""
    L, Q = batch.labels_BxL.shape[1], batch.question_BxQ.shape[1]
    edits = VLMEdits(add={f"lm/resid_pre.{site}": at_word(vectors_BxD, L, Q, slot)})
    return logits(params, batch, edits)


def id_span_projector(delta_LxD, energy: float = 0.99):
    """[D, D] the orthogonal projector onto the fewest principal directions of the ID
    (rows of `delta_LxD`, uncentred) that hold `energy` of its squared norm."""
    _, s, vt = jnp.linalg.svd(delta_LxD, full_matrices=False)
    share = jnp.cumsum(s**2) / jnp.maximum(jnp.sum(s**2), 1e-30)
    keep = jnp.concatenate([jnp.ones(1, bool), share[:-1] < energy])
    v = vt.T * keep[None, :]
    return v @ v.T


def matched_noise(key, like_BxD, projector_DxD=None):
    """[B, D] Gaussian directions with the norms of `like_BxD`'s rows; with a
    projector P, drawn in the complement of P's range (orthogonal to it)."""
    z = jax.random.normal(key, like_BxD.shape, like_BxD.dtype)
    if projector_DxD is not None:
        z = z - z @ projector_DxD
    norm = jnp.linalg.norm(like_BxD, axis=-1, keepdims=True)
    return z * norm / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-30)


def flip_margins(params, batch, site, delta_LxD, source_B, target_B, alphas, key) -> dict:
    """Answer margins under ID steering and its two norm-matched controls.

    Args:
      params: one VLM's params; batch: the examples [B]; site: y in `lm/resid_pre.{y}`
        (a Python int: static under jit).
      delta_LxD: the model's ID at that site; source_B, target_B: cells (X's own cell,
        the cell to steer it to).
      alphas: [A] multipliers; key: PRNG key of the controls.

    Returns:
      {"plain": [B], kind: [A, B] for kind in KINDS} margins (`models.answer.margin`); "rel_norm"
      [A, B]: |added vector| / |X's residual at the site|.
    """
    answer = jnp.asarray(batch.answer_B)
    plain, aux = logits(params, batch, capture=True)
    x_BxD = aux[f"lm/resid_pre.{site}"][:, batch.labels_BxL.shape[1] + X_SLOT]
    step_BxD = delta_LxD[target_B] - delta_LxD[source_B]
    projector = id_span_projector(delta_LxD)
    k_noise, k_orth = jax.random.split(key)
    noise = matched_noise(k_noise, step_BxD)
    orth = matched_noise(k_orth, step_BxD, projector)

    def at(alpha):
        return {
            kind: margin(steered_logits(params, batch, site, alpha * v), answer)
            for kind, v in zip(KINDS, (step_BxD, noise, orth))
        }

    out = jax.lax.map(at, jnp.asarray(alphas, jnp.float32))
    rel = jnp.linalg.norm(step_BxD, axis=-1) / jnp.maximum(jnp.linalg.norm(x_BxD, axis=-1), 1e-30)
    return out | {
        "plain": margin(plain, answer),
        "rel_norm": jnp.asarray(alphas, jnp.float32)[:, None] * rel[None],
    }


def id_curve(params, batch, site, delta_LxD, source_B, alpha, words):
    """[L, B, W] the logits of `words` (token ids [W]) with X steered from its cell to
    every cell in turn (`alpha * (Delta(target) - Delta(source))`)."""
    words = jnp.asarray(words)

    def to(target):
        v = alpha * (delta_LxD[target] - delta_LxD[source_B])
        return steered_logits(params, batch, site, v)[:, words]

    return jax.lax.map(to, jnp.arange(delta_LxD.shape[0]))
