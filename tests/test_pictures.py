"""The renderer of scene specs as pictures (`data.inputs.pictures`)."""

import numpy as np
import pytest

from jaxmech.data import spec as sp
from jaxmech.data.inputs import pictures as pc
from jaxmech.data.spec import Grid, SceneSpec

GRID = Grid(4, 4)


def _spec(rng, n=12, k=3, grid=GRID):
    cells = np.stack([rng.permutation(grid.cells)[:k] for _ in range(n)])
    cells[0, 2] = -1  # a named object that is not drawn
    labels = rng.integers(1, len(pc.SHAPES) + 1, (n, k))
    labels[1, 2] = 0  # an absent slot
    colours = rng.integers(1, len(pc.COLOURS) + 1, (n, k))
    facings = rng.integers(0, 3, (n, k))
    return SceneSpec(cells, labels, colours, facings, rng.integers(0, 2, n))


def test_the_mirrored_spec_draws_the_picture_flipped_left_to_right():
    grid, spec = Grid(4, 4), _spec(np.random.default_rng(0))
    img = pc.draw(grid, spec, 112)
    np.testing.assert_array_equal(pc.draw(grid, sp.mirror(grid, spec), 112), img[:, :, ::-1])
    # positions alone mirrored (facings kept) is not the flip wherever an eye is drawn
    assert not np.array_equal(pc.draw(grid, sp.mirror_pos(grid, spec), 112), img[:, :, ::-1])


def test_each_object_is_drawn_in_its_own_cell_and_nowhere_else():
    grid, spec = Grid(3, 4), _spec(np.random.default_rng(1), grid=Grid(3, 4))
    img = pc.draw(grid, spec, 96)  # cells of 32 x 24 pixels
    cells = img.reshape(len(img), 3, 32, 4, 24, 3).swapaxes(2, 3)  # [B, 3, 4, 32, 24, 3]
    inked = (cells != np.uint8(255)).any((-1, -2, -3)).reshape(len(img), -1)
    want = np.zeros_like(inked)
    for b, k in zip(*np.nonzero((spec.labels_BxK > 0) & (spec.cells_BxK >= 0))):
        want[b, spec.cells_BxK[b, k]] = True
    np.testing.assert_array_equal(inked, want)


def test_every_glyph_and_colour_is_distinct():
    grid = Grid(1, 1)
    one = lambda label, colour=1, facing=0: pc.draw(  # noqa: E731
        grid, SceneSpec(*(np.array([[v]]) for v in (0, label, colour, facing)), np.zeros(1)), 56
    )[0]
    masks = [(one(i + 1) != 255).any(-1) for i in range(len(pc.SHAPES))]
    for i in range(len(masks)):
        assert masks[i].mean() > 0.05  # large enough to read
        for j in range(i):
            assert (masks[i] != masks[j]).mean() > 0.02, (pc.SHAPES[i], pc.SHAPES[j])
    ink = {tuple(one(1, c)[28, 28]) for c in range(1, len(pc.COLOURS) + 1)}
    assert ink == set(pc.COLOURS.values())
    assert not np.array_equal(one(1, facing=1), one(1, facing=2))


def test_bad_input_names_the_argument_before_drawing():
    grid, spec = Grid(4, 4), _spec(np.random.default_rng(2))
    with pytest.raises(ValueError, match="size = 90"):
        pc.draw(grid, spec, 90)
    for field, value in (
        ("labels_BxK", len(pc.SHAPES) + 1),
        ("colours_BxK", 0),
        ("facings_BxK", 3),
    ):
        bad = np.asarray(getattr(spec, field)).copy()
        bad[0, 0] = value
        with pytest.raises(ValueError, match=field):
            pc.draw(grid, spec._replace(**{field: bad}), 112)


def test_questions_name_the_objects_in_the_papers_wording():
    spec = SceneSpec(
        np.array([[0, 5], [3, 1], [2, -1]]),
        np.array([[1, 2], [3, 0], [4, 0]]),
        np.array([[1, 3], [2, 0], [6, 0]]),
        np.zeros((3, 2), int),
        np.array([0, 1, 2]),
    )
    # one object of each shape: named by its shape alone (a recolour keeps it true)
    assert pc.questions(spec) == [
        "Is the circle to the left or the right of the square? Answer with one word.",
        "Is the triangle above or below the centre of the image? Answer with one word.",
        "Is there a star in the image? Answer with one word.",
    ]
    two = spec._replace(labels_BxK=np.array([[1, 1], [3, 0], [4, 0]]))  # two circles
    assert pc.object_names(two)[0] == ("red circle", "blue circle")
    assert pc.questions(two, pc.AUTHORS_TEMPLATES)[0] == (
        'Is the red circle to the left or right of the blue circle? Answer "left" or "right" only.'
    )
    with pytest.raises(ValueError, match="colours_BxK"):
        pc.questions(spec._replace(colours_BxK=np.array([[9, 3], [2, 0], [6, 0]])))


def test_a_video_is_the_grid_read_as_time_and_its_time_reversal_the_frames_reversed():
    grid, spec = Grid(3, 4), _spec(np.random.default_rng(1), grid=Grid(3, 4))
    video = pc.draw_video(grid, spec, 112)
    assert video.shape == (12, 3, 112, 112, 3)
    np.testing.assert_array_equal(pc.draw_video(grid, sp.mirror_height(grid, spec), 112),
                                  video[:, ::-1])  # fmt: skip
    # frame f is the 1 x 4 row of the objects of grid row f, each in its column
    cells, drawn = np.asarray(spec.cells_BxK), np.asarray(spec.labels_BxK) > 0
    for b in range(3):
        for f in range(grid.h):
            row = np.where(
                (cells[b] // grid.w == f) & drawn[b] & (cells[b] >= 0), cells[b] % grid.w, -1
            )
            one = spec._replace(cells_BxK=row[None], **{k: np.asarray(getattr(spec, k))[b : b + 1]
                                for k in ("labels_BxK", "colours_BxK", "facings_BxK", "relation_B")})  # fmt: skip
            np.testing.assert_array_equal(video[b, f], pc.draw(Grid(1, 4), one, 112)[0])
    words = pc.questions(spec._replace(relation_B=np.ones(12, int)), pc.VIDEO_TEMPLATES)
    assert all(q.startswith("Does the ") and " appear before or after the " in q for q in words)
