"""Spatial IDs as a diagnostic of the toy VLM's errors (seed 003, issue 13, part 4).

* ID deviation: at a site y, the object words' states minus their label's centre (the
  mean state of that label over all cells, from probe scenes) are projected on the
  ID's grid axes `[h_y, v_y]` (least squares), which gives each word's believed grid
  coordinates in cells; the true ID `Delta_y(cell)` projected the same way gives the
  coordinates the model would believe if its ID were right. For a question about X and
  Y along an axis, the deviation is the believed X-minus-Y displacement minus the true
  one along that axis, signed so that a positive value points the way of the right
  answer (`signed_deviation`). Wrong answers with negative deviations are errors of
  the ID, not of the read-out.
* Occlusion: the answer margin with X's cell, Y's cell, or a random cell holding
  neither blanked to background (label, colour and facing 0) (`occluded`). In this
  symbolic image a random cell away from the objects is background already, so its
  occlusion is exactly a no-op: the control checks the pipeline, not the model.

Axis names (`jaxmech.shapes`): B examples, L cells, D d_model, Y sites, O occlusions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.analysis import spatial_ids as si
from jaxmech.data.scenes import SceneBatch, label_token
from jaxmech.models.answer import logits, partner

OCCLUSIONS = ("x", "y", "random")


def believed_coords(states_BxD, centres_BxD, h_D, v_D) -> jax.Array:
    """[B, 2] (column, row) coordinates of `states - centres` on the axes (h, v)."""
    axes = jnp.stack([h_D, v_D], axis=1)  # [D, 2]
    return (states_BxD - centres_BxD) @ jnp.linalg.pinv(axes).T


def signed_deviation(believed_x, believed_y, true_x, true_y, relation_B) -> jax.Array:
    """[B] the believed minus the true X-minus-Y displacement along the question's axis
    (column for relation 0, row for 1), times the sign of the true one (> 0: towards
    the right answer). Arguments [B, 2] (column, row)."""
    axis = jnp.asarray(relation_B)[:, None]
    pick = lambda c: jnp.take_along_axis(c, axis, axis=1)[:, 0]  # noqa: E731
    true = pick(true_x - true_y)
    return jnp.sign(true) * (pick(believed_x - believed_y) - true)


def occlude(batch: SceneBatch, cell_B) -> SceneBatch:
    """`batch` with each example's cell `cell_B` blanked to background."""
    hit = jnp.arange(batch.labels_BxL.shape[1])[None, :] == jnp.asarray(cell_B)[:, None]
    blank = lambda x: jnp.where(hit, 0, jnp.asarray(x))  # noqa: E731
    return batch._replace(
        labels_BxL=blank(batch.labels_BxL),
        colours_BxL=blank(batch.colours_BxL),
        facings_BxL=blank(batch.facings_BxL),
    )


def random_free_cells(key, cells_Bx2, n_cells: int) -> jax.Array:
    """[B] a uniform random cell other than the two given per example."""
    draw = jax.random.randint(key, cells_Bx2.shape[:1], 0, n_cells - 2)
    lo, hi = jnp.sort(cells_Bx2, axis=1).T
    return draw + (draw >= lo) + (draw + (draw >= lo) >= hi)


def margin(logits_BxV, answer_B):
    """[B] logit(answer) - logit(the other word of its relation)."""
    pick = lambda t: jnp.take_along_axis(logits_BxV, t[:, None], axis=-1)[:, 0]  # noqa: E731
    return pick(answer_B) - pick(partner(answer_B))


def diagnose(params, batch, cells_Bx2, probe, key, grid: tuple[int, int]) -> dict:
    """One model's diagnostics on `batch` (questions about X and Y at `cells_Bx2`).

    Args:
      probe: (SceneBatch, label_N, cell_N) from `spatial_ids.probe_scenes` (the IDs and
        the label centres). key: PRNG key of the random occlusion. grid: (H, W), static.

    Returns:
      {"margin": [B], "occluded": [O, B] margins (`OCCLUSIONS`), "deviation": [Y', B]
      (`signed_deviation`) at sites 1.. (every site after the first LM block),
      "believed", "true": [Y', B, 2] X-minus-Y displacements (column, row)}.
    """
    p_batch, p_label, p_cell = probe
    L = batch.labels_BxL.shape[1]
    means = si.cell_means(si.object_word_states(params, p_batch), p_label, p_cell, L)
    delta = (means - means.mean(2, keepdims=True)).mean(1)  # [Y, L, D]
    centres = means.mean(2)  # [Y, labels, D], labels 1..n in order
    h, v = si.grid_axes(delta, *grid)
    q = jnp.asarray(batch.question_BxQ)
    lab = [q[:, s] - label_token(1) for s in (si.X_SLOT, si.Y_SLOT)]  # 0-based labels
    word = [si.object_word_states(params, batch, s) for s in (si.X_SLOT, si.Y_SLOT)]
    out = {"deviation": [], "believed": [], "true": []}
    for y in range(1, delta.shape[0]):
        bx, by = (believed_coords(w[y], centres[y][i], h[y], v[y]) for w, i in zip(word, lab))
        tx, ty = (believed_coords(delta[y][cells_Bx2[:, k]], 0.0, h[y], v[y]) for k in (0, 1))
        out["deviation"].append(signed_deviation(bx, by, tx, ty, batch.relation_B))
        out["believed"].append(bx - by)
        out["true"].append(tx - ty)
    out = {k: jnp.stack(x) for k, x in out.items()}
    answer = jnp.asarray(batch.answer_B)
    rand = random_free_cells(key, cells_Bx2, L)
    occ = [cells_Bx2[:, 0], cells_Bx2[:, 1], rand]
    out["occluded"] = jnp.stack([margin(logits(params, occlude(batch, c)), answer) for c in occ])
    out["margin"] = margin(logits(params, batch), answer)
    return out
