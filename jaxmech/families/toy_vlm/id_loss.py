"""The spatial-ID loss (paper 003): `1 - cos(ID_pred, ID_true)` at one LM site.

Where: LM site y = `id_site` (the residual entering LM block y; y = lm_n_layers is the
last block's output: `model.site_name`), at the first-named object's word (question
slot `X_SLOT`). Site 0, the embedding, cannot depend on the image and is refused.

ID_pred: each of the batch's last `n_pairs` rows gives one object pair (X, Y), which is
put back with X at every cell, Y where it was (at the next cell when X lands on it), X
and Y keeping their colours and facings: L probe rows per pair (`pair_probe`). The
state at X's word, centred over X's L cells, is the pair's ID at each cell: the mean
over the cells removes what depends on X's label and on Y, as in the paper's
"mean-centred object-word states of a batch that holds one object pair". Because X's
word comes before the rest of the question and the LM is causal, only `is X` and the
image matter.

ID_true: `static/id_target [L, D]` (centred over the cells here). `init_params` plants
one when id_site > 0 (`model.planted_id_target`: training from scratch has no model to extract
from); fine-tuning replaces it with the ID extracted from the model itself beforehand
(`analysis.spatial_ids`; `experiments.id_loss --base=RUN`).

Axis names (`jaxmech.shapes`): B batch rows, P pairs, L cells, D d_model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.data.tasks.scenes import TOKEN, X_SLOT, Y_SLOT, SceneBatch
from jaxmech.families.toy_vlm import model
from jaxmech.families.toy_vlm.vit import read
from jaxmech.models.id_loss import id_cos

ID_PAIRS = 2  # pairs per training step: 2 L probe rows (32 on a 4 x 4 grid)


def pair_probe(batch: SceneBatch, n_pairs: int) -> SceneBatch:
    """[n_pairs L] probe rows (module docstring): row p L + c has pair p's X at cell c.

    A single-object row (Y named `mid`) gives X alone; a row whose X is named but not
    shown still puts X at every cell (colour and facing 1)."""
    rows = jax.tree_util.tree_map(lambda a: a[-n_pairs:], batch)
    P, L = rows.labels_BxL.shape
    first = TOKEN["mid"]  # label l is token 10 + l, so `mid` (10) reads as label 0
    x_lab = rows.question_BxQ[:, X_SLOT] - first
    y_lab = jnp.maximum(rows.question_BxQ[:, Y_SLOT] - first, 0)

    def attrs(label_P):
        here = (rows.labels_BxL == label_P[:, None]) & (label_P[:, None] > 0)
        colour = jnp.maximum((rows.colours_BxL * here).sum(1), 1)
        facing = jnp.maximum((rows.facings_BxL * here).sum(1), 1)
        return here.any(1), jnp.argmax(here, 1), colour, facing

    _, _, x_col, x_face = attrs(x_lab)
    y_on, y_cell, y_col, y_face = attrs(y_lab)
    cells = jnp.arange(L)
    y_cell_PxL = jnp.where(y_cell[:, None] == cells, (y_cell[:, None] + 1) % L, y_cell[:, None])
    x_here = cells[None, :, None] == cells[None, None, :]  # [1, L probe rows, L cells]
    y_here = (y_cell_PxL[:, :, None] == cells) & y_on[:, None, None]

    def paint(x_val, y_val):
        img = jnp.where(x_here, x_val[:, None, None], 0) + jnp.where(
            y_here, y_val[:, None, None], 0
        )
        return img.reshape(P * L, L).astype(jnp.int32)

    repeat = lambda a: jnp.repeat(a, L, axis=0)  # noqa: E731
    return SceneBatch(
        paint(x_lab, y_lab),
        paint(x_col, y_col),
        paint(x_face, y_face),
        repeat(rows.question_BxQ),
        repeat(rows.answer_B),
        repeat(rows.relation_B),
    )


def id_states(params, probe: SceneBatch, site: int):
    """[P, L, D] the residual at X's word at LM site `site`, per pair and X's cell.

    One capture forward; under jit, what the site does not depend on is never computed
    (and no gradient reaches the blocks after it)."""
    _, aux = model.forward(
        params,
        probe.labels_BxL,
        probe.colours_BxL,
        probe.facings_BxL,
        probe.question_BxQ,
        capture=True,
    )
    L = probe.labels_BxL.shape[1]
    h = aux[model.site_name(site, model.n_lm_blocks(params))][:, L + X_SLOT]
    return h.reshape(-1, L, h.shape[-1])


def id_loss(params, batch: SceneBatch, site: int, n_pairs: int = ID_PAIRS):
    """[] mean over the probe of `1 - cos(ID_pred, ID_true)` (module docstring)."""
    if site < 1:
        raise ValueError(f"id_site = {site}: expected an LM site >= 1 (site 0 sees no image)")
    states = id_states(params, pair_probe(batch, n_pairs), site)
    return (1.0 - id_cos(states, read(params, "id_target"))).mean()
