"""The 1D left/right image-caption task of SPEC.

Two halves:

* Host-side tables fixed by `data_seed` (`build_tables`, `build_eval_sets`): which
  positions each label holds out, which layouts each ordered pair trains on, and the
  fixed validation sets. Built once with NumPy; identical for every model with the same
  data seed.
* A jittable sampler (`sample_batch`) that draws a training batch from a key and the
  *sweepable* settings (`n_pair_labels`, `layouts_per_pair`, `single_frac`), which may
  be traced arrays, so models with different settings train side by side under `vmap`.

Every caption of the task lives in one table (`DataTables.captions`, `[C, T]` tokens)
and samples carry a caption *id*. Equal ids mean identical captions, which is what the
CLIP loss needs to treat repeated captions as positives, and evaluation embeds the
table once instead of every caption of every image.

Caption ids (n = n_labels, labels 1-based):
  pair_left(x, y)   "x is on the left of y"    (x - 1) n + (y - 1)
  pair_right(x, y)  "x is on the right of y"   n^2 + (x - 1) n + (y - 1)
  single_side(l, s) "l is on the left/right"   2 n^2 + 2 (l - 1) + s   (s = 0 left)
  single_label(l)   "l"                        2 n^2 + 2 n + (l - 1)

The fixed validation sets are `data.tasks.grouped.GroupedEvalSets` with one group
(`LineEvalSets`), so every task kind is evaluated by the same code (`evaluate`).

Axis names (`jaxmech.shapes`): B batch rows, L image length, T caption length, C
captions, N rows of an eval set, F caption forms per row (1 for caption mode `left`, 2
for `left_right`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Settings, TaskConfig, choice
from jaxmech.data.tasks.grouped import GroupedEvalSets, absent_label
from jaxmech.data.tasks.vocab import Vocab

SINGLE_CAPTIONS = ("side", "label", "side_pair")
CAPTION_MODES = ("left", "left_right")


@dataclasses.dataclass(frozen=True)
class LineConfig(TaskConfig):
    """The 1D task's config (SPEC; the other caption tasks build on it): how single
    objects are captioned (`single_captions`) and whether captions name the pair both
    ways (`caption_mode`). Its finite training set (`epochs > 0`) is defined."""

    single_captions: str = "side"
    caption_mode: str = "left"

    finite_sets: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        choice("single_captions", self.single_captions, SINGLE_CAPTIONS)
        choice("caption_mode", self.caption_mode, CAPTION_MODES)


# ---------------------------------------------------------------------------
# caption ids


def pair_left(n, x, y):
    return (x - 1) * n + (y - 1)


def pair_right(n, x, y):
    return n * n + (x - 1) * n + (y - 1)


def single_side(n, label, side):
    return 2 * n * n + 2 * (label - 1) + side


def single_label(n, label):
    return 2 * n * n + 2 * n + (label - 1)


def n_captions(n: int) -> int:
    return 2 * n * n + 3 * n


def caption_tokens(n_labels: int) -> np.ndarray:
    """All captions of the task as tokens, `[C, T]` int32, rows in caption-id order."""
    v = Vocab(n_labels)
    rows = []
    labels = range(1, n_labels + 1)
    for rel in ("left", "right"):
        for x in labels:
            for y in labels:
                rows.append(v.encode([x, "is", "on", "the", rel, "of", y]))
    for lab in labels:
        for rel in ("left", "right"):
            rows.append(v.encode([lab, "is", "on", "the", rel]))
    for lab in labels:
        rows.append(v.encode([lab]))
    return np.asarray(rows, np.int32)


# ---------------------------------------------------------------------------
# tables fixed by the data seed


class DataTables(NamedTuple):
    """What the data seed fixes; arrays are indexed by 1-based label (row 0 unused).

    layouts:      [n_layouts, 2]              (p_X, p_Y), p_X < p_Y
    pair_perm:    [n+1, n+1, n_layouts]       per ordered pair, layouts in training
                                              order: the first layouts_per_pair train
    train_pos:    [n+1, L - n_single_holdout] positions a label trains on alone
    holdout_pos:  [n+1, n_single_holdout]     positions held out for validation
    captions:     [C, T]                      every caption's tokens
    """

    layouts: np.ndarray
    pair_perm: np.ndarray
    train_pos: np.ndarray
    holdout_pos: np.ndarray
    captions: np.ndarray


def build_tables(task: TaskConfig) -> DataTables:
    """Host-side tables for `task`, fixed by `task.data_seed`."""
    rng = np.random.default_rng(task.data_seed)
    n, L = task.n_labels, task.image_len
    layouts = np.asarray([(a, b) for a in range(L) for b in range(a + 1, L)], np.int32)
    # Each ordered pair gets its own random layout order; a smaller layouts_per_pair is
    # a prefix of a larger one, so a layouts sweep nests its training sets.
    pair_perm = np.stack(
        [np.stack([rng.permutation(len(layouts)) for _ in range(n + 1)]) for _ in range(n + 1)]
    ).astype(np.int32)
    perms = np.stack([rng.permutation(L) for _ in range(n + 1)])
    h = task.n_single_holdout
    holdout_pos = np.sort(perms[:, :h], axis=1).astype(np.int32)
    train_pos = np.sort(perms[:, h:], axis=1).astype(np.int32)
    return DataTables(layouts, pair_perm, train_pos, holdout_pos, caption_tokens(n))


# ---------------------------------------------------------------------------
# jittable sampling


# Rounds of the swap-or-not shuffle in `finite_order` (enough for n up to ~2^16 items
# to look uniformly shuffled; each round is a bijection, so any count permutes exactly).
SHUFFLE_ROUNDS = 32


def _mix32(x):
    """A 32-bit integer mixer (murmur3's finaliser): uint32 -> uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def n_two_object_items(settings: Settings):
    """Size of a model's two-object training set: ordered pairs x training layouts."""
    n_pair = jnp.asarray(settings.n_pair_labels, jnp.int32)
    return n_pair * (n_pair - 1) * jnp.asarray(settings.layouts_per_pair, jnp.int32)


def singles_per_batch(settings: Settings, batch_size: int):
    """Single-object samples in every batch: round(single_frac * B)."""
    return jnp.round(jnp.asarray(settings.single_frac, jnp.float32) * batch_size).astype(jnp.int32)


def finite_order(key: jax.Array, stream_pos, n):
    """Item index of each position of an endless stream of shuffled epochs over n items.

    Position s belongs to epoch e = s // n and takes item `perm_e(s mod n)`, so every
    epoch visits each of the n items exactly once. perm_e is a swap-or-not shuffle
    (Hoang, Morris and Rogaway 2012) of [0, n): each of `SHUFFLE_ROUNDS` rounds pairs
    x with (k_r - x) mod n and swaps the pair when a hash bit of max(x, k_r - x) says
    so, with k_r and the bits hashed from (key, e, r). It is computed per position in
    O(rounds) integer ops for a traced n, where a sort-based permutation of the largest
    possible set (9450 items) made the training step 2.4x slower.

    stream_pos: int32 [...] (>= 0); n: int32 scalar >= 1 (may be traced).
    Returns int32 [...] in [0, n).
    """
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
    stream_pos = jnp.asarray(stream_pos, jnp.int32)
    salt = jax.random.bits(key, (), jnp.uint32)
    epoch, x = stream_pos // n, stream_pos % n
    n_u = n.astype(jnp.uint32)

    def swap_or_not(r, x):
        r = r.astype(jnp.uint32)
        round_salt = _mix32(salt ^ _mix32(epoch.astype(jnp.uint32) * jnp.uint32(64) + r))
        k = (_mix32(round_salt) % n_u).astype(jnp.int32)
        partner = (k - x) % n
        bit = _mix32(round_salt ^ jnp.maximum(x, partner).astype(jnp.uint32)) & 1
        return jnp.where(bit == 1, partner, x)

    # a loop, not 32 unrolled rounds: integer ops, so the same items either way, and the
    # unrolled rounds were half of a finite-set training program's compile time
    return jax.lax.fori_loop(0, SHUFFLE_ROUNDS, swap_or_not, x)


class BatchKeys(NamedTuple):
    """The PRNG keys of one batch: streaming draws split from the step's key, the
    finite-set epoch orders folded from the model's fixed order key."""

    label: jax.Array
    pos: jax.Array
    x: jax.Array
    y: jax.Array
    layout: jax.Array
    form: jax.Array
    two_order: jax.Array
    one_order: jax.Array
    caption_order: jax.Array


def batch_keys(key: jax.Array, order_key: jax.Array | None = None) -> BatchKeys:
    """The keys `sample_batch` draws from (`order_key` None: the step's key)."""
    order_key = key if order_key is None else order_key
    k_lab, k_pos, k_x, k_y, k_lay, k_form = jax.random.split(key, 6)
    k_two, k_one, k_cap = (jax.random.fold_in(order_key, i) for i in range(3))
    return BatchKeys(k_lab, k_pos, k_x, k_y, k_lay, k_form, k_two, k_one, k_cap)


def pixels(image_len: int, cell_B, label_B):
    """images_BxL holding `label_B` at `cell_B` and background elsewhere."""
    return jnp.where(jnp.arange(image_len)[None, :] == cell_B[:, None], label_B[:, None], 0)


def single_caption(task: TaskConfig, settings: Settings, label_B, side_cap_B):
    """Caption ids [B] of single-object samples under `task.single_captions`: the side
    caption, the bare label, or (`side_pair`) the side caption for pair labels only."""
    label_cap_B = single_label(task.n_labels, label_B)
    if task.single_captions == "side":
        return side_cap_B
    if task.single_captions == "label":
        return label_cap_B
    n_pair = jnp.asarray(settings.n_pair_labels, jnp.int32)
    return jnp.where(label_B <= n_pair, side_cap_B, label_cap_B)


def draw_pair_labels(k_x: jax.Array, k_y: jax.Array, settings: Settings, batch_size: int):
    """x_B, y_B: ordered pairs of distinct pair labels, uniform (streaming draws)."""
    n_pair = jnp.asarray(settings.n_pair_labels, jnp.int32)
    x_B = jax.random.randint(k_x, (batch_size,), 0, n_pair) + 1
    y_B = jax.random.randint(k_y, (batch_size,), 0, n_pair - 1) + 1
    return x_B, skip_label(y_B, x_B)


def skip_label(y_B, x_B):
    """Maps y in 1..n_pair - 1 onto the pair labels other than x (order kept)."""
    return y_B + (y_B >= x_B)


def merge_parts(n_single, single, pair) -> tuple[jax.Array, jax.Array]:
    """The batch: rows below `n_single` from `single`, the rest from `pair`; each part is
    (images_BxL, caption_ids_B) drawn for every row. Returns int32 arrays."""
    (single_img_BxL, single_cap_B), (pair_img_BxL, pair_cap_B) = single, pair
    is_single_B = jnp.arange(single_cap_B.shape[0], dtype=jnp.int32) < n_single
    images = jnp.where(is_single_B[:, None], single_img_BxL, pair_img_BxL).astype(jnp.int32)
    caps = jnp.where(is_single_B, single_cap_B, pair_cap_B).astype(jnp.int32)
    return images, caps


def _single_objects(tables, keys: BatchKeys, settings, task, batch_size, finite, stream_pos_B):
    """Single-object (images_BxL, caption_ids_B): a label at one of its training
    positions; the finite set cycles over all (label, position) items."""
    n, L = task.n_labels, task.image_len
    train_pos = jnp.asarray(tables.train_pos)
    n_tp = train_pos.shape[1]
    if finite:
        one_item_B = finite_order(keys.one_order, stream_pos_B, n * n_tp)
        label_B, pos_idx_B = one_item_B // n_tp + 1, one_item_B % n_tp
    else:
        label_B = jax.random.randint(keys.label, (batch_size,), 1, n + 1)
        pos_idx_B = jax.random.randint(keys.pos, (batch_size,), 0, n_tp)
    pos_B = train_pos[label_B, pos_idx_B]
    side_B = (2 * pos_B >= L).astype(jnp.int32)
    cap_B = single_caption(task, settings, label_B, single_side(n, label_B, side_B))
    return pixels(L, pos_B, label_B), cap_B


def _pair_items(keys: BatchKeys, settings, batch_size, finite, stream_pos_B):
    """x_B, y_B, rank_B (the layout's place in the pair's training order) and, for the
    finite set, item_B = (pair index) * lpp + rank with pair index (x - 1)(n_pair - 1) + y'."""
    n_pair = jnp.asarray(settings.n_pair_labels, jnp.int32)
    lpp = jnp.asarray(settings.layouts_per_pair, jnp.int32)
    if not finite:
        x_B, y_B = draw_pair_labels(keys.x, keys.y, settings, batch_size)
        return x_B, y_B, jax.random.randint(keys.layout, (batch_size,), 0, lpp), None
    item_B = finite_order(keys.two_order, stream_pos_B, n_two_object_items(settings))
    pair_B, rank_B = item_B // lpp, item_B % lpp
    x_B = pair_B // (n_pair - 1) + 1
    y_B = skip_label(pair_B % (n_pair - 1) + 1, x_B)
    return x_B, y_B, rank_B, item_B


def _two_objects(tables, keys: BatchKeys, settings, task, batch_size, finite, stream_pos_B):
    """Two-object (images_BxL, caption_ids_B): an ordered pair of distinct pair labels
    at one of its training layouts, X left of Y."""
    n, L = task.n_labels, task.image_len
    x_B, y_B, rank_B, item_B = _pair_items(keys, settings, batch_size, finite, stream_pos_B)
    layout_B = jnp.asarray(tables.pair_perm)[x_B, y_B, rank_B]
    pxy_Bx2 = jnp.asarray(tables.layouts)[layout_B]
    images = pixels(L, pxy_Bx2[:, 0], x_B) + pixels(L, pxy_Bx2[:, 1], y_B)
    if task.caption_mode == "left":
        return images, pair_left(n, x_B, y_B)
    # "left_right": "X left of Y" or "Y right of X", a fair coin per sample (per item in
    # the finite set: a dataset has one caption per image)
    if finite:
        coin = lambda q: jax.random.bernoulli(jax.random.fold_in(keys.caption_order, q))  # noqa: E731
        right_B = jax.vmap(coin)(item_B)
    else:
        right_B = jax.random.bernoulli(keys.form, 0.5, (batch_size,))
    return images, jnp.where(right_B, pair_right(n, y_B, x_B), pair_left(n, x_B, y_B))


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
    """One training batch for one model.

    Streaming (`finite=False`): every sample is drawn fresh from `key`.
    Finite set (`finite=True`; static, as a run's models are all streaming or all
    finite): batch `step` takes the next samples of the model's epoch stream
    (`finite_order` with `order_key`): the two-object part cycles over every (ordered
    pair, training layout) item, the single-object part over every (label, training
    position) item, each in its own shuffled epochs; in caption mode `left_right` each
    pair item has one fixed caption form. Both modes put exactly round(single_frac * B)
    single-object samples first.

    Args:
      tables: from `build_tables` (NumPy or jnp arrays).
      key: PRNG key of this step.
      settings: this model's sweepable values as scalars (may be traced);
        `n_pair_labels`, `layouts_per_pair` and `single_frac` are read.
      task: static task settings (image length, caption variants).
      batch_size: B.
      finite: finite-set stream instead of fresh draws (static).
      step: int (may be traced), the batch's index in the finite-set stream.
      order_key: the model's fixed key for epoch orders (default: `key`).

    Returns:
      images_BxL int32, caption_ids_B int32.
    """
    keys = batch_keys(key, order_key)
    step = jnp.asarray(step, jnp.int32)
    n_single = singles_per_batch(settings, batch_size)
    slot_B = jnp.arange(batch_size, dtype=jnp.int32)
    # stream positions of each row in its part's epoch stream (finite set only)
    one_pos_B = step * n_single + slot_B
    two_pos_B = step * (batch_size - n_single) + jnp.maximum(slot_B - n_single, 0)
    args = (tables, keys, settings, task, batch_size, finite)
    return merge_parts(n_single, _single_objects(*args, one_pos_B), _two_objects(*args, two_pos_B))


# ---------------------------------------------------------------------------
# fixed evaluation sets


class LineEvalSets(GroupedEvalSets):
    """The 1D validation sets (`data.tasks.grouped.GroupedEvalSets` with one group, `all`).

    Every image is scored once (`*_index` is the identity) under one caption pair:
    single: every label alone at each of its held-out positions, "l is on the <side>"
    against the other side.
    seen: every ordered pair (x, y) of the first max_pair_labels labels at every layout;
    `seen_labels` [N_v, 2] = (x, y), `seen_ranks` [N_v, 1] the layout's place in the
    pair's training order (trained on iff rank < layouts_per_pair), so a model's
    seen-pair set is `seen_mask`.
    unseen: every ordered pair of distinct validation labels at every layout.
    labelset: the unseen rows' left-form caption against the same caption with one label
    replaced by a label absent from the image.
    No per-group metrics: `GROUPED_SETS` is empty.
    """

    __slots__ = ()
    GROUPS = ("all",)
    GROUPED_SETS = ()


def _pair_images(L: int, xs, ys, layouts) -> np.ndarray:
    img = np.zeros((len(xs), L), np.int32)
    idx = np.arange(len(xs))
    img[idx, layouts[:, 0]] = xs
    img[idx, layouts[:, 1]] = ys
    return img


def _pair_forms(task: TaskConfig, xs, ys) -> tuple[np.ndarray, np.ndarray]:
    """True and swapped caption ids [N, F] for pairs with xs left of ys."""
    n = task.n_labels
    true = [pair_left(n, xs, ys)]
    swap = [pair_left(n, ys, xs)]
    if task.caption_mode == "left_right":
        true.append(pair_right(n, ys, xs))
        swap.append(pair_right(n, xs, ys))
    return np.stack(true, 1).astype(np.int32), np.stack(swap, 1).astype(np.int32)


def _all_pairs_all_layouts(labels, tables: DataTables):
    xs, ys, lay = [], [], []
    n_lay = len(tables.layouts)
    for x in labels:
        for y in labels:
            if x != y:
                xs.append(np.full(n_lay, x))
                ys.append(np.full(n_lay, y))
                lay.append(np.arange(n_lay))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(lay)


def held_out_singles(task: TaskConfig, tables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every label alone at each of its held-out positions: (labels [N], positions [N],
    images_NxL), labels in increasing order."""
    labs = np.repeat(np.arange(1, task.n_labels + 1), task.n_single_holdout)
    pos = tables.holdout_pos[1:].reshape(-1)
    images = np.zeros((len(labs), task.image_len), np.int32)
    images[np.arange(len(labs)), pos] = labs
    return labs, pos, images


def single_rows(task: TaskConfig, tables: DataTables) -> tuple[np.ndarray, ...]:
    """The 1D single-object set: (images_NxL, true_Nx1, swap_Nx1), the side caption
    against the other side."""
    n = task.n_labels
    labs, pos, images = held_out_singles(task, tables)
    side = (2 * pos >= task.image_len).astype(np.int32)
    true = single_side(n, labs, side)[:, None].astype(np.int32)
    swap = single_side(n, labs, 1 - side)[:, None].astype(np.int32)
    return images, true, swap


def _one_row_per_image(images, true, swap, extra=()) -> tuple[np.ndarray, ...]:
    """A set's fields in `GroupedEvalSets` order when each image is one row of group 0:
    images, index, true, swap, group, then `extra`."""
    n = len(images)
    return (images, np.arange(n, dtype=np.int32), true, swap, np.zeros(n, np.int32), *extra)


def build_eval_sets(task: TaskConfig, tables: DataTables) -> LineEvalSets:
    """The fixed validation sets for `task` (depends only on the task and data seed)."""
    n, L = task.n_labels, task.image_len
    rng = np.random.default_rng([task.data_seed, 1])

    # seen-pair configuration (candidates; masked per model)
    sx, sy, slay = _all_pairs_all_layouts(range(1, task.max_pair_labels + 1), tables)
    rank_of = np.argsort(tables.pair_perm, axis=-1)  # inverse permutation per pair
    seen_labels = np.stack([sx, sy], 1).astype(np.int32)
    seen_ranks = rank_of[sx, sy, slay][:, None].astype(np.int32)
    seen = _pair_images(L, sx, sy, tables.layouts[slay]), *_pair_forms(task, sx, sy)

    # unseen pairs: validation labels only, all layouts
    ux, uy, ulay = _all_pairs_all_layouts(range(n - task.n_val_labels + 1, n + 1), tables)
    unseen = _pair_images(L, ux, uy, tables.layouts[ulay]), *_pair_forms(task, ux, uy)

    # label-set probe: replace one of the two labels with one absent from the image
    z = absent_label(rng, n, np.stack([ux, uy], 1))
    replace_x = rng.random(len(ux)) < 0.5
    labelset_true = pair_left(n, ux, uy).astype(np.int32)
    labelset_false = np.where(replace_x, pair_left(n, z, uy), pair_left(n, ux, z)).astype(np.int32)
    return LineEvalSets(
        *_one_row_per_image(*single_rows(task, tables)),
        *_one_row_per_image(*seen, (seen_labels, seen_ranks)),
        *_one_row_per_image(*unseen),
        labelset_true,
        labelset_false,
    )
