"""Validation sets whose rows fall into named groups: the layout every task kind uses.

A set's scored rows may read the same image more than once (a 2D image under its
horizontal and its vertical caption), and accuracies may be reported per group of rows
(relation `h` / `v`, or where the distractor sits). Every task kind's sets share one
layout, `GroupedEvalSets`: per set (`single`, `seen`, `unseen`) the I distinct images,
and per scored row (N rows) the image it reads (`*_index`), its true and swapped
caption ids (`[N, F]`, F caption forms) and its group. A task subclasses it to name its
groups (`GROUPS`) and the sets they split (`GROUPED_SETS`; empty: no per-group
metrics, as for the 1D task's single group `relations1d.LineEvalSets`).
`evaluate.evaluate` scores every subclass the same way.

Seen-pair rows are candidates: a model's seen-pair set is the rows whose labels
(`seen_labels`, one column per object) are all training-pair labels of that model and
whose layouts (`seen_ranks`, one column per pair of objects, each the layout's rank in
its pair's training order) are all held out (`seen_mask`), so no seen-pair image is a
training image of that model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Settings


class GroupedEvalSets(NamedTuple):
    """Fixed validation sets (NumPy); N rows and I distinct images per set.

    single_images [I_s, L], single_index [N_s], single_true / single_swap [N_s, F],
    single_group [N_s]: lone objects at held-out positions.
    seen_images, seen_index, seen_true, seen_swap, seen_group: seen-pair candidates;
    seen_labels [N_v, objects] and seen_ranks [N_v, object pairs] decide a model's
    subset (`seen_mask`).
    unseen_images, unseen_index, unseen_true, unseen_swap, unseen_group: validation
    labels only.
    labelset_true / labelset_false [N_u]: per unseen row, its first true caption form
    and the same caption with one label replaced by a label absent from the image.
    """

    single_images: np.ndarray
    single_index: np.ndarray
    single_true: np.ndarray
    single_swap: np.ndarray
    single_group: np.ndarray
    seen_images: np.ndarray
    seen_index: np.ndarray
    seen_true: np.ndarray
    seen_swap: np.ndarray
    seen_group: np.ndarray
    seen_labels: np.ndarray
    seen_ranks: np.ndarray
    unseen_images: np.ndarray
    unseen_index: np.ndarray
    unseen_true: np.ndarray
    unseen_swap: np.ndarray
    unseen_group: np.ndarray
    labelset_true: np.ndarray
    labelset_false: np.ndarray

    GROUPS = ()  # group names (index = group id); metrics `<set>_<group>_acc`
    GROUPED_SETS = ()  # which of single / seen / unseen / labelset are split by group


def seen_mask(evals: GroupedEvalSets, settings: Settings) -> jax.Array:
    """[N_v] bool: the seen-pair rows of a model (all labels trained, all layouts held out).

    `settings` holds one model's scalars (or, under vmap, traced scalars).
    """
    n_pair = jnp.asarray(settings.n_pair_labels)
    lpp = jnp.asarray(settings.layouts_per_pair)
    return (jnp.asarray(evals.seen_labels) <= n_pair).all(-1) & (
        jnp.asarray(evals.seen_ranks) >= lpp
    ).all(-1)


def metric_names(evals_type: type) -> tuple[str, ...]:
    """The per-group metrics `evaluate` adds for an eval-set type (e.g. `unseen_h_acc`)."""
    return tuple(f"{s}_{g}_acc" for s in evals_type.GROUPED_SETS for g in evals_type.GROUPS)


def absent_label(rng: np.random.Generator, n: int, present: np.ndarray) -> np.ndarray:
    """[N] per row, a label in 1..n uniformly among those not in `present` [N, k]
    (distinct labels per row); draws one `rng.integers` per row."""
    k = present.shape[1]
    z = rng.integers(1, n - k + 1, size=len(present))
    for p in np.sort(present, axis=1).T:  # skip the present labels in increasing order
        z = z + (z >= p)
    return z
