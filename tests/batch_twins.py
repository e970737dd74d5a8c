"""The scene twins written a second way, on rendered batches (cell images and answer
tokens) instead of scene specs: the independent reference that `data.spec`'s twins,
rendered, are checked against (`test_scenes.py`, `test_video.py`,
`test_counterfactuals.py`)."""

from jaxmech.data import spec
from jaxmech.data.tasks.scenes import TOKEN, grid_of


def mirror_cells(task):
    return spec.mirror_cells(grid_of(task))


def _move(batch, perm):
    return batch._replace(labels_BxL=batch.labels_BxL[:, perm],
                          colours_BxL=batch.colours_BxL[:, perm],
                          facings_BxL=batch.facings_BxL[:, perm])  # fmt: skip


def mirror_pos(batch, task):
    """Cell (r, c) -> (r, W - 1 - c), facings kept; left <-> right answers swap."""
    ans, h = batch.answer_B, batch.relation_B == 0
    moved = _move(batch, mirror_cells(task))
    return moved._replace(answer_B=ans + h * (TOKEN["left"] + TOKEN["right"] - 2 * ans))


def flip_facing(batch, task=None):
    del task
    return batch._replace(facings_BxL=(3 - batch.facings_BxL) * (batch.facings_BxL > 0))


def mirror(batch, task):
    return flip_facing(mirror_pos(batch, task))


def mirror_height(batch, task):
    """Cell (r, c) -> (H - 1 - r, c), facings kept; above <-> below answers swap."""
    ans, v = batch.answer_B, batch.relation_B == 1
    moved = _move(batch, spec.height_mirror_cells(grid_of(task)))
    return moved._replace(answer_B=ans + v * (TOKEN["above"] + TOKEN["below"] - 2 * ans))


def recolour(batch, task, shift_BxL):
    """Colour c -> (c - 1 + s) mod n_colours + 1 at every object's cell."""
    c = batch.colours_BxL
    return batch._replace(colours_BxL=((c - 1 + shift_BxL) % task.n_colours + 1) * (c > 0))
