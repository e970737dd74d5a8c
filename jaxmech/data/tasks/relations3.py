"""The three-object task (`task_kind = "three"`): a left/right caption with a distractor.

Images are 1D (`image_len`, default 10 as SPEC, so P, the layouts and the
held-out positions are the 1D task's). A two-object sample of the 1D task (ordered
pair (X, Y) of pair labels at one of the pair's training layouts, p_X < p_Y, captioned
"X is on the left of Y", or "Y is on the right of X" in mode `left_right`) gets a third
object: a distractor Z, a pair label other than X and Y, at a uniformly drawn free
pixel (left of both, between them or right of both). The caption never names Z, so its
truth does not depend on Z; the model must bind the relation to the two named objects
and ignore the third. Single-object samples are the 1D task's. Captions and caption
ids are exactly the 1D ones (`relations1d`), and so is the text vocabulary.

Why a distractor and not a chained caption ("X left of Y left of Z"): the caption
table, vocabulary and text length stay those of the 1D task, the true/swapped test
stays one exchange of two named labels, and the question is sharp: does the CLS-row
position gradient still decide "X left of Y" when a third object also gets attention?

Loss: a pair caption is true of every image holding its two labels in its order, so
with a distractor another sample's caption often is true of an image (it names two of
the image's three objects). The identical-caption rule of SPEC would count such
true captions as negatives; this task's loss (`positives`, used by `train.train_step`)
counts every caption true of an image as its positive instead. (With the plain rule the
default models did not learn the relation in 1500 steps: unseen 0.55, seen 0.63.)

Validation sets (groups = where Z sits: `zl` left of both, `zm` between, `zr` right of
both):
  single: the 1D single-object set (no groups).
  seen: every ordered pair of the first max_pair_labels labels at every layout, with a
    distractor drawn by the data seed (label among 1..max(x, y, 3) other than x, y, so
    it is a training label of every model that trains the pair; any free pixel). A
    model's rows are those whose three labels it trains and whose three sub-pair
    layouts (each two of the objects, left one first, at their pixels) are all held
    out of its training layouts: such an image can never be drawn in its training.
  unseen: every ordered triple (X, Y, Z) of distinct validation labels (unseen label
    triples) at every pair layout and every free distractor pixel (each image is so
    scored three times, once per pair of its objects named by the caption).
  labelset: the unseen rows' true caption against X or Y replaced by a label absent
    from the image.

Axis names as in `relations1d`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Settings, TaskConfig
from jaxmech.data.tasks import relations1d as r1
from jaxmech.data.tasks.grouped import GroupedEvalSets, absent_label, seen_mask
from jaxmech.data.tasks.relations1d import DataTables


@dataclasses.dataclass(frozen=True)
class ThreeConfig(r1.LineConfig):
    """The three-object task's config: the 1D fields; a distractor needs a third label
    of each kind (3+ pair and validation labels) and a third position."""

    task_kind: str = "three"

    finite_sets: ClassVar[bool] = False
    min_labels: ClassVar[int] = 3
    min_image_len: ClassVar[int] = 3


__all__ = [
    "DataTables",
    "ThreeEvalSets",
    "build_tables",
    "build_eval_sets",
    "sample_batch",
    "seen_mask",
    "DISTRACTOR_GROUPS",
]

DISTRACTOR_GROUPS = ("zl", "zm", "zr")


def _check(task: TaskConfig) -> None:
    if not isinstance(task, ThreeConfig):
        raise ValueError(
            f"task_kind = {task.task_kind!r}: relations3 needs a ThreeConfig ('three')"
        )


def build_tables(task: TaskConfig) -> DataTables:
    """Host-side tables: the 1D task's (layouts, pair orders, holdouts, captions)."""
    _check(task)
    return r1.build_tables(task)


def _skip2(r, lo, hi):
    """Maps r in [0, m - 2) onto [0, m) minus {lo, hi} (lo < hi), order kept."""
    r = r + (r >= lo)
    return r + (r >= hi)


def sample_batch(
    tables: DataTables,
    key: jax.Array,
    settings: Settings,
    task: TaskConfig,
    batch_size: int,
    *,
    finite: bool = False,
    step=0,
    order_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One streaming training batch for one model (same contract as `relations1d`).

    The 1D batch from `key` (singles first, then pairs), with a distractor added to
    every two-object sample: a pair label other than X and Y (uniform), at a free pixel
    (uniform). Captions are unchanged.

    Args:
      tables: from `build_tables`.
      key: PRNG key of this step.
      settings: sweepable values as scalars (may be traced); reads `n_pair_labels`,
        `layouts_per_pair`, `single_frac`.
      task: static task settings.
      batch_size: B.
      finite, step, order_key: finite sets are not defined for this task (`Config`
        refuses epochs > 0 with task_kind 'three'); finite must be False.

    Returns:
      images_BxL int32, caption_ids_B int32.
    """
    del step, order_key
    if finite:
        raise NotImplementedError("task_kind 'three' trains on streaming batches only (epochs = 0)")
    L, B = task.image_len, batch_size
    images, caps = r1.sample_batch(tables, key, settings, task, B)
    n_pair = jnp.asarray(settings.n_pair_labels, jnp.int32)
    k_z, k_pz = jax.random.split(jax.random.fold_in(key, 3))
    nz_BxL = images != 0
    lo_B = jnp.argmax(nz_BxL, axis=1)
    hi_B = L - 1 - jnp.argmax(nz_BxL[:, ::-1], axis=1)
    x_B = jnp.take_along_axis(images, lo_B[:, None], 1)[:, 0]
    y_B = jnp.take_along_axis(images, hi_B[:, None], 1)[:, 0]
    z_B = jax.random.randint(k_z, (B,), 0, n_pair - 2) + 1
    z_B = _skip2(z_B, jnp.minimum(x_B, y_B), jnp.maximum(x_B, y_B))
    pz_B = _skip2(jax.random.randint(k_pz, (B,), 0, L - 2), lo_B, hi_B)
    is_pair_B = jnp.arange(B) >= r1.singles_per_batch(settings, B)
    put = is_pair_B[:, None] & (jnp.arange(L)[None, :] == pz_B[:, None])
    return jnp.where(put, z_B[:, None], images).astype(jnp.int32), caps


def positives(images_BxL, caption_ids_B, task: TaskConfig) -> jax.Array:
    """bool [B, B]: caption j is true of image i (the loss's positives; diagonal True).

    A pair caption ("a is on the left of b", "a is on the right of b") is true of every
    image holding both labels in that order, so with a distractor another sample's
    caption is often true of an image (it names two of its three objects): treating it
    as a negative would punish a correct match. Single-object captions keep the
    identical-caption rule (they describe lone objects).
    """
    n = task.n_labels
    c = caption_ids_B
    is_pair = c < 2 * n * n
    is_left = c < n * n
    a, b = (c % (n * n)) // n + 1, c % n + 1
    first, second = jnp.where(is_left, a, b), jnp.where(is_left, b, a)

    def place(label_C):  # [B_img, C]: whether / where each caption's label is in each image
        hit = images_BxL[:, None, :] == label_C[None, :, None]
        return hit.any(-1), jnp.argmax(hit, -1)

    (h1, p1), (h2, p2) = place(first), place(second)
    same = c[:, None] == c[None, :]
    return jnp.where(is_pair[None, :], h1 & h2 & (p1 < p2), same)


# ---------------------------------------------------------------------------
# fixed evaluation sets


class ThreeEvalSets(GroupedEvalSets):
    """The three-object validation sets (`data.tasks.grouped`); groups = distractor place."""

    __slots__ = ()
    GROUPS = DISTRACTOR_GROUPS
    GROUPED_SETS = ("seen", "unseen", "labelset")


def _forms(task: TaskConfig, x, y):
    n = task.n_labels
    true, swap = [r1.pair_left(n, x, y)], [r1.pair_left(n, y, x)]
    if task.caption_mode == "left_right":
        true.append(r1.pair_right(n, y, x))
        swap.append(r1.pair_right(n, x, y))
    return np.stack(true, 1).astype(np.int32), np.stack(swap, 1).astype(np.int32)


def _images(L, x, y, z, px, py, pz):
    img = np.zeros((len(x), L), np.int32)
    i = np.arange(len(x))
    img[i, px] = x
    img[i, py] = y
    img[i, pz] = z
    return img


def _group(px, py, pz):
    return np.where(pz < px, 0, np.where(pz < py, 1, 2)).astype(np.int32)


def _sub_pair_ranks(tables: DataTables, L: int, labels_Nx3, cells_Nx3) -> np.ndarray:
    """[N, 3] ranks, in the training order of their pair, of the layouts of an image's
    three sub-pairs (each two objects, left one first, at their pixels)."""
    lay_index = -np.ones((L, L), np.int64)
    lay_index[tables.layouts[:, 0], tables.layouts[:, 1]] = np.arange(len(tables.layouts))
    rank_of = np.argsort(tables.pair_perm, axis=-1)
    order = np.argsort(cells_Nx3, axis=1)
    pos3 = np.take_along_axis(cells_Nx3, order, 1)
    lab3 = np.take_along_axis(labels_Nx3, order, 1)
    return np.stack(
        [
            rank_of[lab3[:, a], lab3[:, b], lay_index[pos3[:, a], pos3[:, b]]]
            for a, b in ((0, 1), (0, 2), (1, 2))
        ],
        1,
    )


def _seen_rows(task: TaskConfig, tables: DataTables, rng: np.random.Generator):
    """Seen-pair candidates, one distractor per (pair, layout) drawn from `rng`:
    (images, true, swap, group, labels [N, 3], ranks [N, 3])."""
    L, n_lay, m = task.image_len, len(tables.layouts), task.max_pair_labels
    pairs = [(x, y) for x in range(1, m + 1) for y in range(1, m + 1) if x != y]
    vx = np.repeat([p[0] for p in pairs], n_lay)
    vy = np.repeat([p[1] for p in pairs], n_lay)
    vlay = np.tile(np.arange(n_lay), len(pairs))
    vpx, vpy = tables.layouts[vlay, 0], tables.layouts[vlay, 1]
    top = np.maximum(np.maximum(vx, vy), 3)
    vz = np.floor(rng.random(len(vx)) * (top - 2)).astype(np.int64) + 1  # 1 .. top - 2
    vz = _skip2(vz, np.minimum(vx, vy), np.maximum(vx, vy))
    vpz = _skip2(rng.integers(0, L - 2, size=len(vx)), vpx, vpy)
    labels, cells = np.stack([vx, vy, vz], 1), np.stack([vpx, vpy, vpz], 1)
    return (
        _images(L, vx, vy, vz, vpx, vpy, vpz),
        *_forms(task, vx, vy),
        _group(vpx, vpy, vpz),
        labels,
        _sub_pair_ranks(tables, L, labels, cells),
    )


def _unseen_rows(task: TaskConfig, tables: DataTables, rng: np.random.Generator):
    """Unseen label triples at every layout and free distractor pixel, each image scored
    once per pair of its objects a caption names (3 rows), with the label-set probe:
    (images [I, L], index [N], true, swap, group, labelset_false [N])."""
    n, L = task.n_labels, task.image_len
    val = range(n - task.n_val_labels + 1, n + 1)
    rows = [
        (x, y, z, a, b, c)
        for x, y, z in itertools.permutations(val, 3)
        for a, b in tables.layouts
        for c in range(L)
        if c not in (a, b)
    ]
    ux, uy, uz, upx, upy, upz = np.asarray(rows).T
    images, index = np.unique(_images(L, ux, uy, uz, upx, upy, upz), axis=0, return_inverse=True)
    true, swap = _forms(task, ux, uy)
    w = absent_label(rng, n, np.stack([ux, uy, uz], 1))
    replace_x = rng.random(len(ux)) < 0.5
    false = np.where(replace_x, r1.pair_left(n, w, uy), r1.pair_left(n, ux, w))
    return images, index.reshape(-1), true, swap, _group(upx, upy, upz), false.astype(np.int32)


def build_eval_sets(task: TaskConfig, tables: DataTables) -> ThreeEvalSets:
    """The fixed three-object validation sets (module doc; task and data seed only)."""
    _check(task)
    rng = np.random.default_rng([task.data_seed, 3])
    s_img, s_true, s_swap = r1.single_rows(task, tables)
    v_img, v_true, v_swap, v_group, v_labels, v_ranks = _seen_rows(task, tables, rng)
    u_img, u_index, u_true, u_swap, u_group, labelset_false = _unseen_rows(task, tables, rng)
    n_s, n_v = len(s_img), len(v_img)
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    return ThreeEvalSets(
        s_img,
        i32(np.arange(n_s)),
        s_true,
        s_swap,
        i32(np.zeros(n_s)),
        v_img,
        i32(np.arange(n_v)),
        v_true,
        v_swap,
        v_group,
        i32(v_labels),
        i32(v_ranks),
        u_img,
        i32(u_index),
        u_true,
        u_swap,
        u_group,
        u_true[:, 0].copy(),
        labelset_false,
    )
