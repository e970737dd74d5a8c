"""Seeds until enough models pass a rule fixed before training (`sweep.Until`,
`--seeds_until`), and reports over the passing models (`runs.Selection`).

Training is stubbed (`_FakeTraining`: each seed's final unseen_min_acc from a table,
no compute), so these tests check the chunk loop, the selection file, resume and the
reports' grouping in a second or two each; the training itself is `test_sweep`'s."""

import json
import os
import re

import jax
import numpy as np
import pytest
from conftest import Interrupted, quiet, stop_after, tiny_vlm_config

from jaxmech import sweep
from jaxmech.config import ConfigError
from jaxmech.reports import common
from jaxmech.reports.tables import Measure
from jaxmech.stats import diff_ci
from jaxmech.sweep import SweepMismatchError, expand, run_grid, seeds_until
from jaxmech.train import TrainState, curve_fields, init_program

# each seed's final unseen_min_acc (>= 0.9 passes the default rule)
SCORES = {0: 0.95, 1: 0.5, 2: 0.3, 3: 0.99, 4: 1.0, 5: 1.0, 6: 0.2, 7: 0.1}


class _FakeTraining:
    """Stands in for `train.train_models`: the state is the init's shapes in zeros (so
    that a checkpoint restores), every curve a seed's score; records the seeds asked
    and, at the first call, what selection.json held."""

    def __init__(self, out):
        self.out, self.calls, self.selection_before = out, [], None

    def __call__(self, cfg, settings, *, data=None, state=None, n_chunks=None):
        if self.selection_before is None:
            with open(os.path.join(self.out, "selection.json")) as f:
                self.selection_before = json.load(f)
        seeds = np.asarray(settings.seed)
        self.calls.append(seeds.tolist())
        if state is None:
            like = jax.eval_shape(lambda s: init_program(s, cfg), settings)
            state = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), like)
        step = np.asarray(state.step) + n_chunks * cfg.train.eval_every
        state = TrainState(state.params, state.opt_state, step, np.full(len(seeds), -1, np.int32))
        score = np.asarray([SCORES[int(s)] for s in seeds], np.float32)[:, None]
        curves = {n: np.repeat(score, n_chunks, 1) for n in curve_fields(cfg)}
        curves["step"] = step[:, None] + cfg.train.eval_every * np.arange(1 - n_chunks, 1)
        return state, curves


def _train(monkeypatch, out, passing, cap, rule=None, log=quiet):
    """A --seeds_until run of the tiny VLM in chunks of 2 on the fake training."""
    fake = _FakeTraining(out)
    monkeypatch.setattr(sweep.runs, "train_models", fake)
    monkeypatch.setattr(sweep.runs, "build_data", lambda cfg: None)
    grid = expand(tiny_vlm_config(steps=10, eval_every=10), {}, seeds=cap)
    res = run_grid(grid, out, chunk_size=2, until=seeds_until(grid, passing, cap, rule), log=log)
    return res, fake


def _selection(out):
    with open(os.path.join(out, "selection.json")) as f:
        return json.load(f)


def test_seeds_until_stops_once_enough_pass_and_keeps_every_trained_model(monkeypatch, tmp_path):
    out = str(tmp_path / "run")
    lines = []
    res, fake = _train(monkeypatch, out, passing=2, cap=8, log=lines.append)
    assert fake.calls == [[0, 1], [2, 3]]  # seed 3 is the second to pass: no third chunk
    before = fake.selection_before  # the rule was in the folder before any model trained
    assert before["text"] == "unseen_min_acc >= 0.9" and "passing_models" not in before
    sel = _selection(out)
    assert sel["rule"] == before["rule"] and sel["trained"] == 4 and sel["seeds"] == [0, 1, 2, 3]
    assert sel["passing_models"] == [0, 3] and sel["failing_models"] == [1, 2]
    assert [r["seed"] for r in res["rows"]] == [0, 1, 2, 3] and res["selection"] == sel
    assert any("n = 2 of 4 trained pass unseen_min_acc >= 0.9" in x for x in lines)


def test_seeds_until_stops_at_the_cap_and_says_so(monkeypatch, tmp_path):
    lines = []
    res, fake = _train(monkeypatch, str(tmp_path / "run"), 3, 4, log=lines.append)
    assert fake.calls == [[0, 1], [2, 3]] and res["selection"]["passing_models"] == [0, 3]
    assert any(x.startswith("WARNING: --max_seeds=4 seeds tried and only 2 pass") for x in lines)


def test_seeds_until_resumes_and_its_rule_cannot_change(monkeypatch, tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(Interrupted):  # killed after the first chunk's checkpoint
        _train(monkeypatch, out, 2, 8, log=stop_after(1))
    assert not os.path.exists(os.path.join(out, "results.csv"))
    res, fake = _train(monkeypatch, out, 2, 8)
    assert fake.calls == [[2, 3]] and res["selection"]["passing_models"] == [0, 3]
    res, fake = _train(monkeypatch, out, 2, 8)  # finished: nothing trains
    assert fake.calls == [] and res["selection"]["passing_models"] == [0, 3]
    for passing, rule in ((3, None), (2, "unseen_min_acc>=0.5")):
        with pytest.raises(SweepMismatchError, match="its selection rule is fixed"):
            _train(monkeypatch, out, passing, 8, rule)


def _fake_report(per_model, computed):
    def compute(run):
        computed.append(run.models)
        return {"per": np.asarray(run.models)}

    def tables(res, run):
        return {"t": [{"model": int(m), "v": float(m) ** 2} for m in res["per"]]}

    return common.Report("fake", None, compute, tables, lambda res, t, run, log: {"k": run.k},
                         lambda res, t, run, path: path, "fake.png",
                         per_model=("per",) if per_model else ())  # fmt: skip


@pytest.mark.parametrize("per_model", [True, False])
def test_reports_take_the_passing_models_and_state_n_of_trained(monkeypatch, tmp_path, per_model):
    out = str(tmp_path / "run")
    _train(monkeypatch, out, 2, 8)
    run = common.open_run(out, with_data=False, log=quiet)
    assert run.selection.words() == "n = 2 of 4 trained (rule: unseen_min_acc >= 0.9; cap 8 seeds)"
    computed, lines = [], []
    report = _fake_report(per_model, computed)
    res = common.analyse_loaded(report, run, str(tmp_path), lines.append)
    summary = res["summary"]
    assert summary["main"] == "passing" and summary["selection"]["passing_models"] == [0, 3]
    assert summary["passing"] == {"k": 2} and summary["failing"] == {"k": 2}
    # per-model results are split after one call; the others are computed per group
    assert computed == ([(0, 1, 2, 3)] if per_model else [(0, 3), (1, 2)])
    groups = {(r["model"], r["model_group"]) for r in res["tables"]["t"]}
    assert groups == {(0, "passing"), (3, "passing"), (1, "failing"), (2, "failing")}
    assert "selection: n = 2 of 4 trained (rule: unseen_min_acc >= 0.9; cap 8 seeds)" in lines
    assert any("main: passing models, n = 2 of 4 trained" in x for x in lines)


@pytest.mark.parametrize("per_model", [True, False])
def test_reports_compare_their_passing_and_failing_models(monkeypatch, tmp_path, per_model):
    out = str(tmp_path / "run")
    _train(monkeypatch, out, 2, 8)  # passing 0, 3; failing 1, 2
    run = common.open_run(out, with_data=False, log=quiet)
    report = _fake_report(per_model, [])._replace(compare=(Measure("v", "t", "v"),))
    lines = []
    summary = common.analyse_loaded(report, run, str(tmp_path), lines.append)["summary"]
    with open(tmp_path / "summary.json") as f:
        written = json.load(f)["passing_vs_failing"]
    rec = summary["passing_vs_failing"]["all"]["v"]
    assert written["all"]["v"] == rec and "Welch" in written["method"]
    # v = model number squared: passing [0, 9], failing [1, 4]
    expected = diff_ci([1.0, 4.0], [0.0, 9.0])
    assert (rec["difference"], rec["ci_low"], rec["ci_high"]) == pytest.approx(expected)
    assert (rec["n_passing"], rec["n_failing"]) == (2, 2) and rec["difference"] == 2.0
    block = lines.index(next(x for x in lines if "passing - failing" in x))
    assert lines[block + 2].split()[0] == "v" and "+2.000 [" in lines[block + 2]
    # a run without its selection: no comparison
    os.remove(os.path.join(out, "selection.json"))
    plain = common.open_run(out, with_data=False, log=quiet)
    summary = common.analyse_loaded(report, plain, str(tmp_path), quiet)["summary"]
    assert "passing_vs_failing" not in summary


def test_a_run_without_selection_is_reported_as_before(monkeypatch, tmp_path):
    out = str(tmp_path / "run")
    _train(monkeypatch, out, 2, 8)
    os.remove(os.path.join(out, "selection.json"))
    run = common.open_run(out, with_data=False, log=quiet)
    assert run.selection is None
    assert [(g, i.tolist()) for g, i in common.model_groups(run)] == [
        ("generalising", [0, 3]),
        ("others", [1, 2]),
    ]
    computed = []
    summary = common.analyse_loaded(_fake_report(False, computed), run, str(tmp_path), quiet)
    assert computed == [(0, 1, 2, 3)] and summary["summary"] == {"k": 4}


def test_a_report_refuses_a_selection_changed_after_training(monkeypatch, tmp_path):
    out = str(tmp_path / "run")
    _train(monkeypatch, out, 2, 8)
    file, sel = os.path.join(out, "selection.json"), _selection(out)
    changes = {
        "its rule is not the one": {"rule": {"metric": "unseen_min_acc", "at_least": 0.5},
                                    "text": "unseen_min_acc >= 0.5"},
        "are not the ones": {"passing_models": [0, 1, 3]},
    }  # fmt: skip
    for message, change in changes.items():
        with open(file, "w") as f:
            json.dump(sel | change, f)
        with pytest.raises(ValueError, match=re.escape(message)):
            common.check_run(out)
        with pytest.raises(ValueError, match="selection.json"):
            common.open_run(out, with_data=False, log=quiet)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seeds_until=0"], "--seeds_until=0: allowed an integer >= 1"),
        (["--seeds_until=8", "--max_seeds=4"], "--max_seeds=4 is below --seeds_until=8"),
        (["--seeds_until=2", "--seeds=4"], "--seeds and --seeds_until: give one"),
        (["--max_seeds=4"], "--max_seeds is read with --seeds_until only"),
        (["--seeds_until=1", "--pass_rule=nope>=1"], "--pass_rule='nope>=1': expected METRIC"),
        (["--seeds_until=1", "--n_pair=3,5"], "n_pair_labels is swept"),
    ],
)
def test_bad_seeds_until_flags_are_refused_before_compute(tmp_path, flags, message):
    from absl import app

    from experiments import sweep as entry

    out = str(tmp_path / "never")
    try:
        entry.FLAGS([entry.__file__, f"--out={out}", *flags])
        with pytest.raises(app.UsageError, match=re.escape(message)):
            entry.main([])
    finally:
        entry.FLAGS.unparse_flags()
    assert not os.path.exists(out)


def test_the_cap_and_rule_checks_name_their_flags():
    grid = expand(tiny_vlm_config(), {}, seeds=4)
    assert seeds_until(grid, 1, 4).rule == sweep.PassRule("unseen_min_acc", 0.9)
    rule = seeds_until(grid, 1, 4, "unseen_h_acc >= 0.75").rule
    assert rule.text() == "unseen_h_acc >= 0.75"
    np.testing.assert_array_equal(rule.passes([0.75, 0.7, np.nan]), [True, False, False])
    with pytest.raises(ConfigError, match="the grid holds 4 seed"):
        seeds_until(grid, 1, 8)
    with pytest.raises(ConfigError, match="is not a number"):
        seeds_until(grid, 1, 4, "unseen_h_acc>=high")
