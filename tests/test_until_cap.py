"""A `--seeds_until` run resumed with its cap raised (`--max_seeds`): it trains on from
the models it has, to the models an uninterrupted run with that cap trains; the rule
and the count stay fixed, and the cap never goes down.

The chunk loop is checked on `test_selection`'s stubbed training (a seed's score from a
table, no compute); one test trains the tiny VLM for real, to check that the models a
raised cap keeps come back bit for bit."""

import json
import os

import jax
import numpy as np
import pytest
import test_selection
from conftest import Interrupted, quiet, stop_after, tiny_vlm_config
from test_selection import _selection, _train

from jaxmech import results
from jaxmech.reports.runs import run_selection
from jaxmech.sweep import SweepMismatchError, expand, run_grid, seeds_until


def _rows(out):
    return results.read_csv(os.path.join(out, "results.csv"))


def _sweep_until(out):
    with open(os.path.join(out, "sweep.json")) as f:
        return json.load(f)["until"]


@pytest.mark.parametrize("cap", [4, 3])  # the old cap at a chunk's end, and inside one
def test_a_raised_cap_trains_on_to_an_uninterrupted_runs_models(monkeypatch, tmp_path, cap):
    """Seeds 0, 3, 4, 5 pass (`test_selection.SCORES`), 3 are asked: the run stops at
    its cap with 2 (cap 3: seeds 0..2; cap 4: 0..3); raised to 8 it trains only the
    seeds after them, in chunks ending where an uninterrupted run's end."""
    out, whole = str(tmp_path / "run"), str(tmp_path / "whole")
    res, fake = _train(monkeypatch, out, 3, cap)
    assert res["selection"]["passing_models"] == [0] + [3] * (cap == 4)
    lines = []
    res, fake = _train(monkeypatch, out, 3, 8, log=lines.append)
    assert fake.calls == ([[4, 5]] if cap == 4 else [[3, 3], [4, 5]])  # seed 3 padded alone
    assert any("cap raised from" in x and f"{cap} to 8" in x for x in lines)
    assert any(x.startswith("selection: n = 4 of 6") and f"raised from {cap})" in x for x in lines)
    want, _ = _train(monkeypatch, whole, 3, 8)
    assert _rows(out) == _rows(whole) and res["rows"] == want["rows"]
    sel = _selection(out)
    assert sel["raised_from"] == [cap] and sel["max_seeds"] == 8 and sel["trained"] == 6
    assert sel["passing_models"] == want["selection"]["passing_models"] == [0, 3, 4, 5]
    assert _sweep_until(out)["raised_from"] == [cap] and "raised_from" not in _sweep_until(whole)
    assert not os.path.exists(os.path.join(out, "reused"))
    words = run_selection(out, _rows(out)).words()
    rule = "unseen_min_acc >= 0.9"
    assert words == f"n = 4 of 6 trained (rule: {rule}; cap 8 seeds, raised from {cap})"
    res, fake = _train(monkeypatch, out, 3, 8)  # finished: nothing trains, the record stays
    assert fake.calls == [] and _selection(out) == sel


def test_a_raised_cap_resumes_after_a_kill_and_raises_again(monkeypatch, tmp_path):
    monkeypatch.setattr(test_selection, "SCORES", {s: 0.95 * (s in (0, 5, 9)) for s in range(12)})
    out, whole = str(tmp_path / "run"), str(tmp_path / "whole")
    _train(monkeypatch, out, 3, 4)  # seed 0 passes
    with pytest.raises(Interrupted):  # killed after the first chunk the raise trains
        _train(monkeypatch, out, 3, 7, log=stop_after(1))
    assert not os.path.exists(os.path.join(out, "results.csv"))
    res, fake = _train(monkeypatch, out, 3, 7)  # resumed: chunk [4, 5] is not trained again
    assert fake.calls == [[6, 6]] and res["selection"]["passing_models"] == [0, 5]
    res, fake = _train(monkeypatch, out, 3, 12)  # raised again: cut at 4 and at 7
    assert fake.calls == [[7, 7], [8, 9]] and _selection(out)["raised_from"] == [4, 7]
    want, _ = _train(monkeypatch, whole, 3, 12)
    assert _rows(out) == _rows(whole) and res["selection"]["passing_models"] == [0, 5, 9]


def test_a_run_with_enough_passing_is_not_trained_on_by_a_raised_cap(monkeypatch, tmp_path):
    out = str(tmp_path / "run")
    _train(monkeypatch, out, 2, 4)  # seeds 0 and 3 pass
    sel, lines = _selection(out), []
    res, fake = _train(monkeypatch, out, 2, 8, log=lines.append)
    assert fake.calls == [] and _selection(out) == sel and res["selection"] == sel
    assert any("already pass" in x and "trains none" in x for x in lines)


@pytest.mark.parametrize(
    "passing, cap, rule, message",
    [
        (2, 3, None, "not at most 3: a cap may be raised, never lowered"),
        (3, 8, None, "its selection rule is fixed at its start"),
        (2, 8, "unseen_min_acc>=0.5", "its selection rule is fixed at its start"),
    ],
)
def test_a_lower_cap_or_another_rule_is_refused(monkeypatch, tmp_path, passing, cap, rule, message):
    out = str(tmp_path / "run")
    _train(monkeypatch, out, 2, 4)
    before = {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)}
    with pytest.raises(SweepMismatchError, match=message):
        _train(monkeypatch, out, passing, cap, rule)
    assert {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)} == before


def _real(out, cap):
    """A --seeds_until run of the tiny VLM (10 steps, chunks of 2) whose rule no model
    passes, so that it trains every seed up to its cap."""
    grid = expand(tiny_vlm_config(steps=10, eval_every=10), {}, seeds=cap)
    until = seeds_until(grid, 1, cap, "unseen_min_acc>=2")
    return run_grid(grid, out, chunk_size=2, until=until, log=quiet)


@pytest.mark.slow
def test_the_models_a_raised_cap_keeps_are_bit_for_bit_an_uninterrupted_runs(tmp_path):
    """Slow (30-55 s on a shared 2-core machine: five chunks of real training): cap 1 raised to 3 keeps model
    0 (its params, curves and results read back from the finished folder) and trains
    seeds 1 and 2 in chunks of their own; every file equals a cap-3 run's."""
    out, whole = str(tmp_path / "run"), str(tmp_path / "whole")
    _real(out, 1)
    res = _real(out, 3)
    _real(whole, 3)
    assert res["trained_steps"] == 2 * 10  # model 0 was not trained again
    a, b = results.load_run(out), results.load_run(whole)
    assert a.results == b.results and a.curves == b.curves
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("per_model", [True, False])
def test_a_selection_no_model_passes_has_no_main_group(monkeypatch, tmp_path, per_model):
    """A run at its cap with no passing model: every report puts its failing models
    beside, none as the main group, and says so."""
    from jaxmech.reports import common

    monkeypatch.setattr(test_selection, "SCORES", dict.fromkeys(range(8), 0.5))
    out = str(tmp_path / "run")
    _train(monkeypatch, out, 1, 2)
    run = common.open_run(out, with_data=False, log=quiet)
    lines = []
    report = test_selection._fake_report(per_model, [])
    summary = common.analyse_loaded(report, run, str(tmp_path), lines.append)["summary"]
    assert summary["main"] is None and summary["selection"]["n"] == 0 and "failing" in summary
    assert any("n = 0 of 2 trained" in x and "no model passes" in x for x in lines)
    assert not any("main:" in x for x in lines) and any("--- beside: failing" in x for x in lines)


@pytest.mark.slow
def test_a_raised_cap_on_two_processes_equals_one_uninterrupted_process(tmp_path):
    """Slow (2-4 min on a shared 2-core machine: three CLI launches). Process 0 hands
    the others what it found (the models reused, the caps raised from) and the reused
    models: a 2-process run whose cap is raised from 2 to 4 ends equal, bit for bit, to
    one process with cap 4 on as many devices."""
    from test_multiprocess import _assert_same_run, _finish_pair, _one_process, _start_pair

    def flags(cap):
        return ("--n_pair_labels=5", "--seeds_until=1", f"--max_seeds={cap}",
                "--pass_rule=unseen_acc>=2", "--eval_every=10")  # fmt: skip

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    for cap in (2, 4):
        procs = _start_pair(two, 20, tmp_path, f"cap{cap}", flags(cap))
        codes, texts = _finish_pair(procs, tmp_path, f"cap{cap}")
        assert codes == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    assert "cap raised from 2 to 4" in texts[0] and "models 0..1: trained before" in texts[0]
    _one_process(one, 20, flags(4))
    _assert_same_run(one, two)
    assert _selection(two)["raised_from"] == [2] and _selection(two)["trained"] == 4
