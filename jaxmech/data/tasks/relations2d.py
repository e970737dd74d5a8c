"""The 2D task (`task_kind = "2d"`): left/right and above/below on an H x W grid.

Images: objects on a `grid_h x grid_w` grid (default 4 x 4), flattened row-major into
the usual image sequence (cell (r, c) is pixel `r W + c`; `task.image_len` is H W), so
the vision tower, its position table P (one learned row per cell: a 2D position
embedding that may learn any function of (row, column), rather than a factorised
row + column sum that would build in the additivity the task is about) and
`analysis.decompose` need no change.

Relations: horizontal (`h`: "A is on the left of B", A in a smaller column) and
vertical (`v`: "A is above B", A in a smaller row). Captions (text words `above`,
`below` join the 1D vocabulary; `data.tasks.task_vocab`):

  h pair   "a is on the left of b"  / mode left_right also "b is on the right of a"
  v pair   "a is above b"           / mode left_right also "b is below a"
  h single "l is on the left" / "l is on the right"   (column c: 2c < W is left)
  v single "l is above" / "l is below"               (row r: 2r < H is above)
  label    "l"                                        (single_captions label / side_pair)

Label split, held-out positions and layouts exactly as SPEC's 1D task with
L = H W cells: an ordered pair (X, Y) places X at cell a and Y at cell b with a < b in
row-major order (so X is above Y, or in the same row and left of it); the H W (H W - 1)
/ 2 layouts (120 for 4 x 4) are ordered per pair by the data seed, the first
`layouts_per_pair` train, the rest are the pair's seen-pair validation images. An image
has a horizontal caption when the objects' columns differ and a vertical one when their
rows differ (diagonal layouts have both: 72 of 120); a training sample takes one of its
valid relations, a fair coin when both are valid (so each relation is half of the
two-object samples). A single-object sample takes `h` or `v` by a fair coin.

Evaluation scores every image under each of its valid relations (true caption against
the swapped one: A and B exchanged for pairs, the other side for singles) and reports
accuracies per relation (`GridEvalSets.GROUPS`).

Caption ids (n = n_labels, labels 1-based, relation r = 0 h / 1 v, a relation's block
of ids blk = 2n^2 + 3n):
  pair_first(r, a, b)   "a left of b" / "a above b"     r blk + (a - 1) n + (b - 1)
  pair_second(r, a, b)  "a right of b" / "a below b"    r blk + n^2 + (a - 1) n + (b - 1)
  single_side(r, l, s)  side s (0 left/above)           r blk + 2 n^2 + 2 (l - 1) + s
  single_label(l)       "l"                             2 n^2 + 2 n + (l - 1)
The horizontal ids are the 1D ids (`relations1d`); the token ids differ (longer
vocabulary).

Axis names as in `relations1d` (`jaxmech.shapes`): B batch rows, L = H W cells, T caption
length, C captions, N rows and I distinct images of an eval set, F caption forms.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Settings, TaskConfig, derive_grid, normalise
from jaxmech.data.tasks import relations1d as r1
from jaxmech.data.tasks.grouped import GroupedEvalSets, absent_label, seen_mask
from jaxmech.data.tasks.vocab import WORDS_2D, Vocab


@dataclasses.dataclass(frozen=True)
class GridConfig(r1.LineConfig):
    """The 2D task's config: the 1D caption fields on a `grid_h x grid_w` grid, flattened
    row-major into the image (`image_len` is derived: grid_h grid_w)."""

    task_kind: str = "2d"
    grid_h: int = 4
    grid_w: int = 4

    finite_sets: ClassVar[bool] = False

    def __post_init__(self):
        normalise(self)
        derive_grid(self)
        super().__post_init__()


__all__ = [
    "GridTables",
    "GridEvalSets",
    "build_tables",
    "build_eval_sets",
    "sample_batch",
    "seen_mask",
    "caption_tokens",
    "n_captions",
    "pair_first",
    "pair_second",
    "single_side",
    "single_label",
    "RELATIONS",
]

RELATIONS = ("h", "v")
FIRST_WORD = ("left", "above")
SECOND_WORD = ("right", "below")


def _block(n):
    return 2 * n * n + 3 * n


def pair_first(n, rel, a, b):
    return rel * _block(n) + (a - 1) * n + (b - 1)


def pair_second(n, rel, a, b):
    return rel * _block(n) + n * n + (a - 1) * n + (b - 1)


def single_side(n, rel, label, side):
    return rel * _block(n) + 2 * n * n + 2 * (label - 1) + side


def single_label(n, label):
    return 2 * n * n + 2 * n + (label - 1)


def n_captions(n: int) -> int:
    return 4 * n * n + 5 * n


def caption_tokens(n_labels: int) -> np.ndarray:
    """All captions of the 2D task as tokens, `[C, T]` int32, rows in caption-id order."""
    v = Vocab(n_labels, WORDS_2D)
    labels = range(1, n_labels + 1)

    def pair(rel, word, x, y):
        if rel == 0:
            return v.encode([x, "is", "on", "the", word, "of", y])
        return v.encode([x, "is", word, y])

    def side(rel, lab, s):
        word = (FIRST_WORD, SECOND_WORD)[s][rel]
        return v.encode([lab, "is", "on", "the", word] if rel == 0 else [lab, "is", word])

    rows = []
    for rel in (0, 1):
        for word in (FIRST_WORD[rel], SECOND_WORD[rel]):
            rows += [pair(rel, word, x, y) for x in labels for y in labels]
        rows += [side(rel, lab, s) for lab in labels for s in (0, 1)]
        if rel == 0:
            rows += [v.encode([lab]) for lab in labels]
    return np.asarray(rows, np.int32)


# ---------------------------------------------------------------------------
# tables


class GridTables(NamedTuple):
    """What the data seed fixes (the 1D tables with L = H W cells, plus geometry).

    layouts:     [n_layouts, 2]      (cell of X, cell of Y), X's cell first row-major
    rel_ok:      [n_layouts, 2] bool which relations (h, v) the layout has
    pair_perm, train_pos, holdout_pos: as `relations1d.DataTables`
    captions:    [C, T]
    """

    layouts: np.ndarray
    rel_ok: np.ndarray
    pair_perm: np.ndarray
    train_pos: np.ndarray
    holdout_pos: np.ndarray
    captions: np.ndarray


def _rows_cols(task: TaskConfig, cells):
    return cells // task.grid_w, cells % task.grid_w


def _check(task: TaskConfig) -> None:
    if not isinstance(task, GridConfig):
        raise ValueError(f"task_kind = {task.task_kind!r}: relations2d needs a GridConfig ('2d')")


def build_tables(task: TaskConfig) -> GridTables:
    """Host-side tables for `task`, fixed by `task.data_seed`."""
    _check(task)
    t = r1.build_tables(task)  # same draws as a 1D task of length H W
    ra, ca = _rows_cols(task, t.layouts[:, 0])
    rb, cb = _rows_cols(task, t.layouts[:, 1])
    rel_ok = np.stack([ca != cb, ra != rb], 1)
    return GridTables(
        t.layouts, rel_ok, t.pair_perm, t.train_pos, t.holdout_pos, caption_tokens(task.n_labels)
    )


# ---------------------------------------------------------------------------
# jittable sampling


def _first_second(task, rel, x, y, cell_x, cell_y):
    """(first, second) of labels x, y along relation rel (the left / upper one first)."""
    rx, cx = cell_x // task.grid_w, cell_x % task.grid_w
    ry, cy = cell_y // task.grid_w, cell_y % task.grid_w
    x_first = jnp.where(rel == 0, cx < cy, rx < ry)
    return jnp.where(x_first, x, y), jnp.where(x_first, y, x)


def _side(task, rel, cell):
    """0 (left / above) or 1 (right / below) half of the grid along relation rel."""
    coord = jnp.where(rel == 0, cell % task.grid_w, cell // task.grid_w)
    size = jnp.where(rel == 0, task.grid_w, task.grid_h)
    return (2 * coord >= size).astype(jnp.int32)


def _single_objects(tables, k_lab, k_pos, k_srel, settings, task, batch_size):
    """Single-object (images_BxL, caption_ids_B): any label at one of its training
    cells, captioned along a relation drawn by a fair coin."""
    n, B = task.n_labels, batch_size
    train_pos = jnp.asarray(tables.train_pos)
    label_B = jax.random.randint(k_lab, (B,), 1, n + 1)
    pos_B = train_pos[label_B, jax.random.randint(k_pos, (B,), 0, train_pos.shape[1])]
    srel_B = jax.random.bernoulli(k_srel, 0.5, (B,)).astype(jnp.int32)
    side_cap_B = single_side(n, srel_B, label_B, _side(task, srel_B, pos_B))
    return r1.pixels(task.image_len, pos_B, label_B), r1.single_caption(
        task, settings, label_B, side_cap_B
    )


def draw_pair_layout(tables, keys, settings: Settings, batch_size: int):
    """A training pair at one of its training layouts, with a relation valid there.

    `tables` has the 2D layouts (`pair_perm`, `layouts`, `rel_ok`: `GridTables`, and the
    scenes task's tables). The relation is a fair coin where both are valid. `keys` =
    (k_x, k_y, k_lay, k_rel). Returns (x_B, y_B, cells_Bx2, rel_B): X at the layout's
    first cell (row-major), Y at its second; rel 0 horizontal, 1 vertical.
    """
    k_x, k_y, k_lay, k_rel = keys
    B = batch_size
    lpp = jnp.asarray(settings.layouts_per_pair, jnp.int32)
    x_B, y_B = r1.draw_pair_labels(k_x, k_y, settings, B)
    layout_B = jnp.asarray(tables.pair_perm)[x_B, y_B, jax.random.randint(k_lay, (B,), 0, lpp)]
    cells_Bx2 = jnp.asarray(tables.layouts)[layout_B]
    ok_Bx2 = jnp.asarray(tables.rel_ok)[layout_B]
    coin = jax.random.bernoulli(k_rel, 0.5, (B,))
    rel_B = jnp.where(ok_Bx2[:, 0] & ok_Bx2[:, 1], coin, ~ok_Bx2[:, 0]).astype(jnp.int32)
    return x_B, y_B, cells_Bx2, rel_B


def _two_objects(tables, keys, settings, task, batch_size):
    """Two-object (images_BxL, caption_ids_B): X at the layout's first cell (row-major),
    Y at its second, captioned along one of the layout's valid relations (a fair coin
    when both are valid). `keys` = (k_x, k_y, k_lay, k_rel, k_form)."""
    k_x, k_y, k_lay, k_rel, k_form = keys
    n, L, B = task.n_labels, task.image_len, batch_size
    x_B, y_B, cells_Bx2, rel_B = draw_pair_layout(tables, (k_x, k_y, k_lay, k_rel), settings, B)
    first_B, second_B = _first_second(task, rel_B, x_B, y_B, cells_Bx2[:, 0], cells_Bx2[:, 1])
    images = r1.pixels(L, cells_Bx2[:, 0], x_B) + r1.pixels(L, cells_Bx2[:, 1], y_B)
    cap_B = pair_first(n, rel_B, first_B, second_B)
    if task.caption_mode == "left_right":  # "b is on the right of a" / "b is below a"
        other_B = jax.random.bernoulli(k_form, 0.5, (B,))
        cap_B = jnp.where(other_B, pair_second(n, rel_B, second_B, first_B), cap_B)
    return images, cap_B


def sample_batch(
    tables: GridTables,
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

    The first round(single_frac * B) samples are single objects (any label at one of
    its training cells, relation by a fair coin), the rest ordered pairs of distinct
    pair labels at one of the pair's training layouts, captioned with one of the
    layout's valid relations (a fair coin when both are valid).

    Args:
      tables: from `build_tables`.
      key: PRNG key of this step.
      settings: sweepable values as scalars (may be traced); reads `n_pair_labels`,
        `layouts_per_pair`, `single_frac`.
      task: static task settings (grid, caption variants).
      batch_size: B.
      finite, step, order_key: the finite-set stream is not defined for this task
        (`Config` refuses epochs > 0 with task_kind '2d'); finite must be False.

    Returns:
      images_BxL int32 (L = H W, row-major), caption_ids_B int32.
    """
    del step, order_key
    if finite:
        raise NotImplementedError("task_kind '2d' trains on streaming batches only (epochs = 0)")
    k_lab, k_pos, k_srel, *pair_keys = jax.random.split(key, 8)
    return r1.merge_parts(
        r1.singles_per_batch(settings, batch_size),
        _single_objects(tables, k_lab, k_pos, k_srel, settings, task, batch_size),
        _two_objects(tables, pair_keys, settings, task, batch_size),
    )


# ---------------------------------------------------------------------------
# fixed evaluation sets


class GridEvalSets(GroupedEvalSets):
    """The 2D validation sets (`data.tasks.grouped.GroupedEvalSets`); groups = relations."""

    __slots__ = ()
    GROUPS = RELATIONS
    GROUPED_SETS = ("single", "seen", "unseen", "labelset")


def _pair_rows(task: TaskConfig, tables: GridTables, labels):
    """Every ordered pair of `labels` at every layout, one row per valid relation.

    Returns (images [I, L], index [N], x [N], y [N], layout [N], rel [N]).
    """
    n_lay = len(tables.layouts)
    xs, ys = np.asarray([(x, y) for x in labels for y in labels if x != y]).T
    img_x = np.repeat(xs, n_lay)
    img_y = np.repeat(ys, n_lay)
    img_lay = np.tile(np.arange(n_lay), len(xs))
    images = np.zeros((len(img_x), task.image_len), np.int32)
    i = np.arange(len(img_x))
    images[i, tables.layouts[img_lay, 0]] = img_x
    images[i, tables.layouts[img_lay, 1]] = img_y
    ok = tables.rel_ok[img_lay]  # [I, 2]: relations h, v valid per image
    index, rel = np.nonzero(ok)  # row-major: image order, h before v
    return images, index, img_x[index], img_y[index], img_lay[index], rel


def _forms(task: TaskConfig, tables: GridTables, x, y, lay, rel):
    """True and swapped caption ids [N, F] of pair rows; also (first, second) labels."""
    n = task.n_labels
    cell_x, cell_y = tables.layouts[lay, 0], tables.layouts[lay, 1]
    rx, cx = _rows_cols(task, cell_x)
    ry, cy = _rows_cols(task, cell_y)
    x_first = np.where(rel == 0, cx < cy, rx < ry)
    a, b = np.where(x_first, x, y), np.where(x_first, y, x)
    true, swap = [pair_first(n, rel, a, b)], [pair_first(n, rel, b, a)]
    if task.caption_mode == "left_right":
        true.append(pair_second(n, rel, b, a))
        swap.append(pair_second(n, rel, a, b))
    return np.stack(true, 1).astype(np.int32), np.stack(swap, 1).astype(np.int32), a, b


def _single_rows(task: TaskConfig, tables: GridTables):
    """The single-object set: every label alone at each held-out cell, one row per
    relation (h, then v). Returns (images [I, L], index [N], true [N, 1], swap [N, 1],
    rel [N])."""
    n = task.n_labels
    labs, pos, images = r1.held_out_singles(task, tables)
    s_index = np.repeat(np.arange(len(labs)), 2)
    s_rel = np.tile(np.arange(2), len(labs))
    s_lab, s_pos = labs[s_index], pos[s_index]
    r, c = _rows_cols(task, s_pos)
    side = np.where(s_rel == 0, 2 * c >= task.grid_w, 2 * r >= task.grid_h).astype(np.int64)
    true = single_side(n, s_rel, s_lab, side)[:, None].astype(np.int32)
    swap = single_side(n, s_rel, s_lab, 1 - side)[:, None].astype(np.int32)
    return images, s_index, true, swap, s_rel


def _seen_rows(task: TaskConfig, tables: GridTables):
    """Seen-pair candidates: (images, index, true, swap, rel, labels [N, 2], ranks [N, 1])."""
    images, index, x, y, lay, rel = _pair_rows(task, tables, range(1, task.max_pair_labels + 1))
    true, swap, _, _ = _forms(task, tables, x, y, lay, rel)
    rank_of = np.argsort(tables.pair_perm, axis=-1)  # inverse permutation per pair
    ranks = rank_of[x, y, lay][:, None].astype(np.int32)
    return images, index, true, swap, rel, np.stack([x, y], 1), ranks


def _unseen_rows(task: TaskConfig, tables: GridTables, rng: np.random.Generator):
    """Unseen pairs and their label-set probe: (images, index, true, swap, rel,
    labelset_false [N])."""
    n = task.n_labels
    images, index, x, y, lay, rel = _pair_rows(
        task, tables, range(n - task.n_val_labels + 1, n + 1)
    )
    true, swap, a, b = _forms(task, tables, x, y, lay, rel)
    z = absent_label(rng, n, np.stack([x, y], 1))
    replace_a = rng.random(len(x)) < 0.5
    false = np.where(replace_a, pair_first(n, rel, z, b), pair_first(n, rel, a, z))
    return images, index, true, swap, rel, false.astype(np.int32)


def build_eval_sets(task: TaskConfig, tables: GridTables) -> GridEvalSets:
    """The fixed 2D validation sets (depend only on the task and data seed).

    single: every label alone at each held-out cell, under both relations.
    seen: every ordered pair of the first max_pair_labels labels at every layout and
    valid relation (masked per model by `seen_mask`); unseen: the same over the
    validation labels; labelset on the unseen rows.
    """
    _check(task)
    rng = np.random.default_rng([task.data_seed, 2])
    s_img, s_index, s_true, s_swap, s_rel = _single_rows(task, tables)
    v_img, v_index, v_true, v_swap, v_rel, v_labels, v_ranks = _seen_rows(task, tables)
    u_img, u_index, u_true, u_swap, u_rel, labelset_false = _unseen_rows(task, tables, rng)
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    return GridEvalSets(
        s_img,
        i32(s_index),
        s_true,
        s_swap,
        i32(s_rel),
        v_img,
        i32(v_index),
        v_true,
        v_swap,
        i32(v_rel),
        i32(v_labels),
        v_ranks,
        u_img,
        i32(u_index),
        u_true,
        u_swap,
        i32(u_rel),
        u_true[:, 0].copy(),
        labelset_false,
    )
