"""Attribute swapping (paper 003, Fig. 4B): `reports.attribute_swapping` and its entry
point."""

import os

import jax
import numpy as np
import pytest
from conftest import quiet, tiny_vlm_config

from jaxmech.analysis.patching import GROUPS, patch_logp, token_groups
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import examples
from jaxmech.reports import attribute_swapping as report

LLAVA = os.path.join(os.path.dirname(__file__), "fixtures", "llava", "llava")
WORDS = {"left": 7, "right": 8, "both": None}


def _res(logp: dict, answer) -> dict:
    """A one-model result of `logp` (per-question leaves, a model axis added)."""
    add = lambda x: np.asarray(x)[None]  # noqa: E731
    return {"logp": {k: add(v) for k, v in logp.items()}, "answer": np.asarray(answer),
            "words": WORDS}  # fmt: skip


def test_readouts_on_hand_made_log_probabilities():
    """Two questions (answers left, right), one layer, one group: question 0's patch
    moves log p(answer) -1 -> -3 past the other word's -2 (flipped); question 1's
    leaves it. The authors' ratio reads each word: question 0's twin equals its
    question (a zero gap: inf read as 0), question 1's gap is 1."""
    logp = {
        "orig": [-1.0, -0.5], "orig_other": [-2.0, -3.0],
        "twin": [-1.0, -1.5], "twin_other": [-2.0, -3.0],
        "patched": [[[-3.0, -0.5]]], "patched_other": [[[-2.0, -3.0]]],
    }  # fmt: skip
    r = report.readouts(_res(logp, [7, 8]))
    np.testing.assert_allclose(r["change"][0, 0, 0], [-2.0, 0.0])
    np.testing.assert_array_equal(r["flipped"][0, 0, 0], [1.0, 0.0])
    np.testing.assert_allclose(r["twin_change"][0], [0.0, -1.0])
    # word "left": question 0's own answer (gap 0: 0), question 1's other word (-3,
    # unmoved: 0); "right": question 0's other (-2, unmoved), question 1's own (0 / 1)
    np.testing.assert_allclose(r["authors"]["left"][0, 0, 0], [0.0, 0.0])
    np.testing.assert_allclose(r["authors"]["right"][0, 0, 0], [0.0, 0.0])
    logp["patched"] = [[[-3.0, -1.0]]]  # question 1's answer now down by 0.5 of its gap 1
    np.testing.assert_allclose(report.readouts(_res(logp, [7, 8]))["authors"]["right"][0, 0, 0],
                               [0.0, 0.5])  # fmt: skip


def test_the_authors_number_is_the_patching_reports_recolour_column():
    """The authors' shift read here equals `reports.patching`'s recolour twin under
    their protocol (the same script, `attribute_swapping.py`), word by word and
    question by question, on random log p with a zero gap planted."""
    from jaxmech.reports import patching as rp

    rng = np.random.default_rng(2)
    one = lambda: {k: -rng.uniform(0.1, 3.0, (1, 5)) for k in (  # noqa: E731
        "orig", "orig_other", "twin", "twin_other")} | {
        k: -rng.uniform(0.1, 3.0, (1, 2, 3, 5)) for k in ("patched", "patched_other")}  # fmt: skip
    logp = {"mirror": one(), "recolour": one()}
    logp["recolour"]["twin"][0, 0] = logp["recolour"]["orig"][0, 0]  # a zero gap: read as 0
    answer = np.asarray([7, 8, 7, 7, 8])
    theirs = rp.shifts({"logp": logp, "answer": answer, "words": WORDS}, "authors")
    ours = report.readouts({"logp": logp["recolour"], "answer": answer, "words": WORDS})
    for word in ("left", "right"):
        np.testing.assert_allclose(ours["authors"][word], theirs[("recolour", word, "logp")])


@pytest.fixture(scope="module")
def toy():
    """An untrained two-block toy VLM, eight drawn left / right questions with both
    twins, and one jitted patch table (`patch_logp`) for them."""
    from jaxmech.data.spec import pair_questions

    config = tiny_vlm_config(lm_n_layers=2)
    params = toy_vlm.init_params(config, jax.random.PRNGKey(3))
    view = toy_view(config)
    specs = pair_questions(view.grid, 8, 5, view.n_colours, 0, 0)
    ex = examples(view, specs["examples"])
    twins = {t: view.render(specs[t])[0] for t in ("recolour", "mirror")}
    run = jax.jit(lambda twin: patch_logp(view, params, ex.inputs, twin, token_groups(ex.spans),
                                          ex.answer_B, ex.other_B))  # fmt: skip
    return view, run, ex, twins


def _read(toy, twin):
    view, run, ex, _ = toy
    words = np.asarray(view.answer_words)[0]
    out = jax.device_get(run(twin))
    res = _res(out, ex.answer_B) | {
        "words": {"left": int(words[0]), "right": int(words[1]), "both": None}}  # fmt: skip
    return report.readouts(res), out


@pytest.mark.slow  # ~16 s on a loaded 2-core CPU, most of it the toy's eager init
def test_a_self_patch_is_a_no_op_and_a_planted_mirror_is_seen(toy):
    """On the toy: patching the questions with their own run changes nothing and
    flips nothing; with the mirror planted as the twin, every token at layer 0 is the
    mirror's run, so the change is the twin's own and exactly the questions the
    mirror answers otherwise flip; the recolour twin itself is a different picture."""
    _, _, ex, twins = toy
    same, _ = _read(toy, ex.inputs)
    np.testing.assert_allclose(same["change"], 0.0, atol=1e-5)
    assert same["flipped"].sum() == 0
    mirror, out = _read(toy, twins["mirror"])
    every = GROUPS.index("all")
    np.testing.assert_allclose(mirror["change"][0, 0, every], mirror["twin_change"][0], atol=1e-5)
    turned = (out["orig"] > out["orig_other"]) != (out["twin"] > out["twin_other"])
    np.testing.assert_array_equal(mirror["flipped"][0, 0, every], np.asarray(turned, float))
    recolour, _ = _read(toy, twins["recolour"])
    assert np.abs(recolour["twin_change"]).max() > 1e-5


def test_bad_layers_are_refused_by_name_before_compute():
    """~3 s: a layer past the last block is refused naming --layers."""
    from jaxmech.reports.common import open_checkpoint

    run = open_checkpoint(LLAVA, grid=(2, 2), size=28, questions=2, layers=(2,), log=quiet)
    with pytest.raises(ValueError, match=r"--layers = \[2\]: expected layers in 0..1"):
        report.REPORT.check(run, quiet)


@pytest.mark.slow  # ~2-3 min on a loaded 2-core CPU: two compiled patch tables on the LLaVA fixture
def test_the_report_runs_on_llava_under_both_protocols(tmp_path, monkeypatch):
    """`--checkpoint`'s path on the fixture: results, summary and both figures; under
    the authors' protocol (their rainbow twin) every token patched at layer 0 is the
    twin's run; a no-op twin (the question's own pictures) changes nothing."""
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    for protocol in ("jaxmech", "authors"):
        run = open_checkpoint(LLAVA, grid=(2, 2), size=28, questions=3, batch=2,
                              protocol=protocol, log=quiet)  # fmt: skip
        if protocol == "jaxmech":  # the twin replaced by the question itself
            own = report.twin_of
            monkeypatch.setattr(report, "twin_of", lambda r, b: (own(r, b)[0], own(r, b)[0].inputs))
        out = analyse_subject(report.REPORT, run, str(tmp_path / protocol), log=quiet)
        monkeypatch.undo()
        r = out["res"]["read"]
        folder = tmp_path / protocol / "attribute_swapping"
        for name in ("results.csv", "summary.json", "attribute_swapping.png",
                     "attribute_swapping_paper.png"):  # fmt: skip
            assert (folder / name).exists(), name
        if protocol == "jaxmech":
            np.testing.assert_allclose(r["change"], 0.0, atol=1e-5)
        else:
            every = GROUPS.index("all")
            np.testing.assert_allclose(r["change"][0, 0, every], r["twin_change"][0], atol=1e-5)
            assert np.abs(r["twin_change"]).max() > 1e-4  # the rainbow is another picture
