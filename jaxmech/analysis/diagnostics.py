"""Spatial IDs as a diagnostic of a VLM's errors (paper 003).

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
  Under the authors' protocol (`diagnose(protocol="authors")`, paper 003's
  `compute_coco_stats.py`): their all-pairs axes, the coordinates as dot products with
  the Gram-Schmidt-orthonormalised axes (`plane_coords`: state units, not cells), and
  the sign from the answer word (`answer_signs`).
* Occlusion: the answer margin with X's cell, Y's cell, or a random cell holding
  neither blanked to background (label, colour and facing 0) (`occluded`). In this
  symbolic image a random cell away from the objects is background already, so its
  occlusion is exactly a no-op: the control checks the pipeline, not the model.

A family enters only through its VLM view (`families.vlm_view`); occlusions are scene
specs with a cell left undrawn (`data.spec.occlude`), rendered by the family.

Axis names (`jaxmech.shapes`): B examples, L cells, D d_model, Y sites, O occlusions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import spatial_ids as si
from jaxmech.data.spec import SceneSpec, occlude
from jaxmech.families.vlm_view import Examples, VLMView, margin

OCCLUSIONS = ("x", "y", "random")


def believed_coords(states_BxD, centres_BxD, h_D, v_D) -> jax.Array:
    """[B, 2] (column, row) coordinates of `states - centres` on the axes (h, v)."""
    axes = jnp.stack([h_D, v_D], axis=1)  # [D, 2]
    return (states_BxD - centres_BxD) @ jnp.linalg.pinv(axes).T


def plane_coords(states_BxD, centres_BxD, h_D, v_D) -> jax.Array:
    """[B, 2] paper 003's coordinates (`utils/linalg.py` `project_onto_plane`): the dot
    products of `states - centres` with h normalised and v orthonormalised against it
    (Gram-Schmidt), in units of the state, not cells."""
    u = h_D / jnp.linalg.norm(h_D)
    w = v_D - jnp.dot(v_D, u) * u
    return (states_BxD - centres_BxD) @ jnp.stack([u, w / jnp.linalg.norm(w)], axis=1)


# the coordinates on the ID axes, by protocol
COORDS = {"jaxmech": believed_coords, "authors": plane_coords}


def signed_deviation(believed_x, believed_y, true_x, true_y, relation_B, sign_B=None) -> jax.Array:
    """[B] the believed minus the true X-minus-Y displacement along the question's axis
    (column for relation 0, row for 1), times the sign of the true one (> 0: towards
    the right answer), or times `sign_B` [B] where given (the authors': +1 where the
    answer word is "right" / "below", -1 "left" / "above", `answer_signs`). Arguments
    [B, 2] (column, row)."""
    axis = jnp.asarray(relation_B)[:, None]
    pick = lambda c: jnp.take_along_axis(c, axis, axis=1)[:, 0]  # noqa: E731
    true = pick(true_x - true_y)
    sign = jnp.sign(true) if sign_B is None else jnp.asarray(sign_B)
    return sign * (pick(believed_x - believed_y) - true)


def answer_signs(view: VLMView, ex: Examples) -> jax.Array:
    """[B] +1 where the answer is its relation's second word ("right", "below": X's
    coordinate the larger), else -1: paper 003's `compute_spatial_distance` signs its
    deviation by the caption's word, not by the boxes' displacement."""
    second = jnp.asarray(view.answer_words)[jnp.asarray(ex.spec.relation_B), 1]
    return jnp.where(jnp.asarray(ex.answer_B) == second, 1.0, -1.0)


def random_free_cells(key, cells_Bx2, n_cells: int) -> jax.Array:
    """[B] a uniform random cell other than the two given per example."""
    draw = jax.random.randint(key, cells_Bx2.shape[:1], 0, n_cells - 2)
    lo, hi = jnp.sort(cells_Bx2, axis=1).T
    return draw + (draw >= lo) + (draw + (draw >= lo) >= hi)


def occlusions(spec: SceneSpec, key, n_cells: int) -> list[SceneSpec]:
    """The examples with X's cell, Y's cell and a random free cell blanked
    (`OCCLUSIONS`; `key` draws the random cell)."""
    cells = jnp.asarray(spec.cells_BxK)[:, :2]
    rand = random_free_cells(key, cells, n_cells)
    return [occlude(spec, c) for c in (cells[:, 0], cells[:, 1], rand)]


def _slot_ids(view: VLMView, params, probe: si.Probe, pos_N, grid, batch=None, authors=False):
    """(delta [Y, L, D], label centres [Y, labels, D], h, v [Y, D]) of one word
    (`authors`: their axes, `spatial_ids.grid_axes`)."""
    states = si.word_states(view, params, probe.inputs, pos_N, batch)
    means = si.cell_means(states, probe.label_N, probe.cell_N, grid.cells)
    delta = si.ids_from_means(means)
    return (delta, means.mean(2), *si.grid_axes(delta, *grid, authors=authors))


def _probe_of(pair, slot: int, protocol: str):
    """(probe, its word positions [N]) whose IDs slot `slot`'s word is read against: its
    own slot's (X named first, Y named second), or under the authors' protocol the
    first-named word's for both (their one universal ID, `spatial_id_derivation/`)."""
    if protocol == "authors":
        return pair[0], pair[0].spans.x_B
    return pair[slot], (pair[0].spans.x_B, pair[1].spans.y_B)[slot]


def _word_coords(state_YxBxD, ex: Examples, ids, slot: int, where=None, protocol="jaxmech"):
    """(believed [Y', B, 2], true [Y', B, 2]) (column, row) of one object word (slot 0 X,
    1 Y; its states at every site `state_YxBxD`) at sites 1.., from one probe's IDs `ids`
    (`_slot_ids`), on the `protocol`'s coordinates (`COORDS`).
    `where`: ([Y, B, D] the word's centre at every site, [B, L] weights over the cells
    its true ID is averaged with; a photograph's: its text-only state, its box centre
    between cells), or None: its spec label's centre and its cell's ID."""
    coords_of = COORDS[protocol]
    delta, centres, h, v = ids
    if where is None:
        label = jnp.asarray(ex.spec.labels_BxK)[:, slot] - 1  # 0-based: the centres' order
        cell = jnp.asarray(ex.spec.cells_BxK)[:, slot]
        centre, at = (lambda y: centres[y][label]), (lambda y: delta[y][cell])
    else:
        own, cell_w = (jnp.asarray(w) for w in where)
        centre, at = (lambda y: own[y]), (lambda y: cell_w @ delta[y])
    sites = range(1, delta.shape[0])
    believed = [coords_of(state_YxBxD[y], centre(y), h[y], v[y]) for y in sites]
    true = [coords_of(at(y), 0.0, h[y], v[y]) for y in sites]
    return jnp.stack(believed), jnp.stack(true)


def question_states(view: VLMView, params, ex: Examples, batch=None):
    """([B] answer margins, [2, Y, B, D] X's and Y's word states at every site) of the
    examples, `batch` at a time (`spatial_ids.map_chunks`: one chunk's intermediates
    held at once)."""
    n = view.n_lm_blocks(params)
    sites = [si.resid_site(y, n) for y in range(n + 1)]

    def chunk(rows):
        at = lambda x: si.take_rows(x, rows)  # noqa: E731
        logits, aux = view.forward(params, at(ex.inputs), capture=sites)
        words = [si.states_at(aux, n, at(w)) for w in (ex.spans.x_B, ex.spans.y_B)]
        return margin(logits, at(ex.answer_B), at(ex.other_B)), jnp.moveaxis(jnp.stack(words), 2, 0)

    m, words = si.map_chunks(chunk, np.shape(ex.answer_B)[0], batch)
    return m, jnp.moveaxis(words, 0, 2)


def _per_relation(coords_R, relation_B):
    """[Y', B, 2] each example's coordinates from its own relation's probes, of
    R stacked [R, Y', B, 2] (R = 1: one set of probes for every relation)."""
    if len(coords_R) == 1:
        return coords_R[0]
    stacked = jnp.stack(coords_R)
    return jnp.moveaxis(stacked[relation_B, :, jnp.arange(relation_B.shape[0])], 0, 1)


def diagnose(view: VLMView, params, ex: Examples, probes, occluded_inputs, batch=None,
             cell_weights=None, text: Examples | None = None,
             protocol: str = "jaxmech") -> dict:  # fmt: skip
    """One model's diagnostics on the examples `ex` (questions about X and Y).

    Args:
      view: the family's VLM view; params: one model's params.
      probes: per relation r of the examples (0 horizontal, 1 vertical), a pair of
        `spatial_ids.Probe`s in r's question template, naming the probed label first
        (X) and second (Y) (host arrays: close over them under jit); every label 1..n
        must be probed. Each example's words are read against its own relation's IDs:
        Y's word follows the relation's words, so its state depends on the template.
        Under the authors' protocol only each pair's first probe is read, for both
        words (`_probe_of`); one pair (`[[probe]]`) serves every relation.
      occluded_inputs: the examples under each of `OCCLUSIONS` (`occlusions`), rendered
        and stacked [O, ...].
      batch: scenes per chunk of every forward, the probes' (`spatial_ids.word_states`)
        and the examples' (`question_states`); None: all at once.
      cell_weights, text: a photograph's objects, which are no probed label: [B, 2, L]
        X's and Y's true positions as weights over the cells (its box centres,
        `reports.batches.box_weights`) and the questions asked without the image (their
        words' states the centres, as paper 003's `compute_coco_stats.py`); None: the
        spec's cells and labels' centres.
      protocol: "jaxmech" (least squares on the one-step axes, in cells, signed by the
        true displacement) or "authors" (their all-pairs axes, `plane_coords`, signed
        by the answer word: `answer_signs`).

    Returns:
      {"margin": [B], "occluded": [O, B] margins (`OCCLUSIONS`), "deviation": [Y', B]
      (`signed_deviation`) at sites 1.. (every site after the first LM block),
      "believed", "true": [Y', B, 2] X-minus-Y displacements (column, row)}.
    """
    if protocol not in COORDS:
        raise ValueError(f"protocol = {protocol!r}: expected one of {sorted(COORDS)}")
    plain, states = question_states(view, params, ex, batch=batch)
    rel = jnp.asarray(ex.spec.relation_B)
    coords = []  # per word: (believed [Y', B, 2], true [Y', B, 2])
    text_states = None if text is None else question_states(view, params, text, batch)[1]
    ids = {}  # per (probe, word read): its IDs, computed once (the authors' serve both words)

    def ids_of(pair, slot):
        pr, pos = _probe_of(pair, slot, protocol)
        key = (id(pr), id(pos))
        if key not in ids:
            ids[key] = _slot_ids(view, params, pr, pos, view.grid, batch, protocol == "authors")
        return ids[key]

    for slot in (0, 1):
        where = None
        if cell_weights is not None:
            where = (text_states[slot], jnp.asarray(cell_weights)[:, slot])
        per = [_word_coords(states[slot], ex, ids_of(pair, slot), slot, where, protocol)
               for pair in probes]  # fmt: skip
        coords.append(tuple(_per_relation([c[i] for c in per], rel) for i in (0, 1)))
    (bx, tx), (by, ty) = coords
    sign = answer_signs(view, ex) if protocol == "authors" else None
    deviation = jax.vmap(signed_deviation, (0, 0, 0, 0, None, None))(bx, by, tx, ty, rel, sign)

    def occluded(inputs):
        def chunk(rows):
            at = lambda x: si.take_rows(x, rows)  # noqa: E731
            return margin(view.forward(params, at(inputs))[0], at(ex.answer_B), at(ex.other_B))

        return si.map_chunks(chunk, np.shape(ex.answer_B)[0], batch)

    return {
        "deviation": deviation,
        "believed": bx - by,
        "true": tx - ty,
        "occluded": jax.lax.map(occluded, occluded_inputs),
        "margin": plain,
    }
