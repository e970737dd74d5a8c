"""Spatial-ID diagnostics (`analysis.diagnostics`, issue 13 part 4): believed
coordinates, the signed deviation, occlusion, and the report's bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import tiny_vlm_config

from jaxmech.analysis import diagnostics as dg
from jaxmech.analysis import spatial_ids as si
from jaxmech.data import scenes as sc
from jaxmech.data.spec import probe_specs, take
from jaxmech.families.toy_vlm import model as ar_vlm
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import examples
from jaxmech.reports import diagnostics as report


def test_believed_coords_recover_planted_grid_coordinates():
    rng = np.random.default_rng(0)
    D, B = 8, 20
    h, v = rng.normal(size=D), rng.normal(size=D)
    centres = rng.normal(size=(B, D))
    coords = rng.integers(0, 4, size=(B, 2)).astype(float)  # (column, row)
    states = centres + coords[:, :1] * h + coords[:, 1:] * v
    got = dg.believed_coords(
        jnp.asarray(states), jnp.asarray(centres), jnp.asarray(h), jnp.asarray(v)
    )
    np.testing.assert_allclose(got, coords, atol=1e-4)


def test_signed_deviation_points_towards_the_right_answer():
    # X left of Y by 2 columns (true displacement -2, horizontal question)
    true_x, true_y = jnp.asarray([[0.0, 0.0]] * 3), jnp.asarray([[2.0, 0.0]] * 3)
    believed_x = jnp.asarray([[0.0, 0.0], [1.5, 0.0], [-1.0, 5.0]])
    believed_y = jnp.asarray([[2.0, 0.0]] * 3)
    got = dg.signed_deviation(believed_x, believed_y, true_x, true_y, jnp.asarray([0, 0, 0]))
    # exact; X believed nearer to Y (the wrong way); X believed further left (the right
    # way); the row coordinate is ignored on a left/right question
    np.testing.assert_allclose(got, [0.0, -1.5, 1.0])
    # the same numbers on an above/below question read the rows instead
    got_v = dg.signed_deviation(believed_x[:, ::-1], believed_y[:, ::-1], true_x[:, ::-1], true_y[:, ::-1], jnp.asarray([1, 1, 1]))  # fmt: skip
    np.testing.assert_allclose(got_v, got)


def test_occlusion_blanks_one_cell_and_random_cells_avoid_the_objects():
    config = tiny_vlm_config()
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    spec = sc.eval_specs(config.task, s)["examples"]
    cells = jnp.asarray(s.cells_Nx3[:, :2])
    out = toy_view(config).render(dg.occlusions(spec, jax.random.PRNGKey(0), 9)[0])[0]
    B = cells.shape[0]
    assert (np.asarray(out.labels_BxL)[np.arange(B), cells[:, 0]] == 0).all()
    changed = np.asarray(out.labels_BxL) != np.asarray(s.examples.labels_BxL)
    assert (changed.sum(1) == 1).all()  # exactly the object's cell
    for f in ("colours_BxL", "facings_BxL"):
        assert (np.asarray(getattr(out, f))[np.arange(B), cells[:, 0]] == 0).all()
    np.testing.assert_array_equal(out.question_BxQ, s.examples.question_BxQ)  # still named
    draws = np.stack([dg.random_free_cells(jax.random.PRNGKey(i), cells, 9) for i in range(200)])
    assert (
        not (draws == np.asarray(cells[:, 0])).any()
        and not (draws == np.asarray(cells[:, 1])).any()
    )
    assert len(np.unique(draws[:, 0])) == 7  # every other cell of the 3 x 3 grid is drawn


def test_diagnose_runs_and_occluding_a_free_cell_changes_nothing():
    config = tiny_vlm_config(lm_n_layers=2)
    t, view = config.task, toy_view(config)
    params = ar_vlm.init_params(config, jax.random.PRNGKey(0))
    s = sc.build_eval_sets(t, sc.build_tables(t)).unseen_pair
    spec = sc.eval_specs(t, s)["examples"]
    ex = examples(view, take(spec, np.asarray(spec.relation_B) < 2))
    labels = range(1, t.n_labels + 1)
    probes = [[si.probe(view, labels, 2, named_first=f, relation=r) for f in (True, False)] for r in (0, 1)]  # fmt: skip
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    occ = dg.occlusions(ex.spec, jax.random.PRNGKey(1), view.grid.cells)
    occ = jax.tree_util.tree_map(stack, *(view.render(o)[0] for o in occ))
    # the probes' labels and cells are host arrays (the report closes over them too)
    out = jax.jit(lambda p, o: dg.diagnose(view, p, ex, probes, o))(params, occ)
    B = len(ex.answer_B)
    assert out["deviation"].shape == (2, B) and out["occluded"].shape == (len(dg.OCCLUSIONS), B)
    assert np.isfinite(np.asarray(out["deviation"])).all()
    # the scenes hold two objects only, so the random cell is background already
    np.testing.assert_allclose(out["occluded"][dg.OCCLUSIONS.index("random")], out["margin"], atol=1e-5)  # fmt: skip
    assert np.abs(np.asarray(out["occluded"][0] - out["margin"])).max() > 1e-4


def test_each_relation_is_probed_in_its_own_template():
    """Y's word follows the relation's words, so its centres and IDs depend on the
    template. On examples that are the Y probes themselves, Y's believed-minus-true part
    averages to zero by construction and X's part (X precedes the relation's words) is
    the same for a horizontal and a vertical asking: the two mean offsets agree. Reading
    the vertical asking against the horizontal template's probes (the bug this fixes:
    every Y probe was horizontal) does not."""
    config = tiny_vlm_config(lm_n_layers=2)
    view = toy_view(config)
    params = ar_vlm.init_params(config, jax.random.PRNGKey(0))
    labels = range(1, config.task.n_labels + 1)
    probes = [[si.probe(view, labels, 2, named_first=f, relation=r) for f in (True, False)] for r in (0, 1)]  # fmt: skip

    def mean_offset(p, relation, pairs):
        spec = probe_specs(view.grid, labels, view.n_labels, view.n_colours, 2, 0, False, relation)[0]  # fmt: skip
        ex = examples(view, spec)
        occ = jax.tree_util.tree_map(lambda x: x[None], ex.inputs)
        out = dg.diagnose(view, p, ex, pairs, occ)
        return (out["believed"] - out["true"]).mean(1)  # [sites, 2]

    # one compiled call: horizontal, vertical, vertical against the horizontal template
    three = jax.jit(lambda p: [mean_offset(p, 0, probes), mean_offset(p, 1, probes), mean_offset(p, 1, [probes[0]] * 2)])  # fmt: skip
    horizontal, vertical, wrong = (np.asarray(o) for o in three(params))
    np.testing.assert_allclose(vertical, horizontal, atol=1e-4)
    assert np.abs(wrong - horizontal).max() > 1e-2


def test_deviation_rows_count_and_test_only_with_enough_wrong_answers():
    K, Y, B = 2, 1, 12
    rng = np.random.default_rng(0)
    margin = np.ones((K, B))
    margin[0, :6] = -1.0  # model 0: 6 wrong; model 1: none wrong
    res = {
        "margin": margin,
        "deviation": rng.normal(size=(K, Y, B)),
        "believed": rng.normal(size=(K, Y, B, 2)),
        "true": rng.normal(size=(K, Y, B, 2)),
        "relation": np.zeros(B, int),
    }
    rows = report.deviation_rows(res, (0, 1))
    assert [r["n_wrong"] for r in rows] == [6, 0] and [r["n_right"] for r in rows] == [6, 12]
    assert np.isfinite(rows[0]["p"]) and np.isnan(rows[1]["p"])
    sign_wrong = res["believed"][0, 0, :, 0] * res["true"][0, 0, :, 0] <= 0
    assert rows[0]["id_wrong_among_wrong"] == sign_wrong[:6].mean()
