"""Fig. 6C and 6D's question sets for the arbitrary-steering report: near / far and in
between, asked of drawn pictures (`reports.target_steering` steers them).

  near_far    `arbitrary_steering/batch_nearfar.py`: "Is the X near or far from the
              Y?", read "Near" / "Far". jaxmech asks it of the left / right batch's
              pictures (the depth diagnosis re-asks its pictures the same way); the
              truth, and the answer a target implies, is the distance to Y's cell:
              near where the two cells touch (Chebyshev distance 1, diagonals
              included), far from 2 on, none at Y's own cell. Their Objaverse renders
              (X and Y at the two ends of a row, "near" written where X is at 0-0) are
              not drawn here: that label names no distance a drawn grid has.
  in_between  `batch_inbetween.py`: "Is the X in between Y and Z?", read "Yes" / "No",
              on three-object pictures drawn as theirs are read (`between_scenes`): Y
              at the top and Z at the bottom of the middle column (their figure's
              column 2 of 4), X between them in half the scenes, in another column in
              the rest. A target implies "Yes" inside the box Y and Z span (their
              cells left out: level with an object, no answer), "No" outside it. The
              authors' mirror of this set is across the height (their `(i, 3 - j)`).

Both sets' implied answers read Y's (and Z's) cells under either protocol: a drawn
scene knows them, where the authors' left / right read a photograph's target against
its own mirror. The words are the view's wording's: "Near" / "Far" (jaxmech's) or
"near" / "far" quoted (the authors', as their left / right are quoted), read from the
checkpoint's tokenizer; "Yes" / "No" are the view's presence words.

Axis names (`jaxmech.shapes`): B questions, T targets, K object slots.
"""

from __future__ import annotations

import numpy as np

from jaxmech.data.inputs import pictures
from jaxmech.data.spec import Grid, SceneSpec
from jaxmech.families.vlm_view import Examples

PRESENCE = 2  # the view's yes / no row of `answer_words`
# per wording: (question template, answer words) of each set; {z}: in between's third
ASKED = {
    "near_far": {
        "jaxmech": ("Is the {x} near or far from the {y}? Answer with one word.", ("Near", "Far")),
        "authors": ('Is the {x} near or far from the {y}? Answer "near" or "far" only.',
                    ("near", "far")),
    },
    "in_between": {
        "jaxmech": ("Is the {x} between the {y} and the {z}? Answer with one word.", None),
        "authors": ('Is the {x} in between {y} and {z}? Answer "yes" or "no" only.', None),
    },
}  # fmt: skip


def near_sides(grid: Grid, target_T, y_B) -> np.ndarray:
    """[T, B] +1 where target t touches Y's cell (Chebyshev distance 1: "near"), -1 where
    it is farther ("far"), 0 at Y's cell."""
    t, y = np.asarray(target_T)[:, None], np.asarray(y_B)[None]
    d = np.maximum(np.abs(t // grid.w - y // grid.w), np.abs(t % grid.w - y % grid.w))
    return np.where(d == 0, 0, np.where(d == 1, 1, -1)).astype(np.int32)


def between_sides(grid: Grid, target_T, y_B, z_B) -> np.ndarray:
    """[T, B] +1 where target t lies in the box Y's and Z's cells span ("yes"), -1
    outside it ("no"), 0 at Y's or Z's cell."""
    t, y, z = np.asarray(target_T)[:, None], np.asarray(y_B)[None], np.asarray(z_B)[None]
    r, c = t // grid.w, t % grid.w
    rows = (np.minimum(y // grid.w, z // grid.w) <= r) & (r <= np.maximum(y // grid.w, z // grid.w))
    lo, hi = np.minimum(y % grid.w, z % grid.w), np.maximum(y % grid.w, z % grid.w)
    inside = rows & (lo <= c) & (c <= hi)
    return np.where((t == y) | (t == z), 0, np.where(inside, 1, -1)).astype(np.int32)


def between_column(grid: Grid) -> int:
    """The column Y and Z stand in: the middle (their figure's column 2 of 4)."""
    return grid.w // 2


def between_scenes(grid: Grid, n: int, n_labels: int, n_colours: int, seed: int = 0) -> SceneSpec:
    """n three-object scenes [n, 3] (X, Y, Z): Y at the top and Z at the bottom of the
    middle column, X between them (even scenes) or in another column (odd), three
    different labels. Host NumPy, drawn from `seed`. ValueError naming `--grid` where
    nothing fits between Y and Z (fewer than 3 rows) or no other column exists."""
    if grid.h < 3 or grid.w < 2:
        raise ValueError(f"--grid = {grid.h}x{grid.w}: in-between questions need 3+ rows (Y "
                         "above, X between, Z below) and 2+ columns")  # fmt: skip
    if n_labels < 3:
        raise ValueError(f"n_labels = {n_labels}: three objects need 3+ labels")
    rng = np.random.default_rng([seed, 61])
    c = between_column(grid)
    others = np.asarray([k for k in range(grid.cells) if k % grid.w != c])
    inner = rng.integers(1, grid.h - 1, n) * grid.w + c
    x = np.where(np.arange(n) % 2 == 0, inner, others[rng.integers(0, len(others), n)])
    cells = np.stack([x, np.full(n, c), np.full(n, (grid.h - 1) * grid.w + c)], 1)
    labels = np.stack([rng.permutation(n_labels)[:3] + 1 for _ in range(n)])
    return SceneSpec(cells.astype(np.int32), labels.astype(np.int32),
                     rng.integers(1, n_colours + 1, (n, 3)).astype(np.int32),
                     rng.integers(1, 3, (n, 3)).astype(np.int32), np.zeros(n, np.int32))  # fmt: skip


def near_far_examples(view, spec: SceneSpec, wording: str, words) -> Examples:
    """The pictures of `spec` (two objects) asked near or far in `wording`; the answer
    (`words` [2] token ids) by X's distance to Y (`near_sides`)."""
    template = ASKED["near_far"][wording][0]
    names = [(x, y) for x, y in pictures.object_names(spec)]
    cells = np.asarray(spec.cells_BxK)
    qs = [template.format(x=x, y=y) for x, y in names]
    inputs, spans = view.render_images(list(pictures.draw(view.grid, spec, view.size)), qs, names)
    near = near_sides(view.grid, cells[:, 0], cells[:, 1]).diagonal() == 1
    return Examples(spec, inputs, spans, np.where(near, words[0], words[1]),
                    np.where(near, words[1], words[0]))  # fmt: skip


def between_examples(view, spec: SceneSpec, wording: str) -> Examples:
    """Three-object pictures of `spec` (`between_scenes`) asked whether X is in between
    Y and Z in `wording`; answered by the view's yes / no."""
    template = ASKED["in_between"][wording][0]
    labels = np.asarray(spec.labels_BxK)
    names = [[pictures.SHAPES[lab - 1] for lab in row] for row in labels]
    qs = [template.format(x=x, y=y, z=z) for x, y, z in names]
    inputs, spans = view.render_images(list(pictures.draw(view.grid, spec, view.size)), qs,
                                       [(x, y) for x, y, _ in names])  # fmt: skip
    cells = np.asarray(spec.cells_BxK)
    yes = np.diagonal(between_sides(view.grid, cells[:, 0], cells[:, 1], cells[:, 2])) == 1
    w = np.asarray(view.answer_words)[PRESENCE]
    return Examples(spec, inputs, spans, np.where(yes, w[0], w[1]), np.where(yes, w[1], w[0]))


def near_far_words(folder: str, wording: str) -> np.ndarray:
    """[2] token ids of near / far in `wording`, from the checkpoint's tokenizer;
    ValueError where both begin with one token (their margin would be 0 whatever the
    model says)."""
    from jaxmech.data.inputs import prompts

    tokenizer, _ = prompts.read_tokenizer(folder)
    pair = ASKED["near_far"][wording][1]
    ids = np.asarray([tokenizer.encode(w, add_special_tokens=False).ids[0] for w in pair],
                     np.int32)  # fmt: skip
    if ids[0] == ids[1]:
        raise ValueError(f"--sets=near_far: {pair[0]!r} and {pair[1]!r} begin with the same "
                         f"token {int(ids[0])} in {folder}'s tokenizer, so their margin cannot "
                         "tell them apart")  # fmt: skip
    return ids
