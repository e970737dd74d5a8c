"""The papers' authors' protocols beside jaxmech's on a checkpoint: patching's
two ways of counting a belief shift on hand-made numbers, empty cells, the recolour
control's question, the wording and answer words, grids and layer ranges refused or
read as the authors do, per-question intervals."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxmech.cli import parse_layers
from jaxmech.data.inputs import pictures
from jaxmech.data.spec import Grid, pair_questions
from jaxmech.reports import patching as rp
from jaxmech.reports.common import cell_interval
from jaxmech.stats import bootstrap_ci

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
LEFT, RIGHT = 7, 9  # token ids of the two words, hand-made


def _run(orig, orig_other, twin, twin_other, patched, patched_other):
    """One twin's `patch_logp` output for K = 1 model, Y = G = 1, from [B] lists."""
    a = lambda v: np.asarray(v, float)[None]  # noqa: E731
    return {"orig": a(orig), "orig_other": a(orig_other), "twin": a(twin),
            "twin_other": a(twin_other), "patched": a(patched)[:, None, None],
            "patched_other": a(patched_other)[:, None, None]}  # fmt: skip


@pytest.fixture
def hand_made():
    """Three questions (answers left, right, left); the third is wrong on its mirror.
    The recolour twin leaves question 0's belief where it was (its own denominator 0)."""
    mirror = _run(orig=[-0.1, -0.2, -0.1], orig_other=[-3.0, -2.0, -3.0],
                  twin=[-2.1, -1.2, -0.2], twin_other=[-0.2, -0.4, -2.0],
                  patched=[-1.1, -0.7, -0.1], patched_other=[-1.0, -1.0, -3.0])  # fmt: skip
    recolour = _run(orig=[-0.1, -0.2, -0.1], orig_other=[-3.0, -2.0, -3.0],
                    twin=[-0.1, -0.6, -0.3], twin_other=[-3.0, -1.5, -2.5],
                    patched=[-0.6, -0.4, -0.2], patched_other=[-2.0, -1.0, -2.0])  # fmt: skip
    return {"logp": {"mirror": mirror, "recolour": recolour},
            "answer": np.asarray([LEFT, RIGHT, LEFT]),
            "words": {"left": LEFT, "right": RIGHT, "both": None}}  # fmt: skip


def test_patching_shifts_under_each_protocol(hand_made):
    """jaxmech: the answer word's shift over questions right on the example and its
    mirror (0 and 1), the recolour's over the mirror's denominator; the authors': the
    change of "left" and of "right" over every question, each twin over its own
    denominator, a 0 / 0 counted as 0."""
    j = rp.shifts(hand_made, "jaxmech")
    assert j[("n", "both")].tolist() == [2]
    mirror = [(-0.1 + 1.1) / (-0.1 + 2.1), (-0.2 + 0.7) / (-0.2 + 1.2)]
    np.testing.assert_allclose(j[("mirror", "both", "logp", "mean")][0, 0, 0], np.mean(mirror))
    recolour = [(-0.1 + 0.6) / (-0.1 + 2.1), (-0.2 + 0.4) / (-0.2 + 1.2)]  # mirror's denominators
    np.testing.assert_allclose(j[("recolour", "both", "logp", "mean")][0, 0, 0], np.mean(recolour))

    a = rp.shifts(hand_made, "authors")
    assert a[("n", "left")].tolist() == [3]
    # "left": the answer's log p for questions 0 and 2, the other word's for question 1
    left = [(-0.1 + 1.1) / (-0.1 + 2.1), (-2.0 + 1.0) / (-2.0 + 0.4), (-0.1 + 0.1) / (-0.1 + 0.2)]
    np.testing.assert_allclose(a[("mirror", "left", "logp", "mean")][0, 0, 0], np.mean(left))
    # the recolour's own denominators; question 0's is 0: (-0.1 + 0.6) / 0 = inf, set to 0
    rleft = [0.0, (-2.0 + 1.0) / (-2.0 + 1.5), (-0.1 + 0.2) / (-0.1 + 0.3)]
    np.testing.assert_allclose(a[("recolour", "left", "logp", "mean")][0, 0, 0], np.mean(rleft))
    right = [(-3.0 + 1.0) / (-3.0 + 0.2), (-0.2 + 0.7) / (-0.2 + 1.2), (-3.0 + 3.0) / (-3.0 + 2.0)]
    np.testing.assert_allclose(a[("mirror", "right", "logp", "mean")][0, 0, 0], np.mean(right))


def test_an_empty_patching_cell_says_so(hand_made):
    """No question right on the example and its mirror: every cell is empty (n = 0),
    never a measured-looking +0.000."""
    m = hand_made["logp"]["mirror"]
    m["twin_other"] = m["twin"] - 1.0  # every mirror answered wrong
    sh = rp.shifts(hand_made, "jaxmech")
    assert sh[("n", "both")].tolist() == [0]
    assert np.isnan(sh[("mirror", "both", "logp", "mean")]).all()
    lines = []
    rp.summarise(sh, lines.append, (3,), "jaxmech")
    text = "\n".join(lines)
    assert "empty (n = 0)" in text and "+0.000" not in text
    assert rp.shift_rows(sh, (0,), (3,))[0]["n"] == 0


def test_a_checkpoints_cell_has_a_question_bootstrap_interval(hand_made):
    """One model: the interval is over questions (seeded bootstrap), not NaN."""
    sh = rp.shifts(hand_made, "authors")
    m, lo, hi, n = cell_interval(sh[("mirror", "left", "logp")][:, 0, 0])
    assert n == 3 and lo <= m <= hi and np.isfinite([lo, hi]).all() and hi > lo
    assert cell_interval(sh[("mirror", "left", "logp")][:, 0, 0]) == (m, lo, hi, n)  # seeded
    v = np.random.default_rng(0).normal(size=400)
    m, lo, hi, _ = bootstrap_ci(v)
    assert lo < m < hi and abs((hi - lo) - 2 * 1.96 / 20) < 0.03  # ~ the normal interval


def test_the_recolour_controls_question_stays_true():
    """The recolour twin asks the example's question; its names must be true of the
    recoloured picture (shape alone when the shapes differ)."""
    specs = pair_questions(Grid(3, 3), 30, 10, 6, seed=4)
    names = pictures.object_names(specs["examples"])
    assert names == pictures.object_names(specs["recolour"])
    assert all(" " not in x and " " not in y for x, y in names)  # shapes only
    same = specs["examples"]._replace(labels_BxK=np.asarray(specs["examples"].labels_BxK) * 0 + 1)
    x, y = pictures.object_names(same)[0]  # two circles: named with their colours
    assert x.endswith(" circle") and y.endswith(" circle") and x != "circle"


def test_one_row_or_column_grids_are_refused_before_the_weights(tmp_path):
    """--grid=1x2 used to hang drawing vertical questions; it is refused by name, and
    before any weight is read (an empty weights file would fail later)."""
    with pytest.raises(ValueError, match="grid = 1x2: vertical questions"):
        pair_questions(Grid(1, 2), 3, 10, 6, relation=1)
    with pytest.raises(ValueError, match="grid = 2x1: horizontal questions"):
        pair_questions(Grid(2, 1), 3, 10, 6, relation=0)
    from jaxmech.reports.common import open_checkpoint

    seen = []
    with pytest.raises(ValueError, match="grid = 1x2"):
        open_checkpoint(FOLDER, grid=(1, 2), size=112, questions=2, log=seen.append)
    assert not any(line.startswith("loading") for line in seen)


def test_layers_are_inclusive_as_the_authors_index():
    assert parse_layers("6:8") == (6, 7, 8)
    assert parse_layers("3,5") == (3, 5)
    from jaxmech.reports.common import open_checkpoint

    with pytest.raises(ValueError, match="expected LM layers in \\[0, 2\\]"):
        open_checkpoint(FOLDER, grid=(2, 2), size=112, questions=2, layers=(3,),
                        log=lambda *_: None)  # fmt: skip


def test_the_authors_wording_and_answer_words():
    """--protocol=authors asks 'Answer "left" or "right" only.' and reads the
    lower-case words; jaxmech's reads "Left" / "Right"."""
    from jaxmech.families.qwen2_vl import processor
    from jaxmech.families.qwen2_vl.view import checkpoint_view
    from jaxmech.families.registry import read_checkpoint_config

    _, config = read_checkpoint_config(FOLDER)
    proc = processor.load_processor(FOLDER, config)
    first = lambda w: proc.tokenizer.encode(w, add_special_tokens=False).ids[0]  # noqa: E731
    views = {w: checkpoint_view(FOLDER, config, Grid(2, 2), 112, wording=w)
             for w in ("jaxmech", "authors")}  # fmt: skip
    assert views["authors"].answer_words[0].tolist() == [first("left"), first("right")]
    assert views["jaxmech"].answer_words[0].tolist() == [first("Left"), first("Right")]
    spec = pair_questions(Grid(2, 2), 1, 10, 6)["examples"]
    q = pictures.questions(spec, pictures.AUTHORS_TEMPLATES)[0]
    assert q.endswith('? Answer "left" or "right" only.') and "to the left or right of" in q
    with pytest.raises(ValueError, match="wording = 'nope'"):
        checkpoint_view(FOLDER, config, Grid(2, 2), 112, wording="nope")


def test_the_authors_steer_against_the_models_own_answer():
    """Their direction comes from the model's answer, not the truth: answered "left"
    (or "above"), X is pushed from cell (0, 0) to the far corner along the relation;
    answered the second word, back; any other top token is not counted."""
    import jax.numpy as jnp

    from jaxmech.analysis import steering as st

    words = np.asarray([[3, 4], [5, 6]])  # left, right; above, below
    logits = np.zeros((4, 8))
    logits[[0, 1, 2, 3], [3, 4, 6, 0]] = 1.0  # left, right, below, an ambiguous token
    src, tgt, counted = st.answer_corners(
        jnp.asarray(logits), words, np.asarray([0, 0, 1, 0]), 3, 4
    )
    assert src.tolist() == [0, 3, 8, 3] and tgt[:3].tolist() == [3, 0, 0]
    assert counted.tolist() == [True, True, True, False]
    # the flip rate counts only the answered examples; none answered: empty, not zero
    plain = np.asarray([[[1.0, -1.0, 2.0, 0.5]]])
    res = {"relation": np.asarray([0, 0, 1, 0]),
           "authors": {"plain": plain, "counted": np.asarray([[[True, True, True, False]]]),
                       "id": -plain, "noise": plain, "orthogonal": plain}}  # fmt: skip
    rates = st.authors_flip_rates(res)
    assert rates[("id", "horizontal")][0, 0] == 1.0 and rates[("n", "horizontal")][0, 0] == 2
    res["authors"]["counted"] = np.zeros((1, 1, 4), bool)
    assert np.isnan(st.authors_flip_rates(res)[("id", "horizontal")][0, 0])


@pytest.mark.slow  # ~22 s (generation's compiles); test_photo_questions' steering-manifest:authors keeps the authors' steering end to end in the suite
def test_steering_under_the_authors_protocol_end_to_end(tmp_path):
    """The steering report on the fixture under --protocol=authors: the authors'
    table per layer with n, intervals over questions where n >= 2. ~10 s: the probes,
    the plain run and every steered one compile in one program; the replies this
    family generates are 2 tokens (their 250 would triple the test)."""
    from jaxmech.reports import steering as rs
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    run = open_checkpoint(FOLDER, grid=(2, 2), size=112, questions=4, layers=(1,),
                          protocol="authors", log=lambda *_: None)  # fmt: skip
    out = analyse_subject(rs.report(2), run, str(tmp_path), log=lambda *_: None)
    rows = out["tables"]["authors"]
    # 4 questions per relation, each steered along the axis its reply names; "both" pools
    assert {r["site"] for r in rows} == {1}
    assert all(0 <= r["n"] <= (8 if r["relation"] == "both" else 4) for r in rows)
    n = {(r["relation"], r["kind"]): r["n"] for r in rows}
    assert all(n["both", k] == n["horizontal", k] + n["vertical", k] for k in ("id", "noise"))
    (row,) = [r for r in rows if r["relation"] == "horizontal" and r["kind"] == "noise"]
    cell = out["summary"]["authors/layer 1/horizontal"]["noise"]
    assert cell[3] == row["n"]  # the interval rests on the counted questions
    if row["n"] >= 2:
        assert np.isfinite(cell[:3]).all()
    else:
        assert np.isnan(cell[1])


def test_the_median_over_checkpoints():
    """Several checkpoints: every interval becomes the median of the means with its
    spread and the count of checkpoints that had one; an empty one is left out."""
    from jaxmech.reports.common import across_checkpoints

    nan = float("nan")
    summaries = {
        "a": {"x": {"y": (0.2, 0.1, 0.3, 5)}, "kept": [3], "e": (nan, nan, nan, 0)},
        "b": {"x": {"y": (0.6, 0.5, 0.7, 4)}, "kept": [4], "e": (nan, nan, nan, 0)},
        "c": {"x": {"y": (0.3, 0.0, 0.9, 2)}, "kept": [2], "e": (1.0, nan, nan, 1)},
    }
    out = across_checkpoints(summaries)
    assert out["checkpoints"] == ["a", "b", "c"]
    assert out["x"]["y"] == {"median": 0.3, "min": 0.2, "max": 0.6, "models": 3}
    assert out["e"] == {"median": 1.0, "min": 1.0, "max": 1.0, "models": 1}
    assert out["kept"] == [[3], [4], [2]]


def test_a_bad_second_checkpoint_is_refused_before_the_first_runs(tmp_path):
    """--checkpoint=A,B checks every folder before any weight is read."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "experiments.patching", f"--checkpoint={FOLDER},{tmp_path}",
           f"--out={tmp_path / 'out'}", "--size=112", "--grid=2x2"]  # fmt: skip
    root = os.path.dirname(os.path.dirname(__file__))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=120)
    assert r.returncode != 0 and str(tmp_path) in r.stderr
    assert "loading" not in r.stdout and not (tmp_path / "out").exists()
