"""The 1D left/right image-caption task of SPEC.md.

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

Axis names: B batch, L image length, T caption length, C captions, N eval images,
F caption forms per image (1 for caption mode `left`, 2 for `left_right`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Settings, TaskConfig
from jaxmech.data.vocab import Vocab

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
    for r in range(SHUFFLE_ROUNDS):
        round_salt = _mix32(salt ^ _mix32(epoch.astype(jnp.uint32) * jnp.uint32(64) + r))
        k = (_mix32(round_salt) % n_u).astype(jnp.int32)
        partner = (k - x) % n
        bit = _mix32(round_salt ^ jnp.maximum(x, partner).astype(jnp.uint32)) & 1
        x = jnp.where(bit == 1, partner, x)
    return x


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
    n, L, B = task.n_labels, task.image_len, batch_size
    n_pair = jnp.asarray(settings.n_pair_labels, jnp.int32)
    lpp = jnp.asarray(settings.layouts_per_pair, jnp.int32)
    order_key = key if order_key is None else order_key
    k_lab, k_pos, k_x, k_y, k_lay, k_form = jax.random.split(key, 6)
    k_two, k_one, k_cap = (jax.random.fold_in(order_key, i) for i in range(3))
    step = jnp.asarray(step, jnp.int32)
    train_pos = jnp.asarray(tables.train_pos)
    n_tp = train_pos.shape[1]

    n_single = singles_per_batch(settings, B)
    slot_B = jnp.arange(B, dtype=jnp.int32)
    is_single_B = slot_B < n_single

    # single object: streaming draws any label at one of its training positions;
    # the finite set cycles over all n * n_tp (label, position) items
    if finite:
        one_item_B = finite_order(k_one, step * n_single + slot_B, n * n_tp)
        label_B, pos_idx_B = one_item_B // n_tp + 1, one_item_B % n_tp
    else:
        label_B = jax.random.randint(k_lab, (B,), 1, n + 1)
        pos_idx_B = jax.random.randint(k_pos, (B,), 0, n_tp)
    pos_B = train_pos[label_B, pos_idx_B]
    side_B = (2 * pos_B >= L).astype(jnp.int32)
    side_cap = single_side(n, label_B, side_B)
    label_cap = single_label(n, label_B)
    if task.single_captions == "side":
        single_cap_B = side_cap
    elif task.single_captions == "label":
        single_cap_B = label_cap
    else:  # "side_pair": side captions only for labels that form training pairs
        single_cap_B = jnp.where(label_B <= n_pair, side_cap, label_cap)
    single_img_BxL = jnp.where(jnp.arange(L)[None, :] == pos_B[:, None], label_B[:, None], 0)

    # two objects: an ordered pair of distinct pair labels, one of its training layouts.
    # Finite item q = (pair index) * lpp + rank, pair index = (x - 1)(n_pair - 1) + y'.
    if finite:
        two_item_B = finite_order(
            k_two,
            step * (B - n_single) + jnp.maximum(slot_B - n_single, 0),
            n_two_object_items(settings),
        )
        pair_B, rank_B = two_item_B // lpp, two_item_B % lpp
        x_B = pair_B // (n_pair - 1) + 1
        y_B = pair_B % (n_pair - 1) + 1
    else:
        x_B = jax.random.randint(k_x, (B,), 0, n_pair) + 1
        y_B = jax.random.randint(k_y, (B,), 0, n_pair - 1) + 1
        rank_B = jax.random.randint(k_lay, (B,), 0, lpp)
    y_B = y_B + (y_B >= x_B)  # skip x: uniform over the other n_pair - 1 labels
    layout_B = jnp.asarray(tables.pair_perm)[x_B, y_B, rank_B]
    pxy_Bx2 = jnp.asarray(tables.layouts)[layout_B]
    cols = jnp.arange(L)[None, :]
    pair_img_BxL = jnp.where(cols == pxy_Bx2[:, :1], x_B[:, None], 0) + jnp.where(
        cols == pxy_Bx2[:, 1:], y_B[:, None], 0
    )
    if task.caption_mode == "left":
        pair_cap_B = pair_left(n, x_B, y_B)
    else:  # "left_right": "X left of Y" or "Y right of X", a fair coin per sample
        # (per item in the finite set: a dataset has one caption per image)
        if finite:
            coin = lambda q: jax.random.bernoulli(jax.random.fold_in(k_cap, q))  # noqa: E731
            right = jax.vmap(coin)(two_item_B)
        else:
            right = jax.random.bernoulli(k_form, 0.5, (B,))
        pair_cap_B = jnp.where(right, pair_right(n, y_B, x_B), pair_left(n, x_B, y_B))

    images = jnp.where(is_single_B[:, None], single_img_BxL, pair_img_BxL).astype(jnp.int32)
    caps = jnp.where(is_single_B, single_cap_B, pair_cap_B).astype(jnp.int32)
    return images, caps


# ---------------------------------------------------------------------------
# fixed evaluation sets


class EvalSets(NamedTuple):
    """The fixed validation sets (NumPy, built once per data seed).

    single_*:  every label alone at each of its held-out positions (N_s images),
               scored "l is on the <side>" against the other side.
    seen_*:    every ordered pair of the first max_pair_labels labels at every layout
               (N_v images); which of them belong to a model's seen-pair validation set
               depends on its settings (`seen_mask`), since its training pairs and
               layouts do. seen_x/seen_y are the labels, seen_rank the layout's place in
               the pair's training order (trained on iff rank < layouts_per_pair).
    unseen_*:  every ordered pair of distinct validation labels at every layout (N_u).
    *_true / *_swap: caption ids [N, F] of the true caption and its swapped twin
               (labels exchanged for pairs, left/right exchanged for singles).
    labelset_true / labelset_false: [N_u] the left-form caption and the same caption
               with one label replaced by a label absent from the image.
    """

    single_images: np.ndarray
    single_true: np.ndarray
    single_swap: np.ndarray
    seen_images: np.ndarray
    seen_true: np.ndarray
    seen_swap: np.ndarray
    seen_x: np.ndarray
    seen_y: np.ndarray
    seen_rank: np.ndarray
    unseen_images: np.ndarray
    unseen_true: np.ndarray
    unseen_swap: np.ndarray
    labelset_true: np.ndarray
    labelset_false: np.ndarray


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


def build_eval_sets(task: TaskConfig, tables: DataTables) -> EvalSets:
    """The fixed validation sets for `task` (depends only on the task and data seed)."""
    n, L = task.n_labels, task.image_len
    rng = np.random.default_rng([task.data_seed, 1])

    # single-object positional
    labs = np.repeat(np.arange(1, n + 1), task.n_single_holdout)
    pos = tables.holdout_pos[1:].reshape(-1)
    single_images = np.zeros((len(labs), L), np.int32)
    single_images[np.arange(len(labs)), pos] = labs
    side = (2 * pos >= L).astype(np.int32)
    single_true = single_side(n, labs, side)[:, None].astype(np.int32)
    single_swap = single_side(n, labs, 1 - side)[:, None].astype(np.int32)

    # seen-pair configuration (candidates; masked per model)
    sx, sy, slay = _all_pairs_all_layouts(range(1, task.max_pair_labels + 1), tables)
    rank_of = np.argsort(tables.pair_perm, axis=-1)  # inverse permutation per pair
    seen_rank = rank_of[sx, sy, slay].astype(np.int32)
    seen_images = _pair_images(L, sx, sy, tables.layouts[slay])
    seen_true, seen_swap = _pair_forms(task, sx, sy)

    # unseen pairs: validation labels only, all layouts
    ux, uy, ulay = _all_pairs_all_layouts(range(n - task.n_val_labels + 1, n + 1), tables)
    unseen_images = _pair_images(L, ux, uy, tables.layouts[ulay])
    unseen_true, unseen_swap = _pair_forms(task, ux, uy)

    # label-set probe: replace one of the two labels with one absent from the image
    z = rng.integers(1, n - 1, size=len(ux))  # n - 2 choices, then skip x and y
    lo, hi = np.minimum(ux, uy), np.maximum(ux, uy)
    z = z + (z >= lo)
    z = z + (z >= hi)
    replace_x = rng.random(len(ux)) < 0.5
    labelset_true = pair_left(n, ux, uy).astype(np.int32)
    labelset_false = np.where(replace_x, pair_left(n, z, uy), pair_left(n, ux, z)).astype(np.int32)
    return EvalSets(
        single_images,
        single_true,
        single_swap,
        seen_images,
        seen_true,
        seen_swap,
        sx.astype(np.int32),
        sy.astype(np.int32),
        seen_rank,
        unseen_images,
        unseen_true,
        unseen_swap,
        labelset_true,
        labelset_false,
    )


def seen_mask(evals: EvalSets, settings: Settings) -> jax.Array:
    """[N_v] bool: which seen-pair candidates are validation images for this model."""
    n_pair = jnp.asarray(settings.n_pair_labels)
    return (
        (jnp.asarray(evals.seen_x) <= n_pair)
        & (jnp.asarray(evals.seen_y) <= n_pair)
        & (jnp.asarray(evals.seen_rank) >= jnp.asarray(settings.layouts_per_pair))
    )
