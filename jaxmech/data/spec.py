"""Scene specs: what a scene *is*, before any family renders it into its inputs.

A `SceneSpec` holds B scenes of K object slots on an H x W grid of cells (row-major
cell index r W + c; a video reads grid row f as frame f). Slot 0 is the first-named
object X of the question, slot 1 the second-named Y (label 0: the question names the
grid's middle instead), further slots unnamed distractors. A slot with label 0 is
absent; a named label at cell -1 is named by the question but not drawn.

The question is `relation_B`: 0 horizontal ("is X left or right of Y?"), 1 vertical
(above / below; before / after in a video), 2 presence ("is X shown?"). Its answer is
the relation's first word (left / above / yes) or its second (`first_word`): families
turn that into their own token ids. The twins of papers 003 / 004 are transforms of
specs (`mirror`, `mirror_pos`, `mirror_height`, `flip_facing`, `recolour`,
`swap_named`); `probe_specs` builds the grid-averaging probes of the spatial IDs.

Everything here is operators on NumPy or jnp int arrays (jittable); no family is known.

Axis names (`jaxmech.shapes`): B scenes, K object slots, L = H W cells.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PRESENCE = 2  # relation id of "is X shown?"
RELATIONS = ("horizontal", "vertical")  # the spatial relations' names, by relation id


class Grid(NamedTuple):
    """The cell grid a spec lives on: `h` rows (frames in a video) of `w` columns."""

    h: int
    w: int

    @property
    def cells(self) -> int:
        return self.h * self.w


class SceneSpec(NamedTuple):
    """B scenes (module docstring): cells_BxK, labels_BxK, colours_BxK (0 none),
    facings_BxK (0 none, 1 faces left, 2 faces right), relation_B; int32."""

    cells_BxK: jax.Array
    labels_BxK: jax.Array
    colours_BxK: jax.Array
    facings_BxK: jax.Array
    relation_B: jax.Array


def take(spec: SceneSpec, rows) -> SceneSpec:
    """The scenes at `rows` (indices or a bool mask; host NumPy)."""
    return SceneSpec(*(np.asarray(x)[rows] for x in spec))


def coord(grid: Grid, cell, relation):
    """The coordinate a relation compares: the column (0, horizontal) or the row."""
    return jnp.where(relation == 0, cell % grid.w, cell // grid.w)


def extent(grid: Grid, relation):
    return jnp.where(relation == 0, grid.w, grid.h)


def half_defined(grid: Grid, cell, relation):
    """Whether the cell lies in a half of the grid along the relation (not the middle
    column / row of an odd grid): whether a question about the middle is defined."""
    return 2 * coord(grid, cell, relation) + 1 != extent(grid, relation)


def first_word(grid: Grid, spec: SceneSpec):
    """[B] bool: the answer is the relation's first word (left / above / yes). Pairs
    compare the named objects' coordinates; with Y absent, the half of the grid X is
    in; presence: True (a family answers "no" where X is named but not drawn)."""
    rel = spec.relation_B
    a = coord(grid, spec.cells_BxK[:, 0], rel)
    b = coord(grid, spec.cells_BxK[:, 1], rel)
    single = spec.labels_BxK[:, 1] == 0
    side = jnp.where(single, 2 * a + 1 < extent(grid, rel), a < b)
    return side | (rel == PRESENCE)


# ---------------------------------------------------------------------------
# twins


def mirror_cells(grid: Grid) -> np.ndarray:
    """[L] the cell that cell i moves to under a width flip: (r, c) -> (r, W - 1 - c)."""
    cells = np.arange(grid.cells)
    return (cells // grid.w * grid.w + grid.w - 1 - cells % grid.w).astype(np.int32)


def height_mirror_cells(grid: Grid) -> np.ndarray:
    """[L] the cell that cell i moves to under a height flip: (r, c) -> (H - 1 - r, c)."""
    cells = np.arange(grid.cells)
    return ((grid.h - 1 - cells // grid.w) * grid.w + cells % grid.w).astype(np.int32)


def _move(spec: SceneSpec, perm_L) -> SceneSpec:
    c = spec.cells_BxK
    return spec._replace(cells_BxK=jnp.where(c >= 0, jnp.asarray(perm_L)[jnp.maximum(c, 0)], c))


def mirror_pos(grid: Grid, spec: SceneSpec) -> SceneSpec:
    """Positions mirrored across the width, facings kept."""
    return _move(spec, mirror_cells(grid))


def flip_facing(spec: SceneSpec) -> SceneSpec:
    """Every facing flipped in place (left <-> right)."""
    f = spec.facings_BxK
    return spec._replace(facings_BxK=(3 - f) * (f > 0))


def mirror(grid: Grid, spec: SceneSpec) -> SceneSpec:
    """The scene seen in a mirror: positions mirrored across the width, facings flipped."""
    return flip_facing(mirror_pos(grid, spec))


def mirror_height(grid: Grid, spec: SceneSpec) -> SceneSpec:
    """Positions mirrored across the height (a video: time reversed); facings kept."""
    return _move(spec, height_mirror_cells(grid))


def recolour(spec: SceneSpec, colours_BxK) -> SceneSpec:
    """The same scenes with the given colours (0 where a slot is absent)."""
    return spec._replace(colours_BxK=jnp.where(spec.labels_BxK > 0, colours_BxK, 0))


def swap_named(spec: SceneSpec) -> SceneSpec:
    """The question naming Y first and X second (`is Y ... of X ?`); every scene must
    name two objects."""
    swap = lambda x: x.at[:, :2].set(x[:, 1::-1])  # noqa: E731
    return SceneSpec(*(swap(jnp.asarray(x)) for x in spec[:4]), spec.relation_B)


def occlude(spec: SceneSpec, cell_B) -> SceneSpec:
    """The scenes with whatever stands at cell cell_B[b] not drawn (still named)."""
    c = jnp.asarray(spec.cells_BxK)
    return spec._replace(cells_BxK=jnp.where(c == jnp.asarray(cell_B)[:, None], -1, c))


# ---------------------------------------------------------------------------
# probes


def probe_specs(grid: Grid, labels, n_labels: int, n_colours: int, placements: int = 4,
                seed: int = 0, named_first: bool = True, relation: int = 0,
                factorial: bool = False):  # fmt: skip
    """Every label in `labels` at every cell, each with `placements` draws of another
    label (1..n_labels) at another cell (host NumPy), asked as a question of `relation`
    (0 horizontal, the default; 1 vertical: the second word then follows that relation's
    words); the probe label is named first (X; `named_first`) or second (Y). Returns
    (spec [N], label_N, cell_N), N = len(labels) L placements: the spatial IDs average
    states over these (the answers are not used).

    `factorial`: instead of random draws, the other object at every other cell once
    (placements = L - 1, ignored), as the papers' authors' extraction scenes are
    (`tile_two_objects.py`: every pair of distinct cells); its label cycles through the
    other labels (not every pair of labels: that would be n_labels - 1 times more
    scenes). Colours and facings are drawn from `seed` either way."""
    rng = np.random.default_rng([seed, 13])
    L = grid.cells
    reps = L - 1 if factorial else placements
    lab, cell = np.meshgrid(np.asarray(labels), np.arange(L), indexing="ij")
    lab = np.repeat(lab.ravel(), reps)
    cell = np.repeat(cell.ravel(), reps)
    N = len(lab)
    if factorial:
        j = np.arange(N) % reps  # the other cell's index among the L - 1 cells not `cell`
        other = (np.arange(N) % (L * reps)) % (n_labels - 1) + 1
    else:  # drawn first, as before the factorial option: the same seed, the same probes
        other = rng.integers(1, n_labels, N)
        j = rng.integers(0, L - 1, N)
    other = other + (other >= lab)
    other_cell = j + (j >= cell)
    colours_NxL = rng.integers(1, n_colours + 1, (N, L))  # drawn per cell, read at two
    facings_NxL = rng.integers(1, 3, (N, L))
    slots = [(lab, cell), (other, other_cell)]
    if not named_first:
        slots = slots[::-1]
    cells = np.stack([c for _, c in slots], 1).astype(np.int32)
    rows = np.arange(N)[:, None]
    spec = SceneSpec(
        cells,
        np.stack([a for a, _ in slots], 1).astype(np.int32),
        colours_NxL[rows, cells].astype(np.int32),
        facings_NxL[rows, cells].astype(np.int32),
        np.full(N, relation, np.int32),
    )
    return spec, lab, cell


# ---------------------------------------------------------------------------
# question sets (checkpoints: no eval sets of their own)


def check_pair_grid(grid: Grid, relation: int) -> None:
    """Refuses (ValueError naming the grid) a grid on which no two cells differ along
    `relation` (one column for left / right, one row for above / below): no pair
    question of that relation has an answer there."""
    along = grid.w if relation == 0 else grid.h
    if along < 2:
        name, axis = RELATIONS[relation], "column" if relation == 0 else "row"
        raise ValueError(
            f"grid = {grid.h}x{grid.w}: {name} questions need two cells that differ along "
            f"the relation, and this grid has one {axis}; use a grid with 2+ {axis}s"
        )


def pair_questions(grid: Grid, n: int, n_labels: int, n_colours: int, seed: int = 0,
                   relation: int = 0) -> dict:  # fmt: skip
    """{"examples": spec [n], "mirror": spec, "recolour": spec}: n two-object questions of
    `relation` (0 horizontal) for a model with no eval sets of its own (a checkpoint):
    two different labels at two cells that differ along the relation (so the answer is
    defined), each with a colour and a facing; the twins are the width mirror (`mirror`;
    the height mirror for relation 1) and every object recoloured to another colour.
    Host NumPy, drawn from (`seed`, `relation`) alone."""
    if n < 1:
        raise ValueError(f"n = {n}: expected at least one question")
    if n_labels < 2 or n_colours < 2:
        raise ValueError(f"n_labels = {n_labels}, n_colours = {n_colours}: expected 2+ each")
    check_pair_grid(grid, relation)
    rng = np.random.default_rng([seed, 27, relation])
    L = grid.cells
    cells = np.stack([rng.permutation(L)[:2] for _ in range(n)])
    axis = (lambda c: c % grid.w) if relation == 0 else (lambda c: c // grid.w)
    same = axis(cells[:, 0]) == axis(cells[:, 1])
    while same.any():  # redraw Y where it is level with X along the relation
        cells[same, 1] = rng.integers(0, L, same.sum())
        same = axis(cells[:, 0]) == axis(cells[:, 1])
    labels = np.stack([rng.permutation(n_labels)[:2] + 1 for _ in range(n)])
    colours = rng.integers(1, n_colours + 1, (n, 2))
    spec = SceneSpec(
        cells.astype(np.int32),
        labels.astype(np.int32),
        colours.astype(np.int32),
        rng.integers(1, 3, (n, 2)).astype(np.int32),
        np.full(n, relation, np.int32),
    )
    other = (colours - 1 + rng.integers(1, n_colours, (n, 2))) % n_colours + 1
    twin = mirror(grid, spec) if relation == 0 else mirror_height(grid, spec)
    as_np = lambda s: SceneSpec(*(np.asarray(x) for x in s))  # noqa: E731
    return {
        "examples": spec,
        "mirror": as_np(twin),
        "recolour": as_np(recolour(spec, other.astype(np.int32))),
    }
