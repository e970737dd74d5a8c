"""The autoregressive VLM family on the scenes task: its objective, its beliefs, and the
training machinery (sweep, checkpoints, resume) with no change to train.py or sweep.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Interrupted, file_bytes, quiet, stop_after, tiny_vlm_config

from jaxmech import results
from jaxmech.config import Config, ConfigError
from jaxmech.data.scenes import TOKEN
from jaxmech.evaluate_answers import metric_names
from jaxmech.families import family_for
from jaxmech.models.answer import beliefs, partner
from jaxmech.sweep import expand, run_grid


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
    assert family_for(tiny_vlm_config()).name == "ar_vlm"
    with pytest.raises(ConfigError, match="task_kind = '1d' is invalid with model_kind"):
        family_for(Config().replace(model_kind="ar_vlm"))
    with pytest.raises(ConfigError, match="task_kind = 'scenes' is invalid with model_kind"):
        family_for(tiny_vlm_config(model_kind="dual_encoder"))


def test_a_vlm_sweep_trains_resumes_and_loads_like_any_family(tmp_path):
    grid = expand(tiny_vlm_config(steps=30), {"lr": "1e-3,3e-3"}, seeds=1)
    full = str(tmp_path / "full")
    run = run_grid(grid, full, log=quiet)
    assert [r["lr"] for r in run["rows"]] == pytest.approx([1e-3, 3e-3])
    loaded = results.load_run(full)
    assert set(metric_names()) <= set(loaded.results[0])
    assert all(np.isfinite(r["unseen_min_acc"]) for r in loaded.results)
    assert loaded.params["lm"]["E"].shape[0] == 2  # stacked over the two models
    part = str(tmp_path / "part")
    with pytest.raises(Interrupted):
        run_grid(grid, part, log=stop_after(1))  # step 10 of 30
    resumed = run_grid(grid, part, log=quiet)
    assert resumed["trained_steps"] == 2 * 20
    for name in ("results.csv", "curves.csv"):  # resume == uninterrupted, byte for byte
        assert file_bytes(f"{part}/{name}") == file_bytes(f"{full}/{name}"), name


def test_vlm_presets_are_valid_and_one_has_a_window_block_before_a_global_block():
    from jaxmech.presets import preset_config

    base, window = preset_config("vlm"), preset_config("vlm_window")
    assert family_for(base).name == family_for(window).name == "ar_vlm"
    m = window.model
    assert m.vit_window > 0 and m.global_blocks == (m.n_layers - 1,) and m.n_layers >= 2


def test_summary_intervals_clip_accuracies_and_probabilities_only():
    """A log-probability's interval is not clipped to [0, 1] (it was: [0.000, 1.000])."""
    from jaxmech.reports.summary import metric_ci

    mean, lo, hi, n = metric_ci([-2.0, -1.0, -1.5], "unseen_h_logp")
    assert mean == pytest.approx(-1.5) and lo < -1.5 < hi < 0 and n == 3
    _, lo, hi, _ = metric_ci([0.99, 1.0, 0.9], "unseen_h_acc")
    assert 0.0 <= lo and hi == 1.0
