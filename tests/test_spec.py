"""Scene specs (`data.spec`): the scenes and video tasks' eval sets read back as specs
render to the stored batches, twins are spec transforms, and the probes hold what the
spatial IDs assume."""

import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.data import spec as sp
from jaxmech.data.tasks import get_task
from jaxmech.data.tasks import scenes as sc

KINDS = [
    ("scenes", {}),
    ("scenes", dict(third_frac=0.5, present_frac=0.3, absent_frac=0.3)),
    ("video", dict(grid_h=4, vit_frames=True, layouts_per_pair=4)),
]


@pytest.mark.parametrize("kind, extra", KINDS, ids=["scenes", "scenes_mixed", "video"])
def test_eval_sets_as_specs_render_to_the_stored_batches(kind, extra):
    config = tiny_vlm_config(task_kind=kind, **extra)
    task = get_task(kind)
    evals = task.build_eval_sets(config.task, task.build_tables(config.task))
    for name, s in evals._asdict().items():
        for twin, spec in task.eval_specs(config.task, s).items():
            want = s.examples if twin == "examples" else getattr(s, twin)
            got = sc.render(config.task, spec)
            for field, a, b in zip(sc.SceneBatch._fields, got, want):
                np.testing.assert_array_equal(a, b, err_msg=f"{name}/{twin}/{field}")


def _spec():
    config = tiny_vlm_config(grid_h=3, grid_w=4, third_frac=0.5)
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    return sc.grid_of(config.task), sc.eval_specs(config.task, s)["examples"]


def test_twins_are_involutions_and_move_only_positions_or_facings():
    grid, spec = _spec()
    for twin in (sp.mirror, sp.mirror_pos, sp.mirror_height):
        twice = twin(grid, twin(grid, spec))
        for a, b in zip(twice, spec):
            np.testing.assert_array_equal(a, b)
    m = sp.mirror(grid, spec)
    cells = np.asarray(spec.cells_BxK)
    drawn = cells >= 0
    np.testing.assert_array_equal(np.asarray(m.cells_BxK)[drawn] // 4, cells[drawn] // 4)
    np.testing.assert_array_equal(np.asarray(m.cells_BxK)[drawn] % 4, 3 - cells[drawn] % 4)
    f = np.asarray(spec.facings_BxK)
    np.testing.assert_array_equal(np.asarray(m.facings_BxK), np.where(f > 0, 3 - f, 0))
    np.testing.assert_array_equal(np.asarray(m.labels_BxK), np.asarray(spec.labels_BxK))
    # a horizontal answer flips under the width mirror, a vertical one stays
    first, mirrored = np.asarray(sp.first_word(grid, spec)), np.asarray(sp.first_word(grid, m))
    h = np.asarray(spec.relation_B) == 0
    assert (mirrored[h] != first[h]).all() and (mirrored[~h] == first[~h]).all()


def test_swap_names_the_other_object_first_and_occlude_leaves_it_named():
    grid, spec = _spec()
    sw = sp.swap_named(spec)
    np.testing.assert_array_equal(
        np.asarray(sw.labels_BxK)[:, 0], np.asarray(spec.labels_BxK)[:, 1]
    )
    np.testing.assert_array_equal(np.asarray(sw.cells_BxK)[:, 2], np.asarray(spec.cells_BxK)[:, 2])
    assert (np.asarray(sp.first_word(grid, sw)) != np.asarray(sp.first_word(grid, spec))).all()
    gone = sp.occlude(spec, np.asarray(spec.cells_BxK)[:, 0])
    assert (np.asarray(gone.cells_BxK)[:, 0] == -1).all()
    np.testing.assert_array_equal(np.asarray(gone.labels_BxK), np.asarray(spec.labels_BxK))


def test_probe_specs_put_every_label_at_every_cell_and_another_elsewhere():
    grid = sp.Grid(3, 4)
    spec, label, cell = sp.probe_specs(grid, range(1, 6), 8, 3, placements=2)
    assert len(label) == 5 * 12 * 2
    for named_first, slot in ((True, 0), (False, 1)):
        s, lab, c = sp.probe_specs(grid, range(1, 6), 8, 3, 2, named_first=named_first)
        np.testing.assert_array_equal(np.asarray(s.labels_BxK)[:, slot], lab)
        np.testing.assert_array_equal(np.asarray(s.cells_BxK)[:, slot], c)
        other = np.asarray(s.cells_BxK)[:, 1 - slot]
        assert (other != c).all() and (np.asarray(s.labels_BxK)[:, 1 - slot] != lab).all()
    counts = np.zeros((5, 12), int)
    np.add.at(counts, (label - 1, cell), 1)
    assert (counts == 2).all()


def test_factorial_probe_specs_put_the_other_object_at_every_other_cell_once():
    """`factorial` probes cover every (cell, other cell) pair exactly once per
    label, the other label never the probed one, cells and labels the same for any seed."""
    grid, labels = sp.Grid(3, 3), range(2, 6)
    spec, label, cell = sp.probe_specs(grid, labels, 6, 3, placements=2, factorial=True)
    L = grid.cells
    assert len(label) == len(labels) * L * (L - 1)
    other = np.asarray(spec.cells_BxK)[:, 1]
    counts = np.zeros((len(labels), L, L), int)
    np.add.at(counts, (label - 2, cell, other), 1)
    np.testing.assert_array_equal(counts, np.broadcast_to(1 - np.eye(L, dtype=int), counts.shape))
    partner = np.asarray(spec.labels_BxK)[:, 1]
    assert (partner != label).all() and set(partner.tolist()) == set(range(1, 7))
    again = sp.probe_specs(grid, labels, 6, 3, seed=5, factorial=True)[0]
    np.testing.assert_array_equal(again.cells_BxK, spec.cells_BxK)
    np.testing.assert_array_equal(again.labels_BxK, spec.labels_BxK)
