"""The scenes task (`task_kind = "scenes"`): grid scenes and one-token spatial questions.

Built for the autoregressive VLM: a ViT reads the cells, a causal LM reads
the projected image tokens and a question and answers with one token.

Images: an `H x W` grid (`grid_h`, `grid_w`), L = H W cells in row-major order (cell
(r, c) is index r W + c). A cell is background or one object with three attributes,
each an int32 array `[B, L]`: `labels` (0 background, 1..n_labels), `colours` (0
background, 1..n_colours), `facings` (0 background, 1 faces left, 2 faces right).
Labels are distinct within an image.

Questions (Q = 8 tokens, `question_tokens`): `[is, X, A, or, B, of, Y, ?]` with (A, B) =
(left, right) for a horizontal question (relation 0) and (above, below) for a vertical
one (relation 1); the answer is one token, A or B. In a single-object question Y is
`mid`, answered by the half of the grid X is in. A presence question (relation
`PRESENCE`, single-object images only) is `[is, X, yes, or, no, of, mid, ?]`: is label X
the object shown? Vocabulary: `SCENE_WORDS` at ids 0..10, label l at id 10 + l
(`label_token`), V = 11 + n_labels (`vocab_size`).

Samples (`sample_batch`, streaming only):
  two objects  a training pair (X, Y) at one of its training layouts (X at the layout's
               first cell row-major, Y at its second, as in `relations2d`), random
               colours and facings, with probability `third_frac` a third, distractor
               object (another non-validation label at a free cell). The question asks
               a relation valid for X and Y (horizontal only if their columns differ,
               vertical only if their rows differ; a fair coin when both are), naming X
               or Y first by a fair coin, so the answer is not the naming order.
  one object   the first round(single_frac B) rows: any label at one of its training
               cells, "is X left or right of mid ?" / "is X above or below mid ?",
               uniform over the (cell, relation) combinations that are defined (a cell
               in the middle column / row of an odd W / H has no left / above half).
               With probability `present_frac` a row asks presence instead: X is the
               object's label or, by a fair coin, another label (answer yes / no). With
               probability `absent_frac` a side question names another label than the
               one shown, answered `no`. These are the only questions that need the word
               of a validation label to find its picture (a side question about the one
               object shown can ignore the word).

Label split, layouts and held-out cells are those of SPEC and `relations1d` with
L = H W (the same draws from the data seed): validation labels (the last
n_val_labels) are never in a two-object training image; each ordered pair's layouts
are ordered by the data seed, the first `layouts_per_pair` train and the rest are its
seen-pair validation layouts; each label holds out `n_single_holdout` cells.

Evaluation sets (`build_eval_sets`, host NumPy, each at most `eval_size` examples):
`seen_pair`, `unseen_pair`, `train_pair`, `single`, each a `SceneEvalSet` carrying its
examples, their four counterfactual twins (`TWINS`: mirror, mirror_pos, flip_facing,
recolour) and what `eval_masks` needs to select one model's rows under its sweepable
`n_pair_labels` / `layouts_per_pair`.

Axis names (`jaxmech.shapes`): B batch rows (N for a fixed set), L cells, Q question
tokens; K = 3 object slots (first-named, second-named, distractor) in `SceneObjects`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import (
    ConfigError,
    Settings,
    TaskConfig,
    derive_grid,
    float_in,
    int_in,
    normalise,
)
from jaxmech.data import spec
from jaxmech.data.spec import Grid, SceneSpec
from jaxmech.data.tasks import relations1d as r1
from jaxmech.data.tasks.relations2d import draw_pair_layout


@dataclasses.dataclass(frozen=True)
class SceneConfig(TaskConfig):
    """The scenes (and video) task's config: a `grid_h x grid_w` grid of cells
    (`image_len` derived), `n_colours` colours, the shares of distractors
    (`third_frac`), presence questions (`present_frac`) and questions about an absent
    label (`absent_frac`), and the size of each fixed eval set (`eval_size`)."""

    task_kind: str = "scenes"
    grid_h: int = 4
    grid_w: int = 4
    n_colours: int = 4
    third_frac: float = 0.0
    present_frac: float = 0.0
    absent_frac: float = 0.0
    eval_size: int = 512

    def __post_init__(self):
        normalise(self)
        derive_grid(self)
        super().__post_init__()
        int_in("n_colours", self.n_colours, 2, 1024, " (the recolour twin needs 2+)")
        for name in ("third_frac", "present_frac", "absent_frac"):
            float_in(name, getattr(self, name), 0.0, 1.0)
        int_in("eval_size", self.eval_size, 8, 1 << 20)


__all__ = [
    "SCENE_WORDS",
    "TOKEN",
    "Q_LEN",
    "X_SLOT",
    "Y_SLOT",
    "RELATIONS",
    "TWINS",
    "PRESENCE",
    "SceneBatch",
    "SceneTables",
    "SceneEvalSet",
    "SceneEvalSets",
    "vocab_size",
    "label_token",
    "build_tables",
    "sample_batch",
    "build_eval_sets",
    "eval_masks",
    "describe",
    "SceneObjects",
    "render",
    "question_tokens",
]

SCENE_WORDS = ("?", "is", "left", "right", "above", "below", "yes", "no", "or", "of", "mid")
TOKEN = {w: i for i, w in enumerate(SCENE_WORDS)}
Q_LEN = 8
X_SLOT, Y_SLOT = 1, 6  # the object words' question slots (`[is, X, A, or, B, of, Y, ?]`)
RELATIONS = ("h", "v")  # the evaluated relations; questions may also be PRESENCE
PRESENCE = 2  # relation id of "is X yes or no of mid ?": is label X in the image?
TWINS = ("mirror", "mirror_pos", "flip_facing", "recolour")
N_SLOTS = 3  # object slots: first-named, second-named (absent: `mid`), distractor


def vocab_size(task: TaskConfig) -> int:
    """V = len(SCENE_WORDS) + n_labels: the LM's question and answer vocabulary."""
    return len(SCENE_WORDS) + task.n_labels


def label_token(label):
    """Token id of label l (1-based; ints or arrays): 10 + l."""
    return len(SCENE_WORDS) - 1 + label


class SceneBatch(NamedTuple):
    """Images, questions and answers (jax or NumPy int32 arrays; the data/model contract).

    labels_BxL, colours_BxL, facings_BxL: the cells' attributes (0 background).
    question_BxQ: `[is, X, A, or, B, of, Y, ?]` tokens. answer_B: the answer token (A or
    B). relation_B: 0 horizontal (left / right), 1 vertical (above / below).
    """

    labels_BxL: jax.Array
    colours_BxL: jax.Array
    facings_BxL: jax.Array
    question_BxQ: jax.Array
    answer_B: jax.Array
    relation_B: jax.Array


# A scene before rendering: K = 3 slots per row (first-named object, second-named object,
# distractor), the scene spec of every VLM family (`data.spec`). A single-object question
# names `mid` as its second object and has no distractor; a first-named label at cell -1
# is named but not in the image (answer `no`; the object shown is in the distractor slot).
SceneObjects = SceneSpec


# ---------------------------------------------------------------------------
# geometry, rendering and questions (NumPy or jnp inputs; jittable)


def grid_of(task: TaskConfig) -> Grid:
    """The task's cell grid (`data.spec.Grid`)."""
    return Grid(task.grid_h, task.grid_w)


def _coord(task: TaskConfig, cell, relation):
    return spec.coord(grid_of(task), cell, relation)


def _half_defined(task: TaskConfig, cell, relation):
    return spec.half_defined(grid_of(task), cell, relation)


def question_tokens(relation_B, first_label_B, second_label_B):
    """question_BxQ `[is, X, A, or, B, of, Y, ?]`; second label 0 means `mid`."""
    a = TOKEN["left"] + 2 * relation_B
    y = jnp.where(second_label_B > 0, label_token(second_label_B), TOKEN["mid"])
    cols = [TOKEN["is"], label_token(first_label_B), a, TOKEN["or"], a + 1, TOKEN["of"], y]
    cols = [jnp.broadcast_to(c, relation_B.shape) for c in cols + [TOKEN["?"]]]
    return jnp.stack(cols, 1).astype(jnp.int32)


def render(task: TaskConfig, objects: SceneObjects) -> SceneBatch:
    """The SceneBatch of a scene: attribute images, question and answer token."""
    cell_BxLxK = jnp.arange(task.image_len)[None, :, None] == objects.cells_BxK[:, None, :]
    here_BxLxK = cell_BxLxK & (objects.labels_BxK > 0)[:, None, :]

    def paint(attr_BxK):
        return jnp.where(here_BxLxK, attr_BxK[:, None, :], 0).sum(-1).astype(jnp.int32)

    rel = objects.relation_B.astype(jnp.int32)
    answer = TOKEN["left"] + 2 * rel + 1 - spec.first_word(grid_of(task), objects).astype(jnp.int32)
    answer = jnp.where(objects.cells_BxK[:, 0] < 0, TOKEN["no"], answer)  # X absent
    return SceneBatch(
        paint(objects.labels_BxK),
        paint(objects.colours_BxK),
        paint(objects.facings_BxK),
        question_tokens(rel, objects.labels_BxK[:, 0], objects.labels_BxK[:, 1]),
        answer.astype(jnp.int32),
        rel,
    )


def _skip_two(z, lo, hi):
    """Maps z in [0, m) onto [0, m + 2) minus {lo, hi} (lo < hi), order kept: draws a
    value distinct from two taken ones. Operators only, so NumPy and jnp both work."""
    z = z + (z >= lo)
    return z + (z >= hi)


# ---------------------------------------------------------------------------
# counterfactual twins: the spec transforms of `data.spec`, rendered


def _twins(task: TaskConfig, objects: SceneObjects, rng: np.random.Generator) -> list:
    """The `TWINS` of the scenes `objects`, each `data.spec`'s transform rendered. The
    recolour twin's shifts are drawn per cell ([B, L], in 1..n_colours - 1): colour c ->
    (c - 1 + s) mod n_colours + 1 at each object's cell."""
    grid = grid_of(task)
    shift_BxL = rng.integers(1, task.n_colours, (objects.labels_BxK.shape[0], task.image_len))
    at_cell = np.take_along_axis(shift_BxL, np.maximum(np.asarray(objects.cells_BxK), 0), 1)
    colours = (np.asarray(objects.colours_BxK) - 1 + at_cell) % task.n_colours + 1
    twins = {
        "mirror": spec.mirror(grid, objects),
        "mirror_pos": spec.mirror_pos(grid, objects),
        "flip_facing": spec.flip_facing(objects),
        "recolour": spec.recolour(objects, colours),
    }
    return [render(task, twins[name]) for name in TWINS]


# ---------------------------------------------------------------------------
# tables


class SceneTables(NamedTuple):
    """What the data seed fixes (arrays indexed by 1-based label; row 0 unused).

    layouts:     [n_layouts, 2]             (cell of X, cell of Y), X's first row-major
    rel_ok:      [n_layouts, 2] bool        which relations (h, v) the layout has
    pair_perm:   [n+1, n+1, n_layouts]      per ordered pair, layouts in training order
    train_pos:   [n+1, L - n_single_holdout] cells a label trains on alone
    single_ok:   [n+1, L - n_single_holdout, 2] bool  relation defined at that cell
    holdout_pos: [n+1, n_single_holdout]    cells held out for the single set
    """

    layouts: np.ndarray
    rel_ok: np.ndarray
    pair_perm: np.ndarray
    train_pos: np.ndarray
    single_ok: np.ndarray
    holdout_pos: np.ndarray


def _check(task: TaskConfig) -> None:
    """Scene-specific config checks (ConfigError naming the field)."""
    if not isinstance(task, SceneConfig):  # video: `data.tasks.video` on these tables
        raise ConfigError(
            f"task_kind = {task.task_kind!r} is invalid here: data.tasks.scenes needs a SceneConfig"
        )
    if task.third_frac > 0 and task.max_pair_labels < 3:
        raise ConfigError(
            f"third_frac = {task.third_frac} is invalid with n_labels - n_val_labels = "
            f"{task.max_pair_labels}: a distractor needs a third non-validation label "
            "(raise n_labels or set third_frac = 0)"
        )


def build_tables(task: TaskConfig) -> SceneTables:
    """Host-side tables for `task`, fixed by `task.data_seed` (the 1D draws with
    L = H W, as `relations2d`)."""
    _check(task)
    t = r1.build_tables(task)
    rel_ok = np.stack(
        [
            np.asarray(_coord(task, t.layouts[:, 0], r) != _coord(task, t.layouts[:, 1], r))
            for r in (0, 1)
        ],
        1,
    )
    single_ok = np.stack([np.asarray(_half_defined(task, t.train_pos, r)) for r in (0, 1)], -1)
    if not single_ok[1:].any((1, 2)).all():
        raise ConfigError(
            f"n_single_holdout = {task.n_single_holdout} is invalid for a "
            f"{task.grid_h} x {task.grid_w} grid with data_seed = {task.data_seed}: a "
            "label keeps no training cell off the middle column and row (lower it)"
        )
    return SceneTables(t.layouts, rel_ok, t.pair_perm, t.train_pos, single_ok, t.holdout_pos)


# ---------------------------------------------------------------------------
# jittable sampling


def _attributes(key, task: TaskConfig, batch_size: int):
    """Random colours (1..n_colours) and facings (1 / 2), [B, K] each."""
    k_col, k_face = jax.random.split(key)
    shape = (batch_size, N_SLOTS)
    return (
        jax.random.randint(k_col, shape, 1, task.n_colours + 1),
        jax.random.randint(k_face, shape, 1, 3),
    )


def _single_objects(tables: SceneTables, key, task: TaskConfig, batch_size: int):
    """Single-object scenes: any label at one of its training cells, uniform over the
    (cell, relation) combinations whose question is defined; with prob. present_frac a
    presence question. A question about an absent label ("no" rows: half the presence
    questions, absent_frac of the side questions) names another label in slot 0 at
    cell -1 (painted nowhere) and puts the object shown in the distractor slot."""
    k_lab, k_combo, k_attr, k_pres, k_yes, k_abs, k_other = jax.random.split(key, 7)
    label_B = jax.random.randint(k_lab, (batch_size,), 1, task.n_labels + 1)
    ok_BxC = jnp.asarray(tables.single_ok)[label_B].reshape(batch_size, -1)
    combo_B = jax.random.categorical(k_combo, jnp.where(ok_BxC, 0.0, -jnp.inf))
    cell_B = jnp.asarray(tables.train_pos)[label_B, combo_B // 2]
    presence = jax.random.bernoulli(k_pres, task.present_frac, (batch_size,))
    absent = jnp.where(
        presence,
        jax.random.bernoulli(k_yes, 0.5, (batch_size,)),
        jax.random.bernoulli(k_abs, task.absent_frac, (batch_size,)),
    )
    other_B = jax.random.randint(k_other, (batch_size,), 1, task.n_labels)
    other_B = other_B + (other_B >= label_B)  # any label but the one shown
    zeros = jnp.zeros_like(label_B)
    colours, facings = _attributes(k_attr, task, batch_size)
    return SceneObjects(
        jnp.stack([jnp.where(absent, -1, cell_B), zeros, cell_B], 1),
        jnp.stack([jnp.where(absent, other_B, label_B), zeros, absent * label_B], 1),
        colours,
        facings,
        jnp.where(presence, PRESENCE, combo_B % 2),
    )


def _distractor(key, task: TaskConfig, x_B, y_B, cells_Bx2):
    """(label_B, cell_B, present_B) of a third object: another non-validation label at a
    free cell, present with probability third_frac."""
    k_on, k_lab, k_cell = jax.random.split(key, 3)
    B = x_B.shape[0]
    present = jax.random.bernoulli(k_on, task.third_frac, (B,))
    z = jax.random.randint(k_lab, (B,), 1, max(task.max_pair_labels - 1, 2))
    label = _skip_two(z, jnp.minimum(x_B, y_B), jnp.maximum(x_B, y_B))
    c = jax.random.randint(k_cell, (B,), 0, task.image_len - 2)
    cell = _skip_two(c, cells_Bx2.min(1), cells_Bx2.max(1))
    return jnp.where(present, label, 0), cell


def _pair_objects(tables: SceneTables, key, settings: Settings, task: TaskConfig, B: int):
    """Two-object scenes: a training pair at a training layout, a valid relation (a fair
    coin when both are), a random naming order, a distractor with prob. third_frac."""
    k_x, k_y, k_lay, k_rel, k_order, k_third, k_attr = jax.random.split(key, 7)
    x_B, y_B, cells_Bx2, rel_B = draw_pair_layout(tables, (k_x, k_y, k_lay, k_rel), settings, B)
    z_B, z_cell_B = _distractor(k_third, task, x_B, y_B, cells_Bx2)
    y_first = jax.random.bernoulli(k_order, 0.5, (B,))[:, None]
    named_labels = jnp.where(y_first, jnp.stack([y_B, x_B], 1), jnp.stack([x_B, y_B], 1))
    named_cells = jnp.where(y_first, cells_Bx2[:, ::-1], cells_Bx2)
    colours, facings = _attributes(k_attr, task, B)
    return SceneObjects(
        jnp.concatenate([named_cells, z_cell_B[:, None]], 1),
        jnp.concatenate([named_labels, z_B[:, None]], 1),
        colours,
        facings,
        rel_B,
    )


def sample_batch(
    tables: SceneTables,
    key: jax.Array,
    settings: Settings,
    task: TaskConfig,
    batch_size: int,
    *,
    finite: bool = False,
    step=0,
    order_key: jax.Array | None = None,
) -> SceneBatch:
    """One streaming training batch for one model (module docstring: Samples).

    Args:
      tables: from `build_tables`.
      key: PRNG key of this step.
      settings: this model's sweepable values as scalars (may be traced); reads
        `n_pair_labels`, `layouts_per_pair`, `single_frac`.
      task: static task settings (grid, colours, third_frac).
      batch_size: B.
      finite, step, order_key: the finite-set stream is not defined for scenes
        (`Config` refuses epochs > 0 for every kind but '1d'); finite must be False.

    Returns:
      SceneBatch of int32 arrays; the first round(single_frac B) rows are single-object.
    """
    del step, order_key
    if finite:
        raise NotImplementedError(
            "task_kind 'scenes' trains on streaming batches only (epochs = 0)"
        )
    k_single, k_pair = jax.random.split(key)
    single = _single_objects(tables, k_single, task, batch_size)
    pair = _pair_objects(tables, k_pair, settings, task, batch_size)
    is_single_B = jnp.arange(batch_size) < r1.singles_per_batch(settings, batch_size)

    def pick(s, p):
        return jnp.where(is_single_B.reshape((-1,) + (1,) * (s.ndim - 1)), s, p)

    return render(task, jax.tree_util.tree_map(pick, single, pair))


# ---------------------------------------------------------------------------
# fixed evaluation sets


class SceneEvalSet(NamedTuple):
    """One fixed validation set of N examples (host NumPy) with its twins.

    examples: SceneBatch [N]. mirror, mirror_pos, flip_facing, recolour: its
    counterfactual twins (`TWINS`), SceneBatches with the same questions and their own
    answers. cells_Nx3: cells of the first-named object, the second-named one and the
    distractor (-1: none). pair_Nx2: the pair (X, Y) in layout order (X's cell first
    row-major; single: (label, 0)). rank_N: the layout's place in the pair's training
    order (trained on iff rank < layouts_per_pair; -1 for the unseen and single sets).
    """

    examples: SceneBatch
    mirror: SceneBatch
    mirror_pos: SceneBatch
    flip_facing: SceneBatch
    recolour: SceneBatch
    cells_Nx3: np.ndarray
    pair_Nx2: np.ndarray
    rank_N: np.ndarray


class SceneEvalSets(NamedTuple):
    """The scenes validation sets (`build_eval_sets`); select a model's rows with
    `eval_masks` (seen_pair and train_pair depend on its sweepable settings)."""

    seen_pair: SceneEvalSet
    unseen_pair: SceneEvalSet
    train_pair: SceneEvalSet
    single: SceneEvalSet


def eval_masks(evals: SceneEvalSets, settings: Settings) -> dict[str, jax.Array]:
    """{set name: [N] bool} the rows of each set that belong to one model's set.

    seen_pair: both labels are training-pair labels of the model (<= n_pair_labels) and
    the layout is held out (rank >= layouts_per_pair); train_pair: both labels trained
    and the layout trained (rank < layouts_per_pair); unseen_pair, single: every row.
    `settings` holds one model's scalars (traced under vmap). Average a metric over a
    set as `(m * mask).sum() / mask.sum()`.
    """
    n_pair = jnp.asarray(settings.n_pair_labels)
    lpp = jnp.asarray(settings.layouts_per_pair)

    def pair_ok(s: SceneEvalSet):
        return (jnp.asarray(s.pair_Nx2) <= n_pair).all(-1)

    every = lambda s: jnp.ones(s.rank_N.shape, bool)  # noqa: E731
    return {
        "seen_pair": pair_ok(evals.seen_pair) & (jnp.asarray(evals.seen_pair.rank_N) >= lpp),
        "unseen_pair": every(evals.unseen_pair),
        "train_pair": pair_ok(evals.train_pair) & (jnp.asarray(evals.train_pair.rank_N) < lpp),
        "single": every(evals.single),
    }


class _Candidates(NamedTuple):
    """Every (ordered pair, layout, valid relation, naming order) of a label set, [N]."""

    x: np.ndarray
    y: np.ndarray
    layout: np.ndarray
    relation: np.ndarray
    y_first: np.ndarray


def _pair_candidates(tables: SceneTables, labels) -> _Candidates:
    xs, ys = np.asarray([(x, y) for x in labels for y in labels if x != y]).T
    n_lay = len(tables.layouts)
    pair, lay, rel = np.nonzero(np.broadcast_to(tables.rel_ok, (len(xs), n_lay, 2)))
    order = np.arange(2 * len(pair)) % 2
    pick = np.repeat(np.arange(len(pair)), 2)
    return _Candidates(xs[pair][pick], ys[pair][pick], lay[pick], rel[pick], order)


def _choose(rng: np.random.Generator, n: int, size: int, weight=None) -> np.ndarray:
    """Sorted indices of min(size, n) distinct rows, with probability ~ weight."""
    if n <= size:
        return np.arange(n)
    p = None if weight is None else weight / weight.sum()
    return np.sort(rng.choice(n, size, replace=False, p=p))


def _pair_objects_np(task: TaskConfig, tables: SceneTables, c: _Candidates, rng):
    """SceneObjects (NumPy) of chosen pair candidates, with random attributes and a
    distractor (another non-validation label at a free cell) with prob. third_frac."""
    N, m = len(c.x), task.max_pair_labels
    cells = tables.layouts[c.layout]
    in_range = (c.x <= m).astype(np.int64) + (c.y <= m)  # pair labels that z must avoid
    z = rng.integers(1, m - in_range + 1) if N else np.zeros(0, np.int64)
    lo, hi = np.minimum(c.x, c.y), np.maximum(c.x, c.y)
    z = _skip_two(z, np.where(lo <= m, lo, m + 1), np.where(hi <= m, hi, m + 1))
    z_cell = _skip_two(rng.integers(0, task.image_len - 2, N), cells.min(1), cells.max(1))
    z = np.where(rng.random(N) < task.third_frac, z, 0)
    yf = c.y_first.astype(bool)[:, None]
    named_labels = np.where(yf, np.stack([c.y, c.x], 1), np.stack([c.x, c.y], 1))
    named_cells = np.where(yf, cells[:, ::-1], cells)
    return SceneObjects(
        np.concatenate([named_cells, z_cell[:, None]], 1),
        np.concatenate([named_labels, z[:, None]], 1),
        rng.integers(1, task.n_colours + 1, (N, N_SLOTS)),
        rng.integers(1, 3, (N, N_SLOTS)),
        c.relation,
    )


def _eval_set(task: TaskConfig, objects: SceneObjects, pair_Nx2, rank_N, rng) -> SceneEvalSet:
    """Renders a set (host NumPy) and builds its twins."""
    as_np = lambda tree: jax.tree_util.tree_map(np.asarray, tree)  # noqa: E731
    examples = as_np(render(task, objects))
    twins = [as_np(t) for t in _twins(task, objects, rng)]
    cells = np.where(objects.labels_BxK > 0, objects.cells_BxK, -1).astype(np.int32)
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    return SceneEvalSet(examples, *twins, cells, i32(pair_Nx2), i32(rank_N))


def _pair_set(task, tables, labels, rng, weight_of_rank=None) -> SceneEvalSet:
    """A pair set over `labels`: every ordered pair, layout, valid relation and naming
    order, at most eval_size of them drawn, weighted by `weight_of_rank(layout rank)`
    for training pairs; None: validation pairs, drawn uniformly, rank_N = -1."""
    c = _pair_candidates(tables, labels)
    rank_of = np.argsort(tables.pair_perm, axis=-1)  # inverse permutation per pair
    rank = rank_of[c.x, c.y, c.layout]
    w = None if weight_of_rank is None else weight_of_rank(rank)
    keep = _choose(rng, len(c.x), task.eval_size, w)
    c, rank = _Candidates(*(a[keep] for a in c)), rank[keep]
    if weight_of_rank is None:  # not a training-pair set: no layout rank
        rank = np.full(len(keep), -1)
    objects = _pair_objects_np(task, tables, c, rng)
    return _eval_set(task, objects, np.stack([c.x, c.y], 1), rank, rng)


def _single_set(task: TaskConfig, tables: SceneTables, rng) -> SceneEvalSet:
    """Every label alone at each held-out cell, under each relation defined there."""
    labs, pos, _ = r1.held_out_singles(task, tables)
    ok = np.stack([np.asarray(_half_defined(task, pos, r)) for r in (0, 1)], 1)
    ok &= tables.single_ok[1:].any((0, 1))  # a relation never asked in training is not here

    row, rel = np.nonzero(ok)
    keep = _choose(rng, len(row), task.eval_size)
    lab, cell, rel = labs[row][keep], pos[row][keep], rel[keep]
    N, zeros = len(lab), np.zeros(len(lab), np.int64)
    objects = SceneObjects(
        np.stack([cell, zeros, zeros], 1),
        np.stack([lab, zeros, zeros], 1),
        rng.integers(1, task.n_colours + 1, (N, N_SLOTS)),
        rng.integers(1, 3, (N, N_SLOTS)),
        rel,
    )
    return _eval_set(task, objects, np.stack([lab, zeros], 1), np.full(N, -1), rng)


def build_eval_sets(task: TaskConfig, tables: SceneTables) -> SceneEvalSets:
    """The fixed validation sets (depend only on the task's static fields and data seed;
    never on the sweepable n_pair_labels / layouts_per_pair, which `eval_masks` applies).

    seen_pair: training-pair candidates (labels 1..max_pair_labels, every layout);
      a model keeps the rows at its held-out layouts. Drawn with weight 1 / (n_layouts -
      rank), so late (held-out) ranks dominate and a large layouts_per_pair keeps rows.
    train_pair: the same candidates drawn with weight 1 / (rank + 1) (early, trained
      ranks dominate); a model keeps the rows at its training layouts (memorisation).
      The weights do not bias a masked mean: each pair's layout order is a random
      permutation, so a layout's rank says nothing about it beyond trained / held out.
    unseen_pair: ordered pairs of validation labels, every layout, drawn uniformly.
    single: every label alone at each held-out cell, each relation defined there.
    Pair sets have both relations and naming orders, distractors with prob. third_frac.
    """
    _check(task)
    rng = np.random.default_rng([task.data_seed, 12])
    n, m, n_lay = task.n_labels, task.max_pair_labels, len(tables.layouts)
    train_labels = range(1, m + 1)
    return SceneEvalSets(
        seen_pair=_pair_set(task, tables, train_labels, rng, lambda r: 1.0 / (n_lay - r)),
        unseen_pair=_pair_set(task, tables, range(m + 1, n + 1), rng),
        train_pair=_pair_set(task, tables, train_labels, rng, lambda r: 1.0 / (r + 1.0)),
        single=_single_set(task, tables, rng),
    )


def _spec_of(task: TaskConfig, s: SceneEvalSet) -> SceneSpec:
    """The spec the set's examples were rendered from (`render` gives them back)."""
    cells = np.asarray(s.cells_Nx3)
    at = lambda img: np.take_along_axis(np.asarray(img), np.maximum(cells, 0), 1)  # noqa: E731
    here = cells >= 0
    q = np.asarray(s.examples.question_BxQ)
    named = np.stack([q[:, X_SLOT], q[:, Y_SLOT]], 1) - label_token(0)
    named = np.where(named > 0, named, 0)  # `mid` names no object
    labels = np.concatenate([named, np.where(here[:, 2:], at(s.examples.labels_BxL)[:, 2:], 0)], 1)
    paint = lambda img: np.where(here, at(img), 0).astype(np.int32)  # noqa: E731
    rel = np.asarray(s.examples.relation_B, np.int32)
    colours, facings = paint(s.examples.colours_BxL), paint(s.examples.facings_BxL)
    return SceneSpec(cells.astype(np.int32), labels.astype(np.int32), colours, facings, rel)


def eval_specs(task: TaskConfig, s: SceneEvalSet, mirror_twin=spec.mirror) -> dict:
    """{"examples": spec, twin: spec for each of `TWINS`}: the set as scene specs, the
    twins as transforms of the examples' spec (the recolour twin's colours read from it;
    `mirror_twin(grid, spec)` makes the mirror twins). Rendering each gives the set's
    stored batch (tested)."""
    grid, ex = grid_of(task), _spec_of(task, s)
    cells = np.maximum(np.asarray(ex.cells_BxK), 0)
    colours = np.take_along_axis(np.asarray(s.recolour.colours_BxL), cells, 1)
    mirror_pos_twin = spec.mirror_pos if mirror_twin is spec.mirror else mirror_twin
    return {
        "examples": ex,
        "mirror": mirror_twin(grid, ex),
        "mirror_pos": mirror_pos_twin(grid, ex),
        "flip_facing": spec.flip_facing(ex),
        "recolour": spec.recolour(ex, colours),
    }


# ---------------------------------------------------------------------------
# debugging


def describe(batch: SceneBatch, task: TaskConfig, i: int = 0, words=SCENE_WORDS) -> str:
    """Row i of a batch as text: the grid (label, colour letter, facing arrow per
    object; `.` background), then the question and its answer (`words`: the names of
    the word ids, e.g. `data.tasks.video.VIDEO_WORDS`)."""
    labels, colours, facings = (np.asarray(a[i]) for a in batch[:3])
    arrow = {1: "<", 2: ">"}
    cells = [
        f"{labels[j]}{chr(ord('a') + colours[j] - 1)}{arrow[int(facings[j])]}" if labels[j] else "."
        for j in range(task.image_len)
    ]
    grid = [
        " ".join(f"{c:>5}" for c in cells[r * task.grid_w : (r + 1) * task.grid_w])
        for r in range(task.grid_h)
    ]

    def word(t):
        t = int(t)
        return words[t] if t < len(words) else str(t - len(words) + 1)

    question = " ".join(word(t) for t in np.asarray(batch.question_BxQ[i]))
    return "\n".join(grid + [f"{question} -> {word(batch.answer_B[i])}"])
