"""Spatial IDs of the toy VLM (seed 003, issue 13, part 2).

Put an object X at every cell (another object Y elsewhere, several placements), ask
`is X left or right of Y ?`, and read the LM's residual stream at X's word. Centred per
object over the cells and averaged over objects, this gives the spatial ID
`Delta_y(cell)` at each site y (`lm/resid_pre.{y}` for every LM block, then the last
block's output): the part of the object word's state that depends only on where its
object is. Grid differences give a horizontal and a vertical axis; a rank-k linear map
from the ViT's position basis (`position_basis`) to `Delta_y` says how much of the ID
is a low-rank function of the position codes (R^2 per site and rank).

Axis names (`jaxmech.shapes`): N probe examples, L cells, D d_model, F basis features,
Y sites (`n_sites`), K ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import TaskConfig
from jaxmech.data import scenes as sc
from jaxmech.data.scenes import X_SLOT, Y_SLOT
from jaxmech.models import vit2d
from jaxmech.models.answer import logits
from jaxmech.models.ar_vlm import site_name


def probe_scenes(task: TaskConfig, labels, placements: int = 4, seed: int = 0, slot: int = X_SLOT):
    """Every label in `labels` at every cell, each with `placements` draws of another
    label at another cell (host NumPy), named as X (`slot` X_SLOT) or as Y (Y_SLOT) in
    `is X left or right of Y ?`. Returns (SceneBatch [N], label_N, cell_N), N =
    len(labels) L placements; answers are not defined (left/right may not be) and are
    set to `left`: the IDs read states, not answers."""
    if slot not in (X_SLOT, Y_SLOT):
        raise ValueError(f"slot = {slot!r}: expected X_SLOT ({X_SLOT}) or Y_SLOT ({Y_SLOT})")
    rng = np.random.default_rng([seed, 13])
    L, n = task.image_len, task.n_labels
    lab, cell = np.meshgrid(np.asarray(labels), np.arange(L), indexing="ij")
    lab = np.repeat(lab.ravel(), placements)
    cell = np.repeat(cell.ravel(), placements)
    N = len(lab)
    other = rng.integers(1, n, N)
    other = other + (other >= lab)
    other_cell = rng.integers(0, L - 1, N)
    other_cell = other_cell + (other_cell >= cell)
    labels_NxL = np.zeros((N, L), np.int32)
    labels_NxL[np.arange(N), cell] = lab
    labels_NxL[np.arange(N), other_cell] = other
    objects = labels_NxL > 0
    colours = np.where(objects, rng.integers(1, task.n_colours + 1, (N, L)), 0).astype(np.int32)
    facings = np.where(objects, rng.integers(1, 3, (N, L)), 0).astype(np.int32)
    named = (lab, other) if slot == X_SLOT else (other, lab)
    question = np.asarray(sc.question_tokens(np.zeros(N, np.int32), *named))
    batch = sc.SceneBatch(
        labels_NxL,
        colours,
        facings,
        question,
        np.full(N, sc.TOKEN["left"], np.int32),
        np.zeros(N, np.int32),
    )
    return batch, lab, cell


def n_sites(params) -> int:
    """Y: the residual entering every LM block, then the last block's output."""
    return sum(1 for k in params["lm"] if k.startswith("block_")) + 1


def states_at(aux, n_blocks: int, pos: int) -> jax.Array:
    """[Y, N, D] the residual stream at token position `pos` at every site, from a
    capture run's intermediates (`models.answer.logits(..., capture=True)`)."""
    return jnp.stack([aux[site_name(y, n_blocks)][:, pos] for y in range(n_blocks + 1)])


def object_word_states(params, batch, slot: int = X_SLOT) -> jax.Array:
    """[Y, N, D] the residual stream at the word in question slot `slot` (X's by
    default) at every site."""
    _, aux = logits(params, batch, capture=True)
    return states_at(aux, n_sites(params) - 1, batch.labels_BxL.shape[1] + slot)


def cell_means(states_YxNxD, label_N, cell_N, n_cells: int) -> jax.Array:
    """[Y, labels, L, D] the states averaged per (label, cell); labels in sorted order
    (every label must cover every cell)."""
    labels = np.unique(np.asarray(label_N))
    index = np.searchsorted(labels, np.asarray(label_N)) * n_cells + np.asarray(cell_N)
    onehot = jax.nn.one_hot(index, len(labels) * n_cells)  # [N, labels L]
    mean = jnp.einsum("ynd,nm->ymd", states_YxNxD, onehot) / onehot.sum(0)[None, :, None]
    return mean.reshape(states_YxNxD.shape[0], len(labels), n_cells, -1)


def spatial_ids(states_YxNxD, label_N, cell_N, n_cells: int) -> jax.Array:
    """[Y, L, D] Delta_y(cell): states averaged per (label, cell), centred per label
    over the cells, averaged over labels (every label must cover every cell)."""
    return ids_from_means(cell_means(states_YxNxD, label_N, cell_N, n_cells))


def ids_from_means(means_YxNlxLxD) -> jax.Array:
    """[Y, L, D] the ID from per-(label, cell) means (`cell_means`): centred per label
    over the cells, averaged over labels."""
    return (means_YxNlxLxD - means_YxNlxLxD.mean(2, keepdims=True)).mean(1)


def grid_axes(delta_YxLxD, grid_h: int, grid_w: int):
    """(horizontal [Y, D], vertical [Y, D]): the mean ID difference one column right /
    one row down."""
    g = delta_YxLxD.reshape(delta_YxLxD.shape[0], grid_h, grid_w, -1)
    return (g[:, :, 1:] - g[:, :, :-1]).mean((1, 2)), (g[:, 1:] - g[:, :-1]).mean((1, 2))


def position_basis(params) -> jax.Array:
    """[L, F] the ViT's position features of each cell: the row and column codes side
    by side (learned2d, sincos2d), or cos / sin of every rotary angle (rope2d)."""
    rows, cols = vit2d.read(params, "cell_rows"), vit2d.read(params, "cell_cols")
    if vit2d.position_kind(params) == "rope2d":
        ids = jnp.stack([rows, cols])
        angles = vit2d.rotary_angles(
            ids, vit2d.read(params, "vit_rope_freqs"), vit2d.read(params, "vit_rope_axis")
        )
        return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=1)
    row, col = vit2d.position_parts(params, rows, cols)
    return jnp.concatenate([row, col], axis=1)


def rank_k_r2(features_LxF, delta_YxLxD, ranks) -> jax.Array:
    """[Y, K] R^2 of the best rank-k linear map (plus a constant) from the features to
    Delta_y, per site and rank (reduced-rank regression: the least-squares fit
    projected on its top-k right singular vectors)."""
    F = features_LxF - features_LxF.mean(0)
    coef = jnp.linalg.pinv(F)  # [F, L]

    def one_site(delta_LxD):
        d = delta_LxD - delta_LxD.mean(0)
        fit = F @ (coef @ d)
        _, _, vt = jnp.linalg.svd(fit, full_matrices=False)
        total = jnp.sum(d**2)

        def r2(k):
            v = vt[:k].T
            return 1.0 - jnp.sum((d - fit @ v @ v.T) ** 2) / total

        return jnp.stack([r2(k) for k in ranks])

    return jax.vmap(one_site)(delta_YxLxD)


def analytic_ids(params, aux, label_N, cell_N) -> dict:
    """The IDs each LM block's attention would write if the object word attended to its
    own object's image token alone (the paper's sketch `Delta ~ W_O W_V P psi`), against
    what it writes.

    For block y: the values of the image token at X's cell, reduced like `spatial_ids`
    (mean per label and cell, centred per label over the cells, averaged over labels)
    to their position part `Gamma_y(cell)` [L, H, Dh], mapped through each head's W_O:

      pred [Y, L, D]      sum_h Gamma_y(cell)[h] W_O[h]
      weighted [Y, L, D]  the same with head h scaled by its mean attention weight from
                          X's word to X's cell token (the peak's height)
      attn [Y, L, D]      the ID of the block's attention output at X's word
      total [Y, L, D]     the ID the whole block adds (site y + 1 minus site y)
      peak [Y, H]         that mean attention weight per head

    `aux`: the intermediates of a capture run on `probe_scenes`' batch, whose
    `label_N`, `cell_N` (host arrays) come with it. Y: LM blocks.
    """
    n_cells = aux["vit/resid_pre.0"].shape[1]  # the ViT's tokens are the cells
    x_pos, rows = n_cells + X_SLOT, jnp.arange(len(cell_N))
    states = states_at(aux, n_sites(params) - 1, x_pos)
    ids = spatial_ids(states, label_N, cell_N, n_cells)
    out = {"pred": [], "weighted": [], "attn": [], "total": [], "peak": []}
    for y in range(n_sites(params) - 1):
        v = aux[f"lm/v.{y}"][rows, jnp.asarray(cell_N)]  # [N, H, Dh]
        H, Dh = v.shape[1:]
        gamma = spatial_ids(v.reshape(1, len(cell_N), H * Dh), label_N, cell_N, n_cells)
        gamma = gamma[0].reshape(n_cells, H, Dh)
        w_o = params["lm"][f"block_{y}"]["W_O"]
        peak = aux[f"lm/pattern.{y}"][rows, :, x_pos, jnp.asarray(cell_N)].mean(0)  # [H]
        out["pred"].append(jnp.einsum("lhe,hed->ld", gamma, w_o))
        out["weighted"].append(jnp.einsum("lhe,h,hed->ld", gamma, peak, w_o))
        attn = aux[f"lm/attn_out.{y}"][:, x_pos][None]
        out["attn"].append(spatial_ids(attn, label_N, cell_N, n_cells)[0])
        out["total"].append(ids[y + 1] - ids[y])
        out["peak"].append(peak)
    return {k: jnp.stack(v) for k, v in out.items()}


def id_cosine(a_xLxD, b_xLxD) -> jax.Array:
    """[...] cosine between two IDs, flattened over cells and d_model."""
    a = a_xLxD.reshape(a_xLxD.shape[:-2] + (-1,))
    b = b_xLxD.reshape(b_xLxD.shape[:-2] + (-1,))
    return (a * b).sum(-1) / jnp.maximum(
        jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-30
    )
