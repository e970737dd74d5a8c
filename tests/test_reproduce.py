"""Long reproductions (marked slow; `python -m pytest -m slow -q`): the default config's
accuracy targets over 8 seeds and paper 000's ablation findings on them. ~5-10 min on a
2-core CPU."""

import numpy as np
import pytest

from jaxmech.analysis.ablate import ablation_table
from jaxmech.config import Config
from jaxmech.train import build_data, stack_settings, train_models

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_models():
    config = Config()
    settings = stack_settings([config.replace(seed=s).settings() for s in range(8)])
    data = build_data(config)
    state, curves = train_models(config, settings, data=data)
    return config, settings, data, state, curves


def test_default_config_reaches_the_spec_accuracies(default_models):
    _, _, _, state, curves = default_models
    final = {k: np.asarray(v)[:, -1] for k, v in curves.items()}
    assert np.all(np.asarray(state.diverged_step) < 0)
    # SPEC: unseen-pair "about 0.9 or higher". Observed per model: min 0.984 here, 0.971
    # on an earlier CPU; the mean carries the target, each model keeps a wide margin.
    assert final["unseen_acc"].mean() >= 0.9, final["unseen_acc"]
    assert np.all(final["unseen_acc"] >= 0.8), final["unseen_acc"]
    for key in ("seen_acc", "single_acc", "labelset_acc"):  # observed >= 0.993
        assert final[key].mean() >= 0.95 and np.all(final[key] >= 0.85), final[key]


def test_ep_ablation_findings(default_models):
    config, settings, data, state, curves = default_models
    names = ("none", "ep", "pe", "pp", "ep+bp")
    t = ablation_table(state.params, settings, data, names)
    unseen = {n: float(np.mean(t["unseen_acc"][:, i])) for i, n in enumerate(names)}
    assert unseen["ep+bp"] <= 0.6, unseen
    assert unseen["ep"] <= unseen["none"] - 0.1, unseen
    assert abs(unseen["pe"] - unseen["none"]) <= 0.05, unseen
    assert abs(unseen["pp"] - unseen["none"]) <= 0.05, unseen
    assert np.all(np.mean(np.asarray(t["labelset_acc"]), 0) >= 0.85), t["labelset_acc"]
