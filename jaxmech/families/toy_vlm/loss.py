"""The autoregressive VLM's objective and beliefs: one answer token after the question.

Training is next-token cross-entropy on the answer token (the LM's logits at the last
question position, over the whole vocabulary). Evaluation reads two kinds of numbers,
because papers 003 / 004 measure beliefs, not only accuracy:

* correct: the answer word's logit beats the other word of its relation (left vs
  right, above vs below): chance 0.5, the SPEC convention of scoring against the
  swapped alternative;
* p, logp: the probability and log-probability of the answer word under the full
  softmax over the vocabulary.

Axis names (`jaxmech.shapes`): B examples, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.data.tasks.scenes import TOKEN, SceneBatch
from jaxmech.families.toy_vlm import id_loss, model

# Each relation's (first, second) answer word, by relation id (`data.spec`: 0 h, 1 v,
# 2 presence), and the other word of each, indexed by token id (other ids map to 0 and
# are never answers).
ANSWER_WORDS = np.asarray(
    [[TOKEN[a], TOKEN[b]] for a, b in (("left", "right"), ("above", "below"), ("yes", "no"))],
    np.int32,
)
_PARTNER = np.zeros(ANSWER_WORDS.max() + 1, np.int32)
_PARTNER[ANSWER_WORDS[:, 0]], _PARTNER[ANSWER_WORDS[:, 1]] = ANSWER_WORDS[:, 1], ANSWER_WORDS[:, 0]


def partner(answer_B):
    """The other answer word of each example's relation (token ids)."""
    return jnp.asarray(_PARTNER)[answer_B]


def logits(params, batch: SceneBatch, edits=None):
    """[B, V] the LM's logits at the last position for a batch of scenes and questions
    (`model.forward`'s first output)."""
    return model.forward(
        params,
        batch.labels_BxL,
        batch.colours_BxL,
        batch.facings_BxL,
        batch.question_BxQ,
        edits=edits,
    )[0]


def answer_loss(params, batch: SceneBatch, tables, settings, config) -> jax.Array:
    """The family's training loss: the mean cross-entropy of the answer token (against
    a target smoothed by `label_smoothing` when that is set), plus `settings.id_weight`
    times the spatial-ID loss at LM site `id_site` when that is set
    (`families.toy_vlm.id_loss`; with id_site 0 the ID loss is not computed at all)."""
    del tables
    logp_BxV = jax.nn.log_softmax(logits(params, batch), axis=-1)
    ce = -jnp.take_along_axis(logp_BxV, batch.answer_B[:, None], axis=-1).mean()
    eps = config.model.label_smoothing
    if eps > 0:  # a static branch: at 0 the loss is the plain program's
        ce = (1.0 - eps) * ce - eps * logp_BxV.mean()
    if config.model.id_site == 0:
        return ce
    # At weight 0 no gradient enters the ID path at all (not even zeros, which XLA
    # could sum with the answer's in another order): such a model trains as the plain.
    w = settings.id_weight
    sg = jax.tree_util.tree_map(lambda x: jnp.where(w > 0, x, jax.lax.stop_gradient(x)), params)
    return ce + w * id_loss.id_loss(sg, batch, config.model.id_site)


def beliefs(logits_BxV, answer_B) -> dict:
    """{correct, p, logp} [B] of the answer word (module docstring)."""
    logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
    logp = jnp.take_along_axis(logp_BxV, answer_B[:, None], axis=-1)[:, 0]
    other = jnp.take_along_axis(logits_BxV, partner(answer_B)[:, None], axis=-1)[:, 0]
    true = jnp.take_along_axis(logits_BxV, answer_B[:, None], axis=-1)[:, 0]
    return {"correct": (true > other).astype(jnp.float32), "p": jnp.exp(logp), "logp": logp}
