"""The toy VLM family (`families.toy_vlm`) on the scenes task: its objective, its
beliefs, and the training machinery (sweep, saves, resume) with no change to
train.py or sweep.py; results folders written under its old kind name still load."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_VLM, file_bytes, kill_after_first_save, quiet, tiny_vlm_config

from jaxmech import results
from jaxmech.config import Config, ConfigError
from jaxmech.data.tasks.scenes import TOKEN
from jaxmech.families import family_for
from jaxmech.families.toy_vlm.evaluate import metric_names
from jaxmech.families.toy_vlm.loss import beliefs, partner
from jaxmech.sweep import expand, run_grid
from jaxmech.train import build_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_partner_is_the_other_word_of_the_relation():
    pairs = [("left", "right"), ("right", "left"), ("above", "below"), ("below", "above")]
    got = partner(jnp.asarray([TOKEN[a] for a, _ in pairs]))
    assert got.tolist() == [TOKEN[b] for _, b in pairs]


def test_beliefs_score_against_the_other_word_and_the_whole_vocabulary():
    v = 12
    logits = np.zeros((3, v), np.float32)
    logits[0, TOKEN["left"]] = 2.0  # answer left, beats right
    logits[1, TOKEN["below"]] = 1.0  # answer above, loses to below
    logits[2, 11] = 5.0  # answer right, ties left: not correct; most mass elsewhere
    answers = jnp.asarray([TOKEN["left"], TOKEN["above"], TOKEN["right"]])
    b = beliefs(jnp.asarray(logits), answers)
    assert b["correct"].tolist() == [1.0, 0.0, 0.0]
    expected = jax.nn.softmax(jnp.asarray(logits), -1)[jnp.arange(3), answers]
    np.testing.assert_allclose(b["p"], expected, rtol=1e-6)
    np.testing.assert_allclose(b["logp"], np.log(expected), rtol=1e-5)


def test_the_family_pairs_only_with_scenes():
    assert family_for(tiny_vlm_config()).name == "toy_vlm"
    with pytest.raises(ConfigError, match="task_kind = '1d' is invalid with model_kind"):
        family_for(Config().replace(model_kind="toy_vlm"))
    with pytest.raises(ConfigError, match="task_kind = 'scenes' is invalid with model_kind"):
        family_for(Config().replace(task_kind="scenes"))
    # the toy's own fields are not the dual encoder's: refused by the config, by name
    with pytest.raises(
        ConfigError, match="lm_n_layers is not a field of model_kind = 'dual_encoder'"
    ):
        tiny_vlm_config(model_kind="dual_encoder")


def _sweep_cli(out, steps):
    """`python -m experiments.sweep` of the grid `_vlm_grid(steps)` builds in-process."""
    flags = [f"--{k}={v}" for k, v in TINY_VLM.items() if k not in ("steps", "eval_every")]
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.sweep", f"--out={out}", "--lr=1e-3,3e-3"]
        + ["--seeds=1", f"--steps={steps}", f"--eval_every={EVERY}", *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


# three saves: a kill after the first leaves two to redo; eval_every as in
# TINY_VLM, so the run reuses the compiled segment of the other tiny VLM tests
STEPS, EVERY = 30, 10


def _vlm_grid(steps):
    return expand(tiny_vlm_config(steps=steps, eval_every=EVERY), {"lr": "1e-3,3e-3"}, seeds=1)


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """Two tiny VLMs (lr 1e-3, 3e-3) trained in-process by `run_grid`: the folder."""
    grid = _vlm_grid(STEPS)
    full = str(tmp_path_factory.mktemp("vlm") / "full")
    run = run_grid(grid, full, log=quiet)
    assert [r["lr"] for r in run["rows"]] == pytest.approx([1e-3, 3e-3])
    return full


@pytest.mark.slow  # ~9 s beyond the shared run; test_sweep's kill / resume tests keep resume == uninterrupted
def test_a_vlm_sweep_resumes_after_kill_minus_9_and_loads_like_any_family(vlm_run, tmp_path):
    """The CLI sweep killed (SIGKILL) after its first save, then resumed in-process
    on the same folder, gives the uninterrupted in-process run's params bit for bit and
    its CSVs byte for byte: the CLI's flags build the same grid (a different one would be
    refused as another sweep) and its save resumes. One subprocess, not two (the
    CLI's own rerun is tested on the dual encoder, `test_sweep`); the in-process run
    compiles first, so the subprocess hits the shared XLA cache."""
    full, steps = vlm_run, STEPS
    loaded = results.load_run(full)
    assert set(metric_names(loaded.config)) <= set(loaded.results[0])
    assert all(np.isfinite(r["unseen_min_acc"]) for r in loaded.results)
    assert loaded.params["lm"]["E"].shape[0] == 2  # stacked over the two models
    part = str(tmp_path / "part")
    kill_after_first_save(_sweep_cli(part, steps), part)
    resumed = run_grid(_vlm_grid(steps), part, log=quiet)
    assert 0 < resumed["trained_steps"] < 2 * steps  # picked up from the CLI's save
    for name in ("results.csv", "curves.csv"):  # resume == uninterrupted, byte for byte
        assert file_bytes(f"{part}/{name}") == file_bytes(f"{full}/{name}"), name
    again = results.load_run(part)
    for x, y in zip(
        jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(again.params)
    ):
        np.testing.assert_array_equal(x, y)


def test_a_folder_written_with_the_old_kind_name_loads_and_is_the_same_sweep(vlm_run, tmp_path):
    """Results folders written before the toy VLM's kind was renamed ("ar_vlm" ->
    "toy_vlm") hold the old name in config.json and sweep.json: they load as the toy
    VLM, and a rerun of the same sweep finds it (finished here; an unfinished one is
    resumed through the same check) instead of refusing it as another sweep. Flags and
    specs must use the name now."""
    old = str(tmp_path / "old")
    shutil.copytree(vlm_run, old)
    for name in ("config.json", "sweep.json"):
        path = os.path.join(old, name)
        with open(path) as f:
            text = f.read()
        assert text.count('"toy_vlm"') == 1, name
        with open(path, "w") as f:
            f.write(text.replace('"toy_vlm"', '"ar_vlm"'))
    run = results.load_run(old)
    assert run.config == results.load_run(vlm_run).config and run.family.name == "toy_vlm"
    again = run_grid(_vlm_grid(STEPS), old, log=quiet)
    assert again["trained_steps"] == 0 and again["rows"] == run.results
    with pytest.raises(ConfigError, match="model_kind = 'ar_vlm' is invalid"):
        tiny_vlm_config(model_kind="ar_vlm")


def test_vlm_presets_are_valid_and_one_has_a_window_block_before_a_global_block():
    from jaxmech.presets import preset_config

    base, window = preset_config("vlm"), preset_config("vlm_window")
    assert family_for(base).name == family_for(window).name == "toy_vlm"
    m = window.model
    assert m.vit_window > 0 and m.global_blocks == (m.n_layers - 1,) and m.n_layers >= 2
    deep = preset_config("vlm_deep")
    assert deep.model.lm_n_layers > base.model.lm_n_layers and family_for(deep).name == "toy_vlm"
    assert deep.replace(lm_n_layers=base.model.lm_n_layers) == base  # depth is the only change


def test_summary_intervals_clip_accuracies_and_probabilities_only():
    """A log-probability's interval is not clipped to [0, 1] (it was: [0.000, 1.000])."""
    from jaxmech.reports.summary import metric_ci

    mean, lo, hi, n = metric_ci([-2.0, -1.0, -1.5], "unseen_h_logp")
    assert mean == pytest.approx(-1.5) and lo < -1.5 < hi < 0 and n == 3
    _, lo, hi, _ = metric_ci([0.99, 1.0, 0.9], "unseen_h_acc")
    assert 0.0 <= lo and hi == 1.0


def test_vit_terms_report_runs_and_its_no_op_row_is_the_plain_accuracy(vlm_run):
    """App. O report on a trained run: files written; the 'none' ablation (an all-ones
    mask) gives the accuracies of training's own evaluation; every term's slopes sum to
    the logits' slope (the terms sum to the logits); a dual-encoder run is refused."""
    from jaxmech.analysis.vit_terms import term_gradients, vit_logit_terms
    from jaxmech.reports.common import analyse
    from jaxmech.reports.vit_terms import ABLATIONS, REPORT, vit_terms_refusal

    out = analyse(REPORT, vlm_run, log=quiet)
    for name in (
        "gradients.csv",
        "ablations.csv",
        "summary.json",
        "gradients.png",
        "ablations.png",
    ):
        assert os.path.exists(os.path.join(vlm_run, "vit_terms", name)), name
    rows = results.load_run(vlm_run).results
    none = [r for r in out["tables"]["ablations"] if r["ablation"] == "none"]
    n = 64  # eval_size: one example of a set moves an accuracy by >= 1/64
    for row, ref in zip(none, rows):
        for m in ("unseen_h_acc", "unseen_v_acc", "seen_h_acc", "seen_v_acc"):
            assert abs(row[m] - ref[m]) <= 1.0 / n + 1e-6, (m, row[m], ref[m])
    assert len(out["tables"]["ablations"]) == 2 * len(ABLATIONS)
    run = results.load_run(vlm_run)
    p = jax.tree_util.tree_map(lambda a: a[0], run.params)
    ex = build_data(run.config).evals.unseen_pair.examples
    g = term_gradients(p, ex.labels_BxL, ex.colours_BxL, ex.facings_BxL)
    logits = vit_logit_terms(p, ex.labels_BxL, ex.colours_BxL, ex.facings_BxL)["logits"]
    w = p["static"]["cell_cols"] - p["static"]["cell_cols"].mean()
    slope = jnp.einsum("bhqk,k->bhq", logits, w / (w**2).sum())
    q = (jnp.asarray(ex.labels_BxL) > 0)[:, None, :]
    expected = (slope * q).sum((0, 2)) / q.sum((0, 2))
    np.testing.assert_allclose(g["h"].sum(0), expected, rtol=1e-3, atol=1e-5)
    assert "model_kind = 'dual_encoder'" in vit_terms_refusal(Config(), "RUN")
