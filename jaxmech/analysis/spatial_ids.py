"""Spatial IDs (paper 003), for any VLM family.

Put an object X at every cell (another object Y elsewhere, several placements or every
other cell: `data.spec.probe_specs`), ask `is X left or right of Y?`, and read the LM's
residual stream at X's word (its last sub-token). Centred per object over the cells and
averaged over objects, this gives the spatial ID `Delta_y(cell)` at each site y
(`lm/resid_pre.{y}` for every LM block, then the last block's output; or the layers
asked for, `id_sites`): the part of the object word's state that depends only on where
its object is. Grid differences
give a horizontal and a vertical axis; a rank-k linear map from the ViT's position
basis (`VLMView.position_basis`) to `Delta_y` says how much of the ID is a low-rank
function of the position codes (R^2 per site and rank), beside the same fit from
one-hot row + column indicators (`additive_basis`: what an additive code alone gives).

A family enters only through its VLM view (`families.vlm_view`).

Axis names (`jaxmech.shapes`): N probe examples, L cells, D d_model, F basis features,
Y sites (`id_sites`: every one, or a checkpoint's `--layers`), K ranks, T image tokens
per cell.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.chunks import chunk_rows
from jaxmech.data.spec import probe_specs
from jaxmech.families.vlm_view import Spans, VLMView, resid_site, rows_at
from jaxmech.models.attention import n_blocks as count_blocks
from jaxmech.models.layout import block as block_of


class Probe(NamedTuple):
    """Probe scenes rendered by a family: inputs, spans, and each example's probed
    label and cell [N] (host arrays)."""

    inputs: Any
    spans: Spans
    label_N: np.ndarray
    cell_N: np.ndarray


def probe(view: VLMView, labels, placements: int = 4, seed: int = 0, named_first: bool = True,
          relation: int = 0, factorial: bool = False):  # fmt: skip
    """Every label in `labels` at every cell (`data.spec.probe_specs`), rendered by the
    family: the probed label named first (X) or second (Y), in the question template of
    `relation` (0 horizontal, 1 vertical); the other object at `placements` random
    cells, or with `factorial` at every other cell once (the papers' authors' scenes)."""
    spec, label, cell = probe_specs(view.grid, labels, view.n_labels, view.n_colours,
                                    placements, seed, named_first, relation, factorial)  # fmt: skip
    inputs, spans = view.render(spec)
    return Probe(inputs, spans, label, cell)


def n_sites(view: VLMView, params) -> int:
    """Y: the residual entering every LM block, then the last block's output."""
    return view.n_lm_blocks(params) + 1


def id_sites(n_blocks: int, sites=None) -> list[int]:
    """The LM sites studied, sorted: `sites` (as the authors index layers: site y the
    residual after y blocks, `resid_site`; a checkpoint's `--layers`), or every one
    0..n_blocks."""
    return list(range(n_blocks + 1)) if sites is None else sorted({int(y) for y in sites})


def id_blocks(n_blocks: int, sites=None) -> list[int]:
    """The LM blocks `analytic_ids` reads at `sites`: block y reads site y and writes
    site y + 1, so every studied site but the last block's output."""
    return [y for y in id_sites(n_blocks, sites) if y < n_blocks]


def states_at(aux, n_blocks: int, pos_N, sites=None) -> jax.Array:
    """[Y, N, D] the residual stream at each example's token position pos_N[n] at each
    site of `id_sites(n_blocks, sites)`, from a capture run's intermediates."""
    return jnp.stack(
        [rows_at(aux[resid_site(y, n_blocks)], pos_N) for y in id_sites(n_blocks, sites)]
    )


def map_chunks(fn, n: int, batch: int | None):
    """`fn(rows)` (a pytree whose leaves lead with len(rows)) over rows 0..n-1: at once
    (`fn(None)`: every row), or `batch` rows at a time in one `lax.map` (the last chunk
    padded with row 0, then cut), so a large model's intermediates are held for one
    chunk only."""
    if batch is None or batch >= n:
        return fn(None)
    out = jax.lax.map(fn, jnp.asarray(np.stack(chunk_rows(n, batch))))
    return jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:])[:n], out)


def take_rows(tree, rows):
    """`tree` at `rows` along every leaf's first axis (None: all of it, as it is)."""
    return tree if rows is None else jax.tree_util.tree_map(lambda a: jnp.asarray(a)[rows], tree)


def word_states(view: VLMView, params, inputs, pos_N, batch: int | None = None) -> jax.Array:
    """[Y, N, D] the residual stream at each example's position pos_N[n] (e.g. an object
    word's `Spans.x_B`) at every site, from one forward of `inputs` (`batch` scenes at a
    time where given: `map_chunks`)."""
    n_blocks = view.n_lm_blocks(params)
    sites = [resid_site(y, n_blocks) for y in range(n_blocks + 1)]

    def chunk(rows):
        _, aux = view.forward(params, take_rows(inputs, rows), capture=sites)
        return jnp.moveaxis(states_at(aux, n_blocks, take_rows(pos_N, rows)), 1, 0)

    return jnp.moveaxis(map_chunks(chunk, len(np.asarray(pos_N)), batch), 0, 1)


def probe_sites(n_blocks: int, sites=None) -> list[str]:
    """The intermediates `states_at` and `analytic_ids` read from a probe run at
    `sites` (`id_sites`): those residuals, and each block of `id_blocks` with the
    residual it writes."""
    blocks = id_blocks(n_blocks, sites)
    resid = sorted(set(id_sites(n_blocks, sites)) | {y + 1 for y in blocks})
    per_block = [f"lm/{k}.{y}" for y in blocks for k in ("v", "pattern", "attn_out")]
    return [resid_site(y, n_blocks) for y in resid] + per_block


def token_sets(token_N) -> jax.Array:
    """[N, T] the LM positions of each example's cell tokens (`cell_tokens`); one
    token per example [N] as T = 1."""
    token_N = jnp.asarray(token_N)
    return token_N[:, None] if token_N.ndim == 1 else token_N


def merged_pattern(pattern_BxHxSxS, x_N, tokens_NxT) -> jax.Array:
    """[N, H, 2, 2] the attention among X's word (0) and X's cell (1), the cell's tokens
    merged into one: as queries averaged, as keys summed (the mass on the cell), so a
    row still sums to at most 1."""
    q = jnp.concatenate([jnp.asarray(x_N)[:, None], tokens_NxT], 1)  # [N, 1 + T]
    rows = jnp.arange(len(q))[:, None, None, None]
    heads = jnp.arange(pattern_BxHxSxS.shape[1])[None, :, None, None]
    sub = pattern_BxHxSxS[rows, heads, q[:, None, :, None], q[:, None, None, :]]
    group = jnp.zeros((q.shape[1], 2)).at[0, 0].set(1.0).at[1:, 1].set(1.0)
    return jnp.einsum("qa,nhqk,kb->nhab", group / group.sum(0), sub, group)


def at_two_positions(aux, x_N, token_N, n_blocks: int, sites=None) -> dict:
    """A probe run's intermediates (`probe_sites(n_blocks, sites)`) reduced to the two
    positions the IDs read, renumbered 0 (X's word) and 1 (X's cell: its image tokens
    `cell_tokens` [N, T], or one token [N]): residuals and attention outputs [N, 2, D],
    values [N, 2, H, Dh], the cell's averaged over its tokens (at 448 px a Qwen cell is
    16 tokens, its first mostly background); patterns [N, H, 2, 2] (`merged_pattern`).
    `states_at` and `analytic_ids` give the same on it with x_N = 0 and token_N = 1."""
    x_N, tokens = jnp.asarray(x_N), token_sets(token_N)
    rows = jnp.arange(len(x_N))
    out = {}
    for k in probe_sites(n_blocks, sites):
        x = aux[k]
        if k.startswith("lm/pattern"):
            out[k] = merged_pattern(x, x_N, tokens)
        else:
            out[k] = jnp.stack([x[rows, x_N], x[rows[:, None], tokens].mean(1)], 1)
    return out


def chunked_probe(view: VLMView, params, inputs, x_N, token_N, batch: int | None,
                  sites=None) -> dict:  # fmt: skip
    """`at_two_positions` of the probe scenes' run at `sites` (`id_sites`; None: every
    one), `batch` scenes at a time (`map_chunks`)."""
    n_blocks = view.n_lm_blocks(params)
    capture = probe_sites(n_blocks, sites)

    def chunk(rows):
        _, aux = view.forward(params, take_rows(inputs, rows), capture=capture)
        x, tok = take_rows(x_N, rows), take_rows(token_N, rows)
        return at_two_positions(aux, x, tok, n_blocks, sites)

    return map_chunks(chunk, len(np.asarray(x_N)), batch)


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


def grid_axes(delta_YxLxD, grid_h: int, grid_w: int, authors: bool = False):
    """(horizontal [Y, D], vertical [Y, D]): the mean ID difference one column right /
    one row down. `authors`: as paper 003's `compute_axes.py`, the mean of ID(b) - ID(a)
    over every row (column) and every pair a <= b with a before the last column (row);
    the equal pairs' zeros are in the mean, so it is a shorter vector that weighs long
    steps more."""
    g = delta_YxLxD.reshape(delta_YxLxD.shape[0], grid_h, grid_w, -1)
    if authors:
        return _pair_steps(g, 2).mean((1, 2)), _pair_steps(g, 1).mean((1, 2))
    return (g[:, :, 1:] - g[:, :, :-1]).mean((1, 2)), (g[:, 1:] - g[:, :-1]).mean((1, 2))


def _pair_steps(g_YxHxWxD, axis: int):
    """ID(b) - ID(a) along `axis` (2 columns, 1 rows) of every pair a <= b, a < n - 1,
    stacked on that axis (`grid_axes`, authors)."""
    n = g_YxHxWxD.shape[axis]
    a, b = np.asarray([(i, j) for i in range(n - 1) for j in range(i, n)]).T
    return jnp.take(g_YxHxWxD, b, axis) - jnp.take(g_YxHxWxD, a, axis)


def authors_cell_weights(fx: float, fy: float, grid_h: int, grid_w: int) -> np.ndarray:
    """[L] paper 003's `utils/coco.py` bilinear weights of a box centre at (fx, fy) in
    cells (nx * W, ny * H, unclamped), as their dict literal keeps them: the four
    (cell: weight) pairs in order, a repeated cell keeping only its **last** weight (a
    centre in the last column has x0 == x1: that column weighs wx (1 - wy), not
    1 - wy), and a cell outside the grid (fx = W at the right edge) dropped."""
    x0, y0 = int(np.floor(fx)), int(np.floor(fy))
    x1, y1 = min(x0 + 1, grid_w - 1), min(y0 + 1, grid_h - 1)
    wx, wy = fx - x0, fy - y0
    kept = {}
    for cell, w in (((x0, y0), (1 - wx) * (1 - wy)), ((x1, y0), wx * (1 - wy)),
                    ((x0, y1), (1 - wx) * wy), ((x1, y1), wx * wy)):  # fmt: skip
        kept[cell] = w  # a later weight replaces an earlier one, as in their literal
    out = np.zeros(grid_h * grid_w, np.float32)
    for (c, r), w in kept.items():
        if 0 <= c < grid_w and 0 <= r < grid_h:
            out[r * grid_w + c] = w
    return out


def cell_basis(view: VLMView, params, spans: Spans) -> jax.Array:
    """[L, F] the ViT's position features (`VLMView.position_basis`, per image token)
    averaged over each cell's image tokens (`Spans.cell_I`; one token per cell: as is)."""
    cell_I = np.asarray(spans.cell_I)
    onehot = (cell_I[None, :] == np.arange(view.grid.cells)[:, None]).astype(np.float32)
    return (onehot / onehot.sum(1, keepdims=True)) @ view.position_basis(params)


def additive_basis(grid_h: int, grid_w: int) -> np.ndarray:
    """[L, h + w] one-hot row and one-hot column indicators of each cell: a basis of
    every additive function f(row) + g(col), the baseline beside `rank_k_r2` of the
    ViT's basis. Qwen's 2D rotary gives rows and columns their own frequencies, so each
    of its cell-averaged features (`cell_basis`) is a function of the row or of the
    column alone: its R^2 is at most this basis's (equal where it spans every additive
    function), and a high one says the ID is additive, not how rotary codes it."""
    row, col = np.divmod(np.arange(grid_h * grid_w), grid_w)
    return np.concatenate([np.eye(grid_h)[row], np.eye(grid_w)[col]], 1).astype(np.float32)


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


def split_half_ceiling(states_YxNxD, label_N, cell_N, n_cells: int) -> jax.Array:
    """[Y] the noise ceiling of an R^2 against the ID: the share of its variance over
    the cells that two halves of the labels agree on, `<a, b> / |(a + b) / 2|^2`, with a
    and b the IDs of alternate labels (in sorted order), centred over the cells. With
    independent label noise this estimates |signal|^2 / |ID|^2: a fit that explains
    more of the ID than this explains noise. Needs at least two labels."""
    label_N = np.asarray(label_N)
    labels = np.unique(label_N)
    if len(labels) < 2:
        raise ValueError(f"split_half_ceiling needs >= 2 labels, got {labels.tolist()}")
    halves = [np.isin(label_N, labels[i::2]) for i in (0, 1)]
    a, b = (
        spatial_ids(states_YxNxD[:, h], label_N[h], np.asarray(cell_N)[h], n_cells) for h in halves
    )
    a, b = a - a.mean(1, keepdims=True), b - b.mean(1, keepdims=True)
    mean = (a + b) / 2
    return (a * b).sum((1, 2)) / jnp.maximum((mean**2).sum((1, 2)), 1e-30)


def analytic_ids(params, aux, x_N, token_N, label_N, cell_N, n_cells: int,
                 sites=None) -> dict:  # fmt: skip
    """The IDs each LM block's attention would write if the object word attended to its
    own object's cell alone (the paper's sketch `Delta ~ W_O W_V P psi`), against
    what it writes.

    For block y (`id_blocks(n, sites)`, Y of them): the values of X's cell (averaged
    over its image tokens), reduced like `spatial_ids` (mean per label and cell, centred
    per label over the cells, averaged over labels) to their position part
    `Gamma_y(cell)` [L, H, Dh], mapped through each head's W_O:

      pred [Y, L, D]      sum_h Gamma_y(cell)[h] W_O[h]
      weighted [Y, L, D]  the same with head h scaled by its mean attention mass from
                          X's word on X's cell's tokens (the peak's height)
      attn [Y, L, D]      the ID of the block's attention output at X's word
      total [Y, L, D]     the ID the whole block adds (site y + 1 minus site y)
      peak [Y, H]         that mean attention mass per head
      peak_N [Y, N]       each probe's attention mass, mean over heads

    `aux`: the intermediates of a capture run on probe scenes (`data.spec.probe_specs`,
    whose `label_N`, `cell_N` come with them; or `at_two_positions` of one, with x_N = 0
    and token_N = 1); x_N: X's word position (`Spans.x_B`), token_N: the LM positions
    of X's cell's image tokens [N, T] (`cell_tokens`) or of one token [N]. Params in
    the TransformerLens layout (block y's `W_O` [H, Dh, D], `models.layout.block`).
    """
    rows, x_N, tokens = jnp.arange(len(cell_N)), jnp.asarray(x_N), token_sets(token_N)
    n_blocks = count_blocks(params["lm"])
    blocks = id_blocks(n_blocks, sites)
    resid = sorted(set(blocks) | {y + 1 for y in blocks})
    ids = dict(zip(resid, spatial_ids(states_at(aux, n_blocks, x_N, resid), label_N, cell_N,
                                      n_cells)))  # fmt: skip
    out = {"pred": [], "weighted": [], "attn": [], "total": [], "peak": [], "peak_N": []}
    for y in blocks:
        w_o = block_of(params["lm"], y)["W_O"]
        v = aux[f"lm/v.{y}"][rows[:, None], tokens].mean(1)  # [N, Hkv, Dh] the cell's value
        v = jnp.repeat(v, w_o.shape[0] // v.shape[1], axis=1)  # grouped-query: per query head
        H, Dh = v.shape[1:]
        gamma = spatial_ids(v.reshape(1, len(cell_N), H * Dh), label_N, cell_N, n_cells)
        gamma = gamma[0].reshape(n_cells, H, Dh)
        mass = aux[f"lm/pattern.{y}"][rows[:, None], :, x_N[:, None], tokens].sum(1)  # [N, H]
        peak = mass.mean(0)
        out["pred"].append(jnp.einsum("lhe,hed->ld", gamma, w_o))
        out["weighted"].append(jnp.einsum("lhe,h,hed->ld", gamma, peak, w_o))
        attn = rows_at(aux[f"lm/attn_out.{y}"], x_N)[None]
        out["attn"].append(spatial_ids(attn, label_N, cell_N, n_cells)[0])
        out["total"].append(ids[y + 1] - ids[y])
        out["peak"].append(peak)
        out["peak_N"].append(mass.mean(1))
    return {k: jnp.stack(v) for k, v in out.items()}


def id_cosine(a_xLxD, b_xLxD) -> jax.Array:
    """[...] cosine between two IDs, flattened over cells and d_model."""
    a = a_xLxD.reshape(a_xLxD.shape[:-2] + (-1,))
    b = b_xLxD.reshape(b_xLxD.shape[:-2] + (-1,))
    return (a * b).sum(-1) / jnp.maximum(
        jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-30
    )
