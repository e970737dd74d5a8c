"""Mirror-swap activation patching (seed 003, issue 13), for any VLM family.

Run an example and its counterfactual twin (the width mirror; the recolour twin as the
control) with the same question; at one LM layer, replace the example's residual
stream at one group of token positions by the twin's, finish the forward, and ask how
far the answer moved towards the twin's. With log-probabilities of the example's own
answer word a (the authors' code):

    shift = (lp_orig(a) - lp_patched(a)) / (lp_orig(a) - lp_twin(a))

0: the patch changed nothing; 1: the patched run believes what the twin run believes.
The paper's formula is the same with probabilities. For the recolour control the
denominator is the mirror's (a recolour leaves the answer, so its own denominator is
~0): the control's shift says how much of the mirror's effect a patch of equal size
but no spatial content produces.

A family enters only through its VLM view (`families.vlm_view`): its forward, its
spans and its LM's blocks. Sites: `lm/resid_pre.{layer}` for every LM block (the
residual entering it). Token groups (`GROUPS`, from the spans): the image tokens, the
question tokens, the two object words (the last sub-token of each), the answer
position, and every token.

Axis names (`jaxmech.shapes`): B examples, S LM tokens, G token groups, Y patch
layers, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.families.vlm_view import Spans, VLMView
from jaxmech.models.edits import Edits

GROUPS = ("image", "question", "objects", "last", "all")


def token_groups(spans: Spans) -> np.ndarray:
    """[G, B, S] bool: which LM positions each group (`GROUPS`) patches, per example."""
    B, S = np.asarray(spans.question_BxS).shape
    pos = np.arange(S)[None, :]
    at = lambda p_B: pos == np.asarray(p_B)[:, None]  # noqa: E731
    image = (pos[..., None] == np.asarray(spans.image_BxI)[:, None, :]).any(-1)
    objects = at(spans.x_B) | at(spans.y_B)
    every = np.ones((B, S), bool)
    return np.stack([image, np.asarray(spans.question_BxS), objects, at(spans.answer_B), every])


def belief_shift(orig, patched, twin, eps: float = 1e-6):
    """(orig - patched) / (orig - twin), NaN where |orig - twin| < eps (no effect to
    explain). Works on log-probabilities or probabilities, any matching shapes."""
    denom = orig - twin
    ok = jnp.abs(denom) >= eps
    return jnp.where(ok, (orig - patched) / jnp.where(ok, denom, 1.0), jnp.nan)


def _answer_logp(logits_xBxV, answer_B):
    logp = jax.nn.log_softmax(logits_xBxV, axis=-1)
    idx = jnp.broadcast_to(answer_B[:, None], logp.shape[:-1] + (1,))
    return jnp.take_along_axis(logp, idx, axis=-1)[..., 0]


def patch_logp(view: VLMView, params, inputs, twin_inputs, groups_GxBxS, answer_B, other_B) -> dict:
    """Log-probabilities of each example's own answer word, plain and patched.

    Args:
      view: the family's VLM view; params: one model's params (vmap over stacked ones).
      inputs, twin_inputs: the examples and their twins rendered by `view.render` (the
        same questions, so the same spans), e.g. the mirror twins.
      groups_GxBxS: bool token groups (`token_groups` of the examples' spans).
      answer_B, other_B: each example's answer word and the other word of its relation
        (`families.vlm_view.answer_ids`).

    Returns:
      {"orig": [B], "twin": [B], "patched": [Y, G, B]} log p(answer_B) under the full
      softmax: the example, the twin, and the example with `lm/resid_pre.{y}` at group
      g's positions taken from the twin's run; "orig_other", "twin_other" [B]: the log
      p of the other word, to tell which examples each run answers right.
    """
    answer, other = jnp.asarray(answer_B), jnp.asarray(other_B)
    twin_logits, twin_aux = view.forward(params, twin_inputs, capture=True)
    orig_logits, _ = view.forward(params, inputs)
    orig, twin_lp = _answer_logp(orig_logits, answer), _answer_logp(twin_logits, answer)
    per_layer = []
    for y in range(view.n_lm_blocks(params)):
        name = f"lm/resid_pre.{y}"

        def patched(mask_BxS, name=name):
            edits = Edits(replace={name: (mask_BxS[:, :, None], twin_aux[name])})
            return view.forward(params, inputs, edits)[0]

        per_layer.append(_answer_logp(jax.vmap(patched)(jnp.asarray(groups_GxBxS)), answer))
    return {
        "orig": orig,
        "twin": twin_lp,
        "patched": jnp.stack(per_layer),
        "orig_other": _answer_logp(orig_logits, other),
        "twin_other": _answer_logp(twin_logits, other),
    }
