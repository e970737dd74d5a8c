"""Mirror-swap activation patching on the toy VLM (seed 003, issue 13).

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

Sites: `lm/resid_pre.{layer}` for every LM block (the residual entering it). Token
groups (`GROUPS`): the image tokens, the question tokens, the two object words (X at
question slot 1, Y at slot 6), the last token (the `?` whose logits give the answer),
and every token.

Axis names (`jaxmech.shapes`): B examples, S = L + Q LM tokens, G token groups,
Y patch layers, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis.spatial_ids import X_SLOT, Y_SLOT
from jaxmech.data.scenes import SceneBatch
from jaxmech.models.answer import logits, partner
from jaxmech.models.edits import VLMEdits

GROUPS = ("image", "question", "objects", "last", "all")
OBJECT_SLOTS = (X_SLOT, Y_SLOT)


def token_groups(n_cells: int, n_question: int) -> np.ndarray:
    """[G, S] bool: which LM positions each group (`GROUPS`) patches."""
    S = n_cells + n_question
    pos = np.arange(S)
    objects = np.isin(pos, [n_cells + s for s in OBJECT_SLOTS])
    return np.stack([pos < n_cells, pos >= n_cells, objects, pos == S - 1, np.ones(S, bool)])


def belief_shift(orig, patched, twin, eps: float = 1e-6):
    """(orig - patched) / (orig - twin), NaN where |orig - twin| < eps (no effect to
    explain). Works on log-probabilities or probabilities, any matching shapes."""
    denom = orig - twin
    ok = jnp.abs(denom) >= eps
    return jnp.where(ok, (orig - patched) / jnp.where(ok, denom, 1.0), jnp.nan)


def n_patch_layers(params) -> int:
    """Y: the LM blocks, one site (`lm/resid_pre.{layer}`) each."""
    return sum(1 for k in params["lm"] if k.startswith("block_"))


def _answer_logp(logits_xBxV, answer_B):
    logp = jax.nn.log_softmax(logits_xBxV, axis=-1)
    idx = jnp.broadcast_to(answer_B[:, None], logp.shape[:-1] + (1,))
    return jnp.take_along_axis(logp, idx, axis=-1)[..., 0]


def patch_logp(params, batch: SceneBatch, twin: SceneBatch, groups_GxS) -> dict:
    """Log-probabilities of each example's own answer word, plain and patched.

    Args:
      params: one VLM's params (vmap over stacked ones).
      batch: the examples; twin: their twins (same questions), e.g. `SceneEvalSet.mirror`.
      groups_GxS: bool token groups (`token_groups`).

    Returns:
      {"orig": [B], "twin": [B], "patched": [Y, G, B]} log p(answer_B) under the full
      softmax: the example, the twin, and the example with `lm/resid_pre.{y}` at group
      g's positions taken from the twin's run; "orig_other", "twin_other" [B]: the log
      p of the other word of the relation (`models.answer.partner`), to tell which
      examples each run answers right.
    """
    answer = jnp.asarray(batch.answer_B)
    other = partner(answer)
    twin_logits, twin_aux = logits(params, twin, capture=True)
    orig_logits = logits(params, batch)
    orig, twin_lp = _answer_logp(orig_logits, answer), _answer_logp(twin_logits, answer)
    per_layer = []
    for y in range(n_patch_layers(params)):
        name = f"lm/resid_pre.{y}"

        def patched(mask_S, name=name):
            edits = VLMEdits(replace={name: (mask_S[None, :, None], twin_aux[name])})
            return logits(params, batch, edits)

        per_layer.append(_answer_logp(jax.vmap(patched)(jnp.asarray(groups_GxS)), answer))
    return {
        "orig": orig,
        "twin": twin_lp,
        "patched": jnp.stack(per_layer),
        "orig_other": _answer_logp(orig_logits, other),
        "twin_other": _answer_logp(twin_logits, other),
    }
