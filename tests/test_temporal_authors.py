"""Fig. 10 under the authors' protocol (`reports.temporal_authors`): their temporal IDs
(per-frame means, PCA line, mirror-frame steering vector), the time-reversed twin's
patch and the steering on the Qwen2.5-VL fixture's video input, refusals by name."""

import os

import numpy as np
import pytest
from conftest import quiet

from jaxmech.analysis import temporal_ids as tid
from jaxmech.data.inputs import pictures
from jaxmech.data.spec import Grid, SceneSpec, mirror_height
from jaxmech.reports import temporal_authors as ta

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_5_vl")


def test_frame_ids_average_per_object_then_over_objects():
    """Object 1 seen twice in frame 0 (states 0 and 2: mean 1) and object 2 once (4):
    frame 0's ID is (1 + 4) / 2, not the mean of the three states; frame 2 has no
    object: NaN; mismatched or out-of-range inputs are refused by name."""
    states = np.array([[[0.0], [2.0], [4.0], [6.0]]])  # [Y=1, N=4, D=1]
    ids = tid.frame_ids(states, [1, 1, 2, 1], [0, 0, 0, 1], 3)
    np.testing.assert_allclose(ids[0, :2, 0], [2.5, 6.0])
    assert np.isnan(ids[0, 2]).all()
    with pytest.raises(ValueError, match="one label and frame per word state"):
        tid.frame_ids(states, [1, 1, 2], [0, 0, 0], 3)
    with pytest.raises(ValueError, match="frame_N"):
        tid.frame_ids(states, [1, 1, 2, 1], [0, 0, 0, 3], 3)


def test_mirror_steer_and_the_pca_line():
    """The steering vector of frame f is minus frame T-1-f's and zero at the middle
    frame; the PCA line puts the first frame at 0 and the last at 1 whatever the sign
    of the IDs, its marks where the frames they equal lie, and a line of frames holds
    all the variance."""
    rng = np.random.default_rng(0)
    u = rng.normal(size=8)
    ids = np.arange(5)[:, None] * u + 3.0  # a linear temporal ID, T = 5
    np.testing.assert_allclose(ta.tid.mirror_steer(ids, 1, 5.0), -ta.tid.mirror_steer(ids, 3, 5.0))
    np.testing.assert_array_equal(tid.mirror_steer(ids, 2, 5.0), 0.0)
    for sign in (1.0, -1.0):
        line = tid.pca_line(sign * ids, sign * ids[[3, 1]])
        np.testing.assert_allclose(line["frames"], np.linspace(0, 1, 5), atol=1e-9)
        np.testing.assert_allclose(line["marks"], [0.75, 0.25], atol=1e-9)
        assert line["explained"] > 1 - 1e-9


def test_scaled_layers_follow_the_lm_depth():
    assert ta.scaled(13, 28, 26) == 13 and ta.scaled(13, 36, 34) == 17
    assert ta.scaled(13, 2, 0) == 0 and ta.scaled(12, 2, 2) == 1


def _video_run(**kw):
    from jaxmech.reports.common import open_checkpoint

    kw = {"questions": 3, **kw}
    return open_checkpoint(FOLDER, grid=(2, 2), size=112, video=True, batch=64,
                           protocol="authors", log=quiet, **kw)  # fmt: skip


def test_their_question_is_asked_and_the_twin_keeps_it():
    """The videos are asked the authors' question after their time instruction (longer
    than the view's own prompt); the object words are found in it, X's before Y's;
    the time-reversed twin has the same tokens and its frames swapped."""
    from jaxmech.reports.common import view_of
    from jaxmech.reports.questions import relation_questions

    run = _video_run()
    view, ex = view_of(run), relation_questions(run)
    inputs, spans = ta.render(view, ex.spec)
    rev, _ = ta.render(view, mirror_height(view.grid, ex.spec), ask=ex.spec)
    tokens = np.asarray(inputs.tokens_BxS)
    assert tokens.shape[1] > np.asarray(ex.inputs.tokens_BxS).shape[1]
    np.testing.assert_array_equal(np.asarray(rev.tokens_BxS), tokens)
    P = np.asarray(inputs.pixels_BxPxF).shape[1] // 2  # patches per frame
    np.testing.assert_array_equal(
        np.asarray(rev.pixels_BxPxF)[:, :P], np.asarray(inputs.pixels_BxPxF)[:, P:]
    )
    tok = view.render.args[0].tokenizer
    names = pictures.object_names(ex.spec)
    for b, (x, y) in enumerate(names):
        text = tok.decode([int(t) for t in tokens[b] if t >= 0])
        assert "before or after the" in text and "Answer in one word" in text
        assert spans.x_B[b] < spans.y_B[b]
        for pos, name in ((spans.x_B[b], x), (spans.y_B[b], y)):
            if tok.token_to_id(name) is not None:  # the fixture's word-level vocabulary
                assert tok.id_to_token(int(tokens[b, pos])) == name


def test_refusals_are_named_before_compute():
    """Pictures, not videos: refused by the report's check and by the authors' render;
    a block past the last patchable one is refused naming --layers."""
    from jaxmech.reports import temporal_ids
    from jaxmech.reports.common import open_checkpoint, view_of

    pictures = open_checkpoint(FOLDER, size=112, protocol="authors", log=quiet)
    with pytest.raises(ValueError, match="opened as videos"):
        temporal_ids.REPORT.check(pictures, quiet)
    with pytest.raises(ValueError, match="not a Qwen2 / Qwen2.5-VL video view"):
        ta.video_clock(view_of(pictures))
    one = np.array([[0, 1, -1]])  # X and Y both in frame 0 of 3
    spec = SceneSpec(one, one + 1, one, one * 0, np.ones(1, np.int32))
    with pytest.raises(ValueError, match=r"--questions: .* frame\(s\) \[1, 2\]"):
        ta.check_frames(spec, Grid(3, 2))
    ta.check_frames(spec._replace(cells_BxK=np.array([[0, 3, -1]])), Grid(2, 2))  # frames 0, 1
    with pytest.raises(ValueError, match=r"layers = \[1\]: .* expected blocks in \[0, 0\]"):
        temporal_ids.REPORT.check(_video_run(layers=(1,)), quiet)


# slow: ~55 s on a shared CPU, compiles the patch table and the steered forward on the fixture's video view
@pytest.mark.slow
def test_the_twins_patch_of_everything_is_the_twin_and_a_zero_steer_is_a_no_op():
    """Their question in Qwen's template (the object words found in it); patching every
    position at a block's output with the time-reversed twin's gives the twin's log p
    (shift 1 for both words); a scale-0 steer changes no log p."""
    import jax

    from jaxmech.reports.common import view_of
    from jaxmech.reports.questions import relation_questions

    run = _video_run(layers=(0,))
    s, view = ta.setup(run), view_of(run)
    ex = relation_questions(run)
    inputs, spans = ta.render(view, ex.spec)
    rev, _ = ta.render(view, mirror_height(view.grid, ex.spec), ask=ex.spec)
    swap = ta.mirror_swap(view, run.params, inputs, rev, spans, (0,), s["words"])
    lp = swap["logp"]
    every = list(ta.GROUPS).index("all")
    np.testing.assert_allclose(lp["patched"][0, 0, every], lp["twin"][0], atol=2e-4)
    np.testing.assert_allclose(lp["patched_other"][0, 0, every], lp["twin_other"][0], atol=2e-4)
    moved = np.abs(lp["orig"][0] - lp["twin"][0]) > 1e-3
    assert moved.any()
    np.testing.assert_allclose(swap["ratio"][:, 0, every][:, moved], 1.0, atol=0.05)
    params = jax.tree_util.tree_map(lambda x: x[0], run.params)
    ids = ta.extract(view, params, ex, inputs, spans, None)  # [Y, T, D]
    assert np.isfinite(ids).all()
    zero = ta.steer(view, params, inputs, spans, ids, (0,), s["words"], scale=0.0)
    assert zero.shape == (1, 2, 2, 3)
    np.testing.assert_allclose(zero, 0.0, atol=1e-6)
    some = ta.steer(view, params, inputs, spans, ids, (0,), s["words"], scale=5.0)
    assert np.abs(some).max() > 1e-4


# slow: ~60 s on a shared CPU, the whole report on the fixture's video input
@pytest.mark.slow
def test_the_report_runs_under_the_authors_protocol(tmp_path):
    from jaxmech.reports import temporal_ids
    from jaxmech.reports.common import analyse_subject

    out = analyse_subject(temporal_ids.REPORT, _video_run(questions=4), str(tmp_path), log=quiet)
    res, tables = out["res"], out["tables"]
    assert res["ids"].shape[:2] == (3, 2) and res["steer"].shape == (1, 2, 2, 4)
    assert {r["group"] for r in tables["mirror_swap"]} == set(ta.GROUPS)
    assert {r["n"] for r in tables["steering"]} <= {0, 1, 2, 3, 4}
    # each question counted once per frame and read word, on its own answer's side
    assert sum(r["n"] for r in tables["steering"]) == 4 * 2 * 2
    for name in ("mirror_swap.csv", "steering.csv", "pca.csv", "summary.json",
                 "temporal_ids.png", "temporal_ids_paper.png"):  # fmt: skip
        assert (tmp_path / "temporal_ids" / name).exists(), name
