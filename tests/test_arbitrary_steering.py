"""Arbitrary spatial steering (paper 003, Fig. 6): `analysis.arbitrary_steering`,
`reports.arbitrary_steering` and its entry point."""

import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quiet, subprocess_env, tiny_vlm_config

from jaxmech.analysis import arbitrary_steering as ar
from jaxmech.analysis import steering as st
from jaxmech.data.spec import Grid
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import examples
from jaxmech.reports import arbitrary_steering as report
from jaxmech.reports import target_steering as ts

HERE = os.path.dirname(__file__)
LLAVA = os.path.join(HERE, "fixtures", "llava", "llava")


@pytest.fixture(scope="module")
def toy():
    """An untrained two-block toy VLM (one model, stacked) and six drawn left / right
    pair questions."""
    from jaxmech.data.spec import pair_questions

    config = tiny_vlm_config(lm_n_layers=2)
    params = toy_vlm.init_params(config, jax.random.PRNGKey(5))
    view = toy_view(config)
    spec = pair_questions(view.grid, 6, 5, view.n_colours, 0, 0)["examples"]
    stacked = jax.tree_util.tree_map(lambda x: x[None], params)
    return view, stacked, examples(view, spec), config.model.d_model


def test_cells_mirrors_and_sides_on_hand_made_cells():
    g = Grid(2, 4)  # cells 0..7, row-major
    np.testing.assert_array_equal(ar.mirror_cells(g, [0, 1, 6], "width"), [3, 2, 5])
    np.testing.assert_array_equal(ar.mirror_cells(g, [0, 1, 6], "height"), [4, 5, 2])
    # targets 0 (col 0), 2 (col 2), 5 (col 1) against Y at column 1 (cells 1, 5)
    sides = ar.target_sides(g, [0, 2, 5], np.asarray([[1, 5]] * 3), "width")
    np.testing.assert_array_equal(sides, [[1, 1], [-1, -1], [0, 0]])
    with pytest.raises(ValueError, match="axis = 'depth'"):
        ar.cell_coords(g, [0], "depth")
    # follows: word 0 wins where logp0 > logp1; NaN where the target implies nothing
    lp = {"plain": np.asarray([[[0.0, -1.0], [-1.0, 0.0]]]).transpose(0, 2, 1)}  # [K, W, B]
    steered = np.asarray([[-1.0, 0.0], [0.0, -1.0], [-1.0, 0.0]])[None, None, :, :, None]
    lp["id"] = lp["noise"] = np.repeat(steered, 2, -1)  # [K, Y', T, W, B]
    implied = np.asarray([[1, -1], [-1, 1], [0, 0]])  # [T, B]
    f = ar.follows(lp, implied)
    np.testing.assert_array_equal(f["id"][0, 0, :2], [[0.0, 1.0], [0.0, 1.0]])
    assert np.isnan(f["id"][0, 0, 2]).all()
    np.testing.assert_array_equal(f["plain"][0, 0, :2], [[1.0, 1.0], [0.0, 0.0]])
    flipped = ar.follows(lp, implied, first_word_follows=False)
    np.testing.assert_array_equal(flipped["id"][0, 0, :2], 1.0 - f["id"][0, 0, :2])


def test_the_noise_is_drawn_per_question_and_matches_the_norms():
    """A question's noise depends on (key, target, its index) only, so a table in
    chunks draws what one call draws; each row has its step's norm (0 stays 0)."""
    like = jnp.asarray([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
    key, rows = jax.random.PRNGKey(3), jnp.asarray([7, 8, 9])
    z = ar.question_noise(key, 2, rows, like)
    np.testing.assert_allclose(jnp.linalg.norm(z, axis=-1), [5.0, 0.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(ar.question_noise(key, 2, rows[1:], like[1:]), z[1:])
    assert np.abs(ar.question_noise(key, 3, rows, like) - z).max() > 1e-3


@pytest.mark.slow  # ~25-35 s on a loaded 2-core CPU: the gradient's and a 9-target table's compiles
def test_zero_steer_is_a_no_op_and_a_planted_id_moves_the_answer(toy):
    """A route planted by hand: an ID whose columns step along the direction that most
    raises logit(right) - logit(left) at X's word (the margin's gradient there). In
    one table (two chunks of 3): the target = X's own cell (its ID replaced by its own)
    adds zeros, so the ID's and the noise's log p are the unsteered ones; steering X by
    the exact ID difference to a cell beyond Y moves every answer that was not there
    to the target's side (`moved`)."""
    view, params, ex, D = toy
    p = jax.tree_util.tree_map(lambda x: x[0], params)
    words = np.asarray(view.answer_words)[0]
    B = len(np.asarray(ex.answer_B))

    def right_minus_left(v):
        logits = st.steered_logits(view, p, ex.inputs, ex.spans, 1, v)
        return jnp.sum(logits[:, words[1]] - logits[:, words[0]])

    g = jax.grad(right_minus_left)(jnp.zeros((B, D))).mean(0)
    cols = ar.cell_coords(view.grid, np.arange(view.grid.cells), "width")
    delta_LxD = (cols - cols.mean())[:, None] * 40.0 * g / jnp.linalg.norm(g)
    delta = jnp.broadcast_to(delta_LxD, (1, view.n_lm_blocks(p) + 1) + delta_LxD.shape)
    cells, targets = np.asarray(ex.spec.cells_BxK), np.arange(view.grid.cells, dtype=np.int32)
    T = len(targets)
    lp = ar.steer_table(view, params, delta, ex, words, [1], [1], targets,
                        np.broadcast_to(cells[:, 0], (T, B)), 1.0, batch=3)  # fmt: skip
    for b, cell in enumerate(cells[:, 0]):
        for kind in ("id", "noise"):
            np.testing.assert_allclose(lp[kind][0, 0, cell, :, b], lp["plain"][0, :, b],
                                       atol=1e-5)  # fmt: skip
    sides = ar.target_sides(view.grid, targets, np.broadcast_to(cells[:, 1], (T, B)), "width")
    moved = ts.moved(ar.follows(lp, sides), "id")[0, 0]
    beyond = sides != np.sign(cols[cells[:, 1]] - cols[cells[:, 0]])[None]  # Y between
    counted = np.isfinite(moved) & beyond & (sides != 0)
    assert counted.sum() >= 3
    assert (moved[counted] == 1.0).all()


def test_targets_and_layers_are_refused_by_flag_before_any_weight():
    g = Grid(2, 2)
    assert ts.parse_targets(None, g) is None
    np.testing.assert_array_equal(ts.parse_targets("0:0,1:1", g), [0, 3])
    for text, said in (("2:0", "cell 2:0 is not on the 2 x 2 grid"), ("a", "ROW:COL")):
        with pytest.raises(ValueError, match=f"--targets = '{text}'.*{said}"):
            ts.parse_targets(text, g)
    flags = lambda **kw: types.SimpleNamespace(**{  # noqa: E731
        "grid": "2x2", "targets": None, "layers": None, "checkpoint": LLAVA,
        "protocol": "jaxmech", **kw})  # fmt: skip
    ts.check_flags(flags(layers="1"))  # the fixture's 2 blocks: layer 1 is steerable
    for kw, said in ((dict(layers="2"), "no layer in 1..1 of 2 blocks"),
                     (dict(layers="1", protocol="authors"), "expected layers in 0..0"),
                     (dict(targets="0:5"), "--targets")):  # fmt: skip
        with pytest.raises(ValueError, match=said):
            ts.check_flags(flags(**kw))
    assert ts.authors_layers(32) == [12, 13, 14]
    assert ts.authors_layers(2) == [0]


def test_the_entry_point_names_the_bad_flag():
    """~5 s: a subprocess (absl's flags are one per process): --targets off the grid is
    a usage error naming it, before the checkpoint's weights are read."""
    cmd = [sys.executable, "-m", "experiments.arbitrary_steering", f"--checkpoint={LLAVA}",
           "--grid=2x2", "--targets=3:0", "--out=/nonexistent"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(),
                          cwd=os.path.dirname(HERE), timeout=300)  # fmt: skip
    assert done.returncode != 0
    assert "--targets = '3:0': cell 3:0 is not on the 2 x 2 grid" in done.stderr
    assert "loading" not in done.stdout


@pytest.mark.slow  # ~40 s: two compiled tables and the IDs on the LLaVA fixture
def test_the_report_runs_on_llava_under_both_protocols(tmp_path, capsys):
    """`--checkpoint`'s path on the fixture: results.csv, summary.json and both figures;
    the target = own cell rows of jaxmech's protocol follow as the unsteered answers do,
    and a rerun resumes every chunk."""
    import re

    from jaxmech.reports.common import analyse_subject, open_checkpoint

    progress = re.compile(r"\d+/\d+ questions")
    for protocol, layers in (("jaxmech", (1,)), ("authors", None)):
        run = open_checkpoint(LLAVA, grid=(2, 2), size=28, questions=3, batch=2,
                              layers=layers, protocol=protocol, log=quiet)  # fmt: skip
        out = analyse_subject(report.REPORT, run, str(tmp_path / protocol), log=quiet)
        assert progress.search(capsys.readouterr().out)  # 3 questions in chunks of 2
        folder = tmp_path / protocol / "arbitrary_steering"
        for name in ("results.csv", "summary.json", "arbitrary_steering.png",
                     "arbitrary_steering_paper.png"):  # fmt: skip
            assert (folder / name).exists(), name
        s = out["res"]["setup"]
        assert s.protocol == protocol and len(s.targets) == 4
        assert s.sites == (1,) and s.id_sites == ((1,) if protocol == "jaxmech" else (0,))
        # target = own cell (jaxmech's protocol): the ID's answers are the unsteered ones
        if protocol == "jaxmech":
            f = ts.per_question(out["res"], "left_right")["follow"]
            cells = out["res"]["cells"]["left_right"][0]
            for b, cell in enumerate(cells):
                t = list(s.targets).index(cell)
                np.testing.assert_array_equal(f["id"][0, 0, t, b], f["plain"][0, 0, t, b])
        # a rerun reads every chunk back: no chunk is computed
        analyse_subject(report.REPORT, run, str(tmp_path / protocol), log=quiet)
        assert not progress.search(capsys.readouterr().out)
