"""The depth diagnosis (paper 003, Fig. 7): `reports.depth_diagnosis`."""

import os

import numpy as np
import pytest
from conftest import quiet, tiny_vlm_config

from jaxmech.data.spec import Grid
from jaxmech.reports import depth_diagnosis as report

LLAVA = os.path.join(os.path.dirname(__file__), "fixtures", "llava", "llava")


def _res(shift_id, sides, follows_first):
    """A one-model, one-layer result of set "depth" with the given ID shifts [T, W, B]
    (log p changes: plain 0) and sides [T, B]."""
    lp = {"plain": np.zeros((1, 2, shift_id.shape[-1])), "id": shift_id[None, None],
          "noise": np.zeros_like(shift_id)[None, None]}  # fmt: skip
    return {"lp": {"depth": lp}, "sides": {"depth": sides},
            "words": {"depth": (("front", "behind"), follows_first)}}  # fmt: skip


def test_the_contrast_reads_up_minus_down_with_depth_negated():
    """Targets above (+1) raise log p(behind) by 2 and lower front by 1, below the
    opposite: the depth belief (behind - front) moves by +3 up and -3 down, a contrast
    of 6; a question with no target below has none (NaN)."""
    up, down = [-1.0, 2.0], [1.0, -2.0]  # (front, behind) changes
    shift = np.stack([np.stack([up, up], -1), np.stack([down, up], -1)])  # [T=2, W, B=2]
    sides = np.asarray([[1, 1], [-1, 1]])
    c = report.contrast(_res(shift, sides, False), "depth", "id")
    np.testing.assert_allclose(c[0, 0, 0], 6.0)
    assert np.isnan(c[0, 0, 1])
    # read as a height set (first word follows), the same shifts give the opposite sign
    np.testing.assert_allclose(
        report.contrast(_res(shift, sides, True), "depth", "id")[0, 0, 0], -6.0
    )
    assert report.contrast(_res(shift, sides, False), "depth", "noise")[0, 0, 0] == 0.0


def test_the_verdict_reads_the_interval():
    assert report.verdict((0.5, 0.1, 0.9, 10)).startswith("yes")
    assert report.verdict((-0.5, -0.9, -0.1, 10)).startswith("no")
    assert report.verdict((0.1, -0.1, 0.3, 10)).startswith("undecided")
    assert "n = 0" in report.verdict((float("nan"),) * 3 + (0,))


def test_a_results_folder_and_unreadable_depth_words_are_refused():
    """A toy VLM's run has no depth report (no front / behind words); the fixture's
    word-level tokenizer reads both words as one token: refused by name before compute."""
    from jaxmech.reports.common import open_checkpoint

    why = report.refusal(tiny_vlm_config(lm_n_layers=2), "RUN")
    assert "no depth_diagnosis report" in why and "--checkpoint" in why
    run = open_checkpoint(LLAVA, grid=(2, 2), size=28, questions=2, layers=(1,), log=quiet)
    with pytest.raises(ValueError, match="depth diagnosis: relation 4: both answer words"):
        report.REPORT.check(run, quiet)
    np.testing.assert_array_equal(report.authors_targets(Grid(4, 4)), [0, 4, 8, 12])


def _readable(run):
    """`run` whose view reads two distinct fixture tokens as front / behind (the
    fixture's tokenizer has neither word): its left / right ids."""
    view = run.subject.vlm_view
    words = np.asarray(view.answer_words).copy()
    words[report.DEPTH] = words[0]
    return run._replace(subject=run.subject._replace(vlm_view=view._replace(answer_words=words)))


@pytest.mark.slow  # ~40 s: the IDs and two compiled tables per protocol on the LLaVA fixture
def test_the_report_runs_on_llava_under_both_protocols(tmp_path):
    """`--checkpoint`'s path on the fixture: both question sets (the same pictures asked
    above / below and front / behind), the contrast and its verdict per layer, results,
    summary and both figures; the authors' targets are column 0."""
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    for protocol, layers, n_targets in (("jaxmech", (1,), 4), ("authors", None, 2)):
        run = _readable(open_checkpoint(LLAVA, grid=(2, 2), size=28, questions=3, batch=2,
                                        layers=layers, protocol=protocol, log=quiet))  # fmt: skip
        out = analyse_subject(report.REPORT, run, str(tmp_path / protocol), log=quiet)
        res, summary = out["res"], out["summary"]
        assert set(res["lp"]) == {"height", "depth"}
        assert len(res["setup"].targets) == n_targets
        layer = res["setup"].layers[0]
        assert "depth_read_as_height" in summary[f"contrast/layer {layer}"]
        folder = tmp_path / protocol / "depth_diagnosis"
        for name in ("results.csv", "summary.json", "depth_diagnosis.png",
                     "depth_diagnosis_paper.png"):  # fmt: skip
            assert (folder / name).exists(), name
        # the depth questions differ from the height ones: another prompt, same pictures
        h, d = (res["lp"][k]["plain"] for k in ("height", "depth"))
        assert h.shape == d.shape
