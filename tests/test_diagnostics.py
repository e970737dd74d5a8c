"""Spatial-ID diagnostics (`analysis.diagnostics`): believed
coordinates, the signed deviation, occlusion, and the report's bookkeeping."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis import diagnostics as dg
from jaxmech.analysis import spatial_ids as si
from jaxmech.data.spec import probe_specs, take
from jaxmech.data.tasks import scenes as sc
from jaxmech.families.toy_vlm import model as toy_vlm
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
    params = toy_vlm.init_params(config, jax.random.PRNGKey(0))
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
    params = toy_vlm.init_params(config, jax.random.PRNGKey(0))
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


def test_auc_ci_is_the_mann_whitney_auc_with_a_seeded_interval():
    from jaxmech.stats import mann_whitney_u

    rng = np.random.default_rng(0)
    wrong, right = rng.normal(-0.5, 1, 12), np.round(rng.normal(0, 1, 30), 1)
    m, lo, hi, n = report.auc_ci(wrong, right)
    assert m == mann_whitney_u(wrong, right)[0] / (12 * 30) and lo < m < hi and n == 42
    assert report.auc_ci(wrong, right) == (m, lo, hi, n)  # seeded
    assert report.auc_ci(wrong[: report.MIN_WRONG - 1], right)[3] == 0  # too few wrong


QWEN = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")


def _intervals(summary: dict):
    """Every (mean, lo, hi, n) cell of a diagnostics summary, with its name."""
    for part, cells in summary.items():
        for name, v in cells.items() if isinstance(cells, dict) else ():
            if isinstance(v, (tuple, list)) and len(v) == 4:
                yield f"{part}/{name}", v


# one case (the jaxmech protocol's checkpoint run is tests/test_memory.py's at 448 px):
# ~10 s each, and the suite is at its 8-minute line
@pytest.mark.parametrize("protocol, layers", [("authors", (0, 2))])
def test_a_checkpoint_summary_has_intervals_over_its_questions(tmp_path, protocol, layers):
    """A checkpoint is one model, so its cells are over its questions (bootstrap; the
    read-out's correlation Fisher z, from 4 pairs): finite wherever n allows, the
    tables written, under both protocols (the authors' wording and answer words). Its
    --layers are the authors' (layer 2 of the fixture's 2: the last block's output,
    "final"); layer 0 has no diagnostics and is left out, alone refused by name."""
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    run = open_checkpoint(QWEN, grid=(2, 2), size=112, questions=6, batch=1024,
                          protocol=protocol, layers=layers, log=lambda *_: None)  # fmt: skip
    lines = []
    out = analyse_subject(report.REPORT, run, str(tmp_path), log=lines.append)
    summary = json.load(open(tmp_path / "diagnostics" / "summary.json"))
    assert set(k for k in summary if not k.startswith("occlusion/")) - {"excluded"} == (
        {"resid_pre.1", "final"} if layers is None else {"final"}
    )
    cells = dict(_intervals(summary))
    assert "final/deviation_right" in cells and "final/median_right" not in cells
    enough = {k: v for k, v in cells.items() if v[3] >= (4 if "readout" in k else 2)}
    assert len(enough) >= 8 and all(np.isfinite(v[1:3]).all() for v in enough.values()), cells
    assert all(np.isnan(v[1]) for k, v in cells.items() if v[3] == 0)
    rows = out["tables"]["deviation"]
    assert os.path.exists(tmp_path / "diagnostics" / "deviation.csv")
    assert os.path.exists(tmp_path / "diagnostics" / "diagnostics_paper.png")  # Fig. 8A
    assert {r["site"] for r in rows} == ({1, 2} if layers is None else {2})
    assert any("bootstrap CI over questions" in line for line in lines)
    assert any("layer 0 left out" in line for line in lines) == (layers is not None)
    if layers is not None:
        with pytest.raises(ValueError, match=r"layers = \[0\]"):
            report.check_layers(run._replace(subject=run.subject._replace(layers=(0,))))


def test_the_paper_figure_histograms_right_vs_wrong_deviations(tmp_path, saved_figures):
    """Fig. 8A beside the table: per layer the densities of the ID deviation of right
    and wrong answers (x "Margin Relative to GT", y "Density"), each side's n in the
    legend; a side with no answer says n = 0 (no bars), a layer with none is empty."""
    from conftest import texts

    rng = np.random.default_rng(0)
    margin = np.array([[1.0, 2.0, -1.0, 0.5, -0.3, 1.5]])  # [K = 1, B]: 4 right, 2 wrong
    res = {"margin": margin, "deviation": rng.normal(size=(1, 2, 6)), "site": np.array([1, 2])}
    report.plot_paper(res, str(tmp_path / "diagnostics_paper.png"), 1)
    assert (tmp_path / "diagnostics_paper.png").exists()
    ax = [a for a in saved_figures[-1].axes if a.get_visible()][0]
    assert ax.get_xlabel().startswith("Margin Relative to GT") and ax.get_ylabel() == "Density"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["right answers (n = 4)", "wrong answers (n = 2)"]
    assert ax.get_title().startswith("Layer 1: Mann-Whitney p = ")
    all_right = res | {"margin": np.abs(margin)}
    report.plot_paper(all_right, str(tmp_path / "right.png"), 1)
    ax = [a for a in saved_figures[-1].axes if a.get_visible()][0]
    assert "wrong answers (n = 0)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "no test" in ax.get_title() and len(ax.patches) == 10  # the right side's bins only
    none = {"margin": np.zeros((1, 0)), "deviation": np.zeros((1, 1, 0)), "site": np.array([3])}
    report.plot_paper(none, str(tmp_path / "none.png"), 1)
    assert "n = 0" in texts(saved_figures[-1])
