"""Fig. 6A (paper 003, `single_lr.py`): both words steered at a sweep of layers,
`analysis.pair_steering` and `reports.pair_steering` (`--sets=pair`)."""

import os
import types

import jax
import numpy as np
import pytest
from conftest import quiet, tiny_vlm_config

from jaxmech.analysis import pair_steering as ps
from jaxmech.data.spec import Grid, SceneSpec
from jaxmech.reports import arbitrary_steering as report
from jaxmech.reports import pair_steering as pr
from jaxmech.reports import target_steering as ts

LLAVA = os.path.join(os.path.dirname(__file__), "fixtures", "llava", "llava")


def test_interventions_layers_and_traded_ids():
    a, b = pr.interventions(Grid(4, 4))  # their (0, 1) and (3, 1): row 1's ends
    np.testing.assert_array_equal(a, [4, 7])
    np.testing.assert_array_equal(b, [7, 4])
    np.testing.assert_array_equal(pr.interventions(Grid(1, 3))[0], [0, 2])  # one row: row 0
    assert [pr.scaled(y, 32) for y in (5, 13, 19)] == [5, 13, 19]
    assert pr.scaled(19, 2) == 0 and pr.scaled(13, 28) == 11
    # the authors' steps trade the IDs: X += ID(a) - ID(b), Y += ID(b) - ID(a)
    delta = np.arange(16 * 2, dtype=np.float32).reshape(16, 2) ** 2
    ex = types.SimpleNamespace(answer_B=np.zeros(3), spec=types.SimpleNamespace(
        cells_BxK=np.asarray([[4, 7], [0, 5], [7, 4]])))  # fmt: skip
    s = ts.Setup((1,), (1,), (1,), 5.0, a, "authors")
    x, y = ps.pair_steps(delta, a, b, pr.minus_of(s, Grid(4, 4), ex), 5.0)
    np.testing.assert_allclose(x[0, 0], 5.0 * (delta[4] - delta[7]))
    np.testing.assert_allclose(y, -x)
    # jaxmech's: each word's own cell subtracted, so X already at a and Y at b: no step
    s = s._replace(protocol="jaxmech")
    x, y = ps.pair_steps(delta, a, b, pr.minus_of(s, Grid(4, 4), ex), 1.0)
    np.testing.assert_array_equal(np.asarray(x)[0, 0], 0.0)
    np.testing.assert_array_equal(np.asarray(y)[0, 0], 0.0)
    assert np.abs(np.asarray(x)[0, 1]).max() > 0


def test_pair_runs_alone_and_takes_no_targets():
    assert report.parse_sets("pair") == ("pair",)
    with pytest.raises(ValueError, match="--sets = 'pair,left_right': pair runs alone"):
        report.parse_sets("pair,left_right")
    assert report.refusal_of(("pair",))(tiny_vlm_config(lm_n_layers=2), "RUN") is None


@pytest.mark.slow  # ~30 s on a loaded 2-core CPU: the toy's eager init and one compiled table
def test_a_no_op_pair_steer_and_the_swap_on_the_toy():
    """On an untrained toy, questions with X at row 1's left end and Y at its right
    end: intervention 1 (X left, Y right: their own cells) adds nothing, so its log p
    and its noise's (norm 0) are the unsteered ones; intervention 2 (the swap) moves
    them. Two chunks draw what one call draws."""
    from jaxmech.data.spec import pair_questions
    from jaxmech.families.toy_vlm import model as toy_vlm
    from jaxmech.families.toy_vlm.view import toy_view
    from jaxmech.families.vlm_view import examples

    config = tiny_vlm_config(lm_n_layers=2)
    params = jax.tree_util.tree_map(lambda x: x[None],
                                    toy_vlm.init_params(config, jax.random.PRNGKey(5)))  # fmt: skip
    view = toy_view(config)
    spec = pair_questions(view.grid, 4, 5, view.n_colours, 0, 0)["examples"]
    a, b = pr.interventions(view.grid)
    cells = np.broadcast_to(np.asarray([a[0], b[0]], np.int32), (4, 2))
    ex = examples(view, SceneSpec(cells, *spec[1:]))
    D = config.model.d_model
    delta = jax.random.normal(jax.random.PRNGKey(1), (1, 3, view.grid.cells, D))
    s = ts.Setup((1,), (1,), (1,), 1.0, a, "jaxmech")
    minus = pr.minus_of(s, view.grid, ex)
    words = np.asarray(view.answer_words)[0]
    fn = ps.table_fn(view, s.sites, s.id_sites, words, int(np.min(ex.spans.x_B)), 1.0)
    lp = ps.pair_table(view, params, delta, ex, a, b, minus, fn, batch=2)
    for kind in ("id", "noise"):
        np.testing.assert_allclose(lp[kind][0, 0, 0], lp["plain"][0], atol=1e-5)
    assert np.abs(lp["id"][0, 0, 1] - lp["plain"][0]).max() > 1e-4
    whole = ps.pair_table(view, params, delta, ex, a, b, minus, fn)
    np.testing.assert_allclose(whole["noise"], lp["noise"], atol=1e-5)


@pytest.mark.slow  # ~70 s on a loaded 2-core CPU: the IDs and one compiled table
def test_pair_runs_on_llava(tmp_path):
    """`--sets=pair` on the fixture: results, summary, the share grid and Fig. 6A."""
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    run = open_checkpoint(LLAVA, grid=(2, 2), size=28, questions=3, batch=2, layers=(1,),
                          log=quiet)  # fmt: skip
    rep = report.report(sets=("pair",))
    with pytest.raises(ValueError, match="--targets: --sets=pair"):
        report.report("0:0", ("pair",)).check(run, quiet)
    res = analyse_subject(rep, run, str(tmp_path), log=quiet)["res"]
    folder = tmp_path / "arbitrary_steering"
    for name in ("results.csv", "summary.json", "arbitrary_steering_pair.png",
                 "arbitrary_steering_pair_paper.png"):  # fmt: skip
        assert (folder / name).exists(), name
    np.testing.assert_array_equal(res["sides"]["pair"][:, 0], [1, -1])
    assert res["lp"]["pair"]["id"].shape == (1, 1, 2, 2, 3)
