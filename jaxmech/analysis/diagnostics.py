"""Spatial IDs as a diagnostic of the toy VLM's errors (seed 003, issue 13, part 4).

* ID deviation: at a site y, each object word's state minus its label's centre (the
  mean state of that label over all cells, from probe scenes naming the label in that
  word's slot) is projected on that slot's ID grid axes `[h_y, v_y]` (least squares),
  which gives the word's believed grid coordinates in cells; the slot's true ID
  `Delta_y(cell)` projected the same way gives the coordinates the model would believe
  if its ID were right (X and Y words have IDs of their own: they sit at different
  places in the question). For a question about X and
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
from jaxmech.models.answer import logits, margin

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


def _slot_ids(params, probe, slot: int, grid):
    """(delta [Y, L, D], label centres [Y, labels, D], h, v [Y, D]) of one slot's word."""
    p_batch, p_label, p_cell = probe
    L = p_batch.labels_BxL.shape[1]
    means = si.cell_means(si.object_word_states(params, p_batch, slot), p_label, p_cell, L)
    delta = si.ids_from_means(means)
    return (delta, means.mean(2), *si.grid_axes(delta, *grid))


def diagnose(params, batch, cells_Bx2, probes, key, grid: tuple[int, int]) -> dict:
    """One model's diagnostics on `batch` (questions about X and Y at `cells_Bx2`).

    Args:
      probes: two (SceneBatch, label_N, cell_N) from `spatial_ids.probe_scenes`, naming
        the probed label as X and as Y (host arrays: close over them under jit); every
        label 1..n must be probed. key: PRNG key of the random occlusion. grid: (H, W),
        static.

    Returns:
      {"margin": [B], "occluded": [O, B] margins (`OCCLUSIONS`), "deviation": [Y', B]
      (`signed_deviation`) at sites 1.. (every site after the first LM block),
      "believed", "true": [Y', B, 2] X-minus-Y displacements (column, row)}.
    """
    L = batch.labels_BxL.shape[1]
    q = jnp.asarray(batch.question_BxQ)
    plain, aux = logits(params, batch, capture=True)  # the one forward of the examples
    coords = []  # per word: (believed [Y', B, 2], true [Y', B, 2])
    for probe, slot, cell in zip(probes, (si.X_SLOT, si.Y_SLOT), cells_Bx2.T):
        delta, centres, h, v = _slot_ids(params, probe, slot, grid)
        state = si.states_at(aux, si.n_sites(params) - 1, L + slot)
        label = q[:, slot] - label_token(1)  # 0-based: the centres' order
        sites = range(1, delta.shape[0])
        coords.append(
            (
                jnp.stack(
                    [believed_coords(state[y], centres[y][label], h[y], v[y]) for y in sites]
                ),
                jnp.stack([believed_coords(delta[y][cell], 0.0, h[y], v[y]) for y in sites]),
            )
        )
    (bx, tx), (by, ty) = coords
    deviation = jax.vmap(signed_deviation, (0, 0, 0, 0, None))(bx, by, tx, ty, batch.relation_B)
    answer = jnp.asarray(batch.answer_B)
    rand = random_free_cells(key, cells_Bx2, L)
    occ = [cells_Bx2[:, 0], cells_Bx2[:, 1], rand]
    return {
        "deviation": deviation,
        "believed": bx - by,
        "true": tx - ty,
        "occluded": jnp.stack([margin(logits(params, occlude(batch, c)), answer) for c in occ]),
        "margin": margin(plain, answer),
    }
