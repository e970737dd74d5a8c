"""Training-recipe ingredients (issue 47): each changes what it says, and its default
is a no-op. Tiny configs only; the presets' 8-seed trainings are manual (BUILD_NOTES.md,
Results, paper 003: the recipe search)."""

import functools

import jax
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.config import ConfigError, TrainConfig
from jaxmech.data.tasks import Data, get_task
from jaxmech.data.tasks.scenes import TOKEN, Y_SLOT
from jaxmech.train import curriculum_settings, stack_settings, step_batch


@functools.partial(jax.jit, static_argnames="config")
def _batch(step, settings, tables, config):
    return step_batch(step, settings, Data(tables, None), config)


def _single_share(config, step) -> float:
    """The share of single-object rows (`mid` as the second object) in a model's batch."""
    tables = get_task("scenes").build_tables(config.task)
    batch = _batch(step, config.settings(), tables, config)
    return float(np.mean(np.asarray(batch.question_BxQ)[:, Y_SLOT] == TOKEN["mid"]))


def test_curriculum_puts_single_object_questions_first_then_reaches_single_frac():
    config = tiny_vlm_config(batch_size=32, single_frac=0.25, curriculum_steps=8)
    shares = [_single_share(config, t) for t in (0, 4, 8, 12)]
    assert shares[0] == 1.0  # every row a single-object question at step 0
    assert 0.25 < shares[1] < 1.0  # half way: between the two
    assert shares[2] == shares[3] == 0.25  # from step N on: single_frac, as without it


def test_curriculum_default_is_the_same_settings_object():
    """curriculum_steps = 0 returns the settings untouched, so the default training
    program is the one compiled before the field existed."""
    settings = stack_settings([tiny_vlm_config().settings()])
    assert curriculum_settings(settings, 3, TrainConfig()) is settings
    assert TrainConfig().curriculum_steps == 0


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"curriculum_steps": -1}, "curriculum_steps"),
        ({"curriculum_steps": 1.5}, "curriculum_steps"),
        ({"curriculum_steps": 10, "epochs": 2}, "curriculum_steps"),
    ],
)
def test_curriculum_bad_values_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**overrides)


def test_label_smoothing_mixes_the_vocabulary_into_the_target_and_0_is_plain():
    from jaxmech.families.toy_vlm.loss import answer_loss, logits
    from jaxmech.families.toy_vlm.model import init_params

    config = tiny_vlm_config(batch_size=8)
    params = init_params(config, jax.random.key(0))
    tables = get_task("scenes").build_tables(config.task)
    batch = _batch(0, config.settings(), tables, config)
    loss = jax.jit(lambda c: answer_loss(params, batch, None, c.settings(), c), static_argnums=0)
    plain = float(loss(config))
    assert config.replace(label_smoothing=0.0) == config  # the default: the same program
    smooth = float(loss(config.replace(label_smoothing=0.2)))
    uniform = -float(jax.nn.log_softmax(jax.jit(logits)(params, batch), axis=-1).mean())
    np.testing.assert_allclose(smooth, 0.8 * plain + 0.2 * uniform, rtol=1e-5)
    assert abs(smooth - plain) > 1e-3
    with pytest.raises(ConfigError, match="label_smoothing"):
        config.replace(label_smoothing=-0.1)
