"""The model-family interface: a stand-in second family trains through `train_models` and
the sweep (saves, resume, results folder) with no change to train.py or sweep.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Interrupted, stop_after, tiny_config

from jaxmech import results
from jaxmech.config import Config, ConfigError
from jaxmech.data.tasks import relations1d
from jaxmech.families import FAMILIES, TrainedFamily, get_family, register
from jaxmech.sweep import expand, run_grid
from jaxmech.train import train_models


def _probe_init(config, key):
    """A linear probe: one weight per (pixel position, pixel id, caption)."""
    t = config.task
    n_captions = relations1d.caption_tokens(t.n_labels).shape[0]
    shape = (t.image_len, t.n_labels + 2, n_captions)  # ids 0..n_labels, then CLS
    return {"W": 0.01 * jax.random.normal(key, shape)}


def _probe_logits(params, images_BxL):
    positions_L = jnp.arange(images_BxL.shape[1])
    return params["W"][positions_L, images_BxL].sum(1)  # [B, C]


def _probe_loss(params, batch, tables, settings, config):
    del tables, settings, config
    logp_BxC = jax.nn.log_softmax(_probe_logits(params, batch.images_BxL))
    return -jnp.take_along_axis(logp_BxC, batch.caption_ids_B[:, None], 1).mean()


def _probe_evaluate(params, evals, tables, settings, config):
    del tables, settings, config
    logits_IxC = _probe_logits(params, jnp.asarray(evals.unseen_images))
    logits_NxC = logits_IxC[jnp.asarray(evals.unseen_index)]
    true_N = jnp.take_along_axis(logits_NxC, jnp.asarray(evals.unseen_true[:, :1]), 1)
    swap_N = jnp.take_along_axis(logits_NxC, jnp.asarray(evals.unseen_swap[:, :1]), 1)
    return {"probe_acc": (true_N > swap_N).astype(jnp.float32).mean()}


PROBE = TrainedFamily(
    name="test_probe",
    init_params=_probe_init,
    loss=_probe_loss,
    evaluate=_probe_evaluate,
    metrics=lambda config: ("probe_acc",),
    task_kinds=("1d",),
)


@pytest.fixture(scope="module")
def probe_config():
    register(PROBE)
    yield Config().replace(
        model_kind="test_probe",
        n_labels=8,
        n_val_labels=3,
        n_pair_labels=5,
        image_len=6,
        layouts_per_pair=5,
        batch_size=32,
        steps=60,
        eval_every=20,
        lr=3e-2,
    )
    FAMILIES.pop("test_probe")


def test_stand_in_family_trains_through_train_models(probe_config):
    settings = expand(probe_config, {"lr": "3e-2,1e-1"}, seeds=1).settings
    from jaxmech.train import stack_settings

    state, curves = train_models(probe_config, stack_settings(list(settings)))
    assert set(curves) >= {"probe_acc", "loss", "grad_norm", "param_norm", "step"}
    assert curves["loss"].shape == (2, 3)
    assert np.all(curves["loss"][:, -1] < curves["loss"][:, 0])  # it learns
    assert state.params["W"].shape[0] == 2


def test_stand_in_family_sweeps_saves_and_resumes(probe_config, tmp_path):
    grid = expand(probe_config, {"lr": "3e-2,1e-1"}, seeds=2)
    full = run_grid(grid, str(tmp_path / "full"), chunk_size=2, log=lambda *_: None)
    part = str(tmp_path / "part")
    with pytest.raises(Interrupted):
        run_grid(grid, part, chunk_size=2, log=stop_after(2))  # mid first chunk
    resumed = run_grid(grid, part, chunk_size=2, log=lambda *_: None)
    assert resumed["trained_steps"] < full["trained_steps"]
    assert [r["probe_acc"] for r in resumed["rows"]] == [r["probe_acc"] for r in full["rows"]]
    run = results.load_run(part)
    np.testing.assert_array_equal(
        run.params["W"], results.load_run(str(tmp_path / "full")).params["W"]
    )
    assert "unseen_acc" not in run.results[0]


def test_unknown_family_and_task_pairing_fail_before_compute(probe_config):
    with pytest.raises(ConfigError, match="model_kind = 'nope'"):
        expand(Config().replace(model_kind="nope"), {}, seeds=1)
    with pytest.raises(ConfigError, match="task_kind = '2d' is invalid with model_kind"):
        expand(probe_config.replace(task_kind="2d"), {}, seeds=1)
    assert get_family("dual_encoder").progress_metric == "unseen_acc"


def test_dual_encoder_completes_params_saved_before_static_existed():
    from jaxmech.families.dual_encoder.model import init_params, static_params

    config = tiny_config(causal_text=False)
    one = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    stacked = jax.tree_util.tree_map(lambda x: np.stack([x, x]), one)
    old = {k: v for k, v in stacked.items() if k != "static"}
    done = get_family("dual_encoder").complete_params(old, config)
    for name, value in static_params(config).items():
        np.testing.assert_array_equal(done["static"][name], np.full(2, value, np.float32))
    assert done["static"]["causal_text"].tolist() == [0.0, 0.0]
    assert get_family("dual_encoder").complete_params(stacked, config) is stacked


def test_a_stand_in_family_has_the_config_it_registers(probe_config):
    from jaxmech.config import ModelConfig

    # registered without a config class: its config is the bare ModelConfig
    assert type(probe_config.model) is ModelConfig
    with pytest.raises(ConfigError, match="d_model is not a field of model_kind = 'test_probe'"):
        probe_config.replace(d_model=16)
    with pytest.raises(ConfigError, match="vision_pos is not a field of model_kind = 'toy_vlm'"):
        expand(
            Config().replace(model_kind="toy_vlm", task_kind="scenes"),
            {"vision_pos": "rope"},
            seeds=1,
        )
