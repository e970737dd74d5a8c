"""Fig. 6C / 6D's question sets (near / far, in between) of the arbitrary-steering
report: `reports.target_questions` and `reports.arbitrary_steering --sets`."""

import os

import numpy as np
import pytest
from conftest import quiet, tiny_vlm_config

from jaxmech.analysis import arbitrary_steering as ar
from jaxmech.data.spec import Grid
from jaxmech.reports import arbitrary_steering as report
from jaxmech.reports import target_questions as tq
from jaxmech.reports import target_steering as ts

LLAVA = os.path.join(os.path.dirname(__file__), "fixtures", "llava", "llava")
G = Grid(4, 4)  # cells 0..15, row-major


def test_near_and_between_sides_on_hand_made_cells():
    # Y at (1, 1) = cell 5: its 8 neighbours are near, its own cell none, the rest far
    near = tq.near_sides(G, np.arange(16), [5])[:, 0].reshape(4, 4)
    want = -np.ones((4, 4), int)
    want[0:3, 0:3] = 1
    want[1, 1] = 0
    np.testing.assert_array_equal(near, want)
    # Y at the top (cell 2), Z at the bottom (cell 14) of column 2: cells 6, 10 between
    between = tq.between_sides(G, np.arange(16), [2], [14])[:, 0].reshape(4, 4)
    want = -np.ones((4, 4), int)
    want[1:3, 2] = 1
    want[0, 2] = want[3, 2] = 0
    np.testing.assert_array_equal(between, want)
    # Z before Y and off one column: the box they span, either order
    np.testing.assert_array_equal(tq.between_sides(G, [5, 6, 9], [10], [0])[:, 0], [1, 1, 1])
    np.testing.assert_array_equal(tq.between_sides(G, [3, 12], [10], [0])[:, 0], [-1, -1])


def test_between_scenes_put_x_between_in_half_and_refuse_a_short_grid():
    spec = tq.between_scenes(G, 8, 10, 6, seed=3)
    cells, labels = np.asarray(spec.cells_BxK), np.asarray(spec.labels_BxK)
    assert cells.shape == (8, 3)
    np.testing.assert_array_equal(cells[:, 1:], np.broadcast_to([2, 14], (8, 2)))
    yes = np.diagonal(tq.between_sides(G, cells[:, 0], cells[:, 1], cells[:, 2])) == 1
    np.testing.assert_array_equal(yes, np.arange(8) % 2 == 0)
    assert (cells[1::2, 0] % 4 != 2).all()  # a "no" scene's X is off the column
    assert all(len(set(row)) == 3 for row in labels.tolist())
    np.testing.assert_array_equal(tq.between_scenes(G, 8, 10, 6, seed=3).cells_BxK, cells)
    with pytest.raises(ValueError, match="--grid = 2x4: in-between questions need 3\\+ rows"):
        tq.between_scenes(Grid(2, 4), 2, 10, 6)


def test_sets_and_their_refusals_are_named_before_compute():
    assert report.parse_sets(None) == ("left_right",)
    assert report.parse_sets("near_far, in_between,near_far") == ("near_far", "in_between")
    with pytest.raises(ValueError, match="--sets = 'up_down': expected some of left_right"):
        report.parse_sets("up_down")
    toy = tiny_vlm_config(lm_n_layers=2)
    assert report.refusal_of(("left_right",))(toy, "RUN") is None
    why = report.refusal_of(("left_right", "near_far"))(toy, "RUN")
    assert "--sets=near_far" in why and "--checkpoint" in why


def test_a_checkpoint_refuses_unreadable_words_and_a_short_grid():
    """~5 s: the fixture's word-level tokenizer reads near and far as one token, and a
    2 x 2 grid has no row between a top and a bottom one: both refused by name."""
    from jaxmech.reports.common import open_checkpoint

    run = open_checkpoint(LLAVA, grid=(2, 2), size=28, questions=2, layers=(1,), log=quiet)
    report.report().check(run, quiet)  # left / right alone: nothing more asked
    with pytest.raises(ValueError, match="--sets=near_far: 'Near' and 'Far' begin with the same"):
        report.report(sets=("near_far",)).check(run, quiet)
    with pytest.raises(ValueError, match="--grid = 2x2"):
        report.report(sets=("in_between",)).check(run, quiet)


def _res(lp, sides, line, words=("near", "far")):
    """One model, one layer, one question set "s" (truths from the unsteered answers)."""
    s = ts.Setup((1,), (1,), (1,), 1.0, np.arange(16, dtype=np.int32), "jaxmech")
    truth = lp["plain"][0, 0] > lp["plain"][0, 1]
    return {"lp": {"s": lp}, "sides": {"s": sides}, "answer_first": {"s": truth},
            "words": {"s": (words, True)}, "lines": {"s": line}, "setup": s}  # fmt: skip


def test_a_planted_near_route_is_followed_and_drawn_along_the_figures_line():
    """A model that answers "near" exactly where X was steered next to Y (planted by
    hand in the log p): every answer follows its target, those that were "far" are all
    moved, the noise moves none; the figure's curves run along the set's line in its
    order, labelled (x, y) as the authors' ticks."""
    y_cell = np.asarray([5, 15])  # B = 2 questions, Y at (1, 1) and (3, 3)
    sides = tq.near_sides(G, np.arange(16), y_cell)  # [T, B]
    plain = np.asarray([[[-2.0, -1.0], [-1.0, -2.0]]]).transpose(0, 2, 1)  # [K, W, B]: far, near
    near = (sides == 1)[None, None, :, None, :]  # [1, 1, T, 1, B]
    planted = np.where(near, np.asarray([-0.5, -3.0])[:, None], np.asarray([-3.0, -0.5])[:, None])
    noise = np.broadcast_to(plain[:, None, None], planted.shape)  # noise moves nothing
    lp = {"plain": plain, "id": planted, "noise": noise}
    res = _res(lp, sides, (2, 6, 10, 14))
    f = ts.per_question(res, "s")["follow"]
    counted = sides != 0
    assert (f["id"][0, 0][counted] == 1.0).all()
    moved = ts.moved(f, "id")[0, 0]
    assert (moved[np.isfinite(moved)] == 1.0).all() and np.isfinite(moved).sum() >= 8
    assert np.nansum(ts.moved(f, "noise")) == 0.0
    rows, ticks = ts.paper_panels(res, "s", G, split=True)
    assert ticks == ["(2,0)", "(2,1)", "(2,2)", "(2,3)"]
    (title, curves, _), _ = rows[0]
    assert title == "Layer 1 — Original: near" and list(curves) == ["ΔP('near')", "ΔP('far')"]
    # question 1 (truth near) at target (2,2) = cell 10: near Y's 15, so log p(near) +0.5
    np.testing.assert_allclose(curves["ΔP('near')"][2][0], -0.5 - -1.0)
    assert ar.mirror_cells(G, [2], "height")[0] == 14  # in between's authors' mirror


def _readable(run):
    """`near_far_words` reading two distinct fixture tokens (its left / right) as near /
    far: the fixture's tokenizer has neither word."""
    words = np.asarray(run.subject.vlm_view.answer_words)[0]
    return lambda folder, wording: words


@pytest.mark.slow  # ~60 s: the IDs and two compiled 16-target tables per protocol
def test_near_far_and_in_between_run_on_llava_under_both_protocols(tmp_path, monkeypatch):
    """`--sets=near_far,in_between` on the fixture (4 x 4 grid): both sets' tables,
    results, summary and four figures per protocol; under jaxmech's, target = X's own
    cell changes no log p (a no-op steer); in between's truths alternate as drawn."""
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    for protocol, layers in (("jaxmech", (1,)), ("authors", None)):
        run = open_checkpoint(LLAVA, grid=(4, 4), size=28, questions=4, batch=4,
                              layers=layers, protocol=protocol, log=quiet)  # fmt: skip
        monkeypatch.setattr(tq, "near_far_words", _readable(run))
        rep = report.report(sets=("near_far", "in_between"))
        res = analyse_subject(rep, run, str(tmp_path / protocol), log=quiet)["res"]
        assert set(res["lp"]) == {"near_far", "in_between"}
        assert res["lines"]["in_between"] == (2, 6, 10, 14)
        np.testing.assert_array_equal(res["answer_first"]["in_between"], [1, 0, 1, 0])
        folder = tmp_path / protocol / "arbitrary_steering"
        for name in ("near_far", "in_between"):
            for paper in (False, True):
                assert (folder / report.figure_name(name, paper)).exists()
        if protocol == "jaxmech":
            for name in ("near_far", "in_between"):
                shift = ts.per_question(res, name)["shift"]["id"][0, 0]  # [T, W, B]
                own = res["cells"][name][0]
                for b, cell in enumerate(own):
                    np.testing.assert_allclose(shift[cell, :, b], 0.0, atol=1e-5)
                assert np.abs(shift).max() > 1e-6  # other targets do move it
