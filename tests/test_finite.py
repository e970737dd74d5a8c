"""Finite training sets iterated in epochs (`epochs > 0`): order, budgets, sweeps."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY as SHARED_TINY

from jaxmech import results
from jaxmech.config import Config, ConfigError
from jaxmech.data.tasks.relations1d import finite_order, pair_left, pair_right, sample_batch
from jaxmech.sweep import expand, run_grid
from jaxmech.train import build_data, stack_settings, step_budget, train_models

TINY = dict(SHARED_TINY, n_pair_labels=4, layouts_per_pair=3)


@pytest.mark.parametrize("n", [1, 7, 64, 3150])
def test_every_epoch_visits_each_item_once(n):
    order = np.asarray(finite_order(jax.random.key(3), jnp.arange(3 * n), n))
    for e in range(3):
        assert sorted(order[e * n : (e + 1) * n]) == list(range(n))
    if n >= 64:  # epochs are shuffled differently, and not the identity
        assert not np.array_equal(order[:n], order[n : 2 * n])
        assert not np.array_equal(order[:n], np.arange(n))


def test_order_depends_on_position_not_on_batching():
    """The item at stream position s is the same whether asked alone or in a batch."""
    key, n = jax.random.key(5), 37
    whole = np.asarray(finite_order(key, jnp.arange(200), n))
    parts = [np.asarray(finite_order(key, jnp.arange(a, a + 13), n)) for a in range(0, 195, 13)]
    np.testing.assert_array_equal(np.concatenate(parts), whole[:195])


def _batches(config, steps, seed_key=7):
    data = build_data(config)
    s = config.settings()
    fn = jax.jit(
        lambda t: sample_batch(
            data.tables,
            jax.random.fold_in(jax.random.key(0), t),
            s,
            config.task,
            config.train.batch_size,
            finite=True,
            step=t,
            order_key=jax.random.key(seed_key),
        )
    )
    return [tuple(np.asarray(a) for a in fn(t)) for t in range(steps)]


@pytest.mark.parametrize("mode", ["left", "left_right"])
def test_finite_batches_cover_the_training_set_in_epochs(mode):
    config = Config().replace(caption_mode=mode, epochs=2, **TINY)
    B = config.train.batch_size
    n_single = round(config.task.single_frac * B)
    n_two = 4 * 3 * 3  # ordered pairs of 4 labels x 3 layouts
    steps = int(step_budget(config.settings(), config))
    assert steps == -(-2 * n_two // (B - n_single))
    batches = _batches(config, steps)
    images = np.concatenate([im[n_single:] for im, _ in batches])[: 2 * n_two]
    caps = np.concatenate([c[n_single:] for _, c in batches])[: 2 * n_two]
    seen = Counter(map(bytes, images.astype(np.int8)))
    assert len(seen) == n_two and set(seen.values()) == {2}  # every item twice
    # every image holds a training pair (labels <= 4) at one of its training layouts
    data = build_data(config)
    for img in images:
        (px, py) = np.flatnonzero(img)
        x, y = img[px], img[py]
        assert 1 <= x <= 4 and 1 <= y <= 4 and x != y
        layout = data.tables.pair_perm[x, y, :3]
        assert (px, py) in {tuple(data.tables.layouts[j]) for j in layout}
    # one fixed caption per item (a dataset), and both forms occur in left_right mode
    cap_of = {}
    for img, c in zip(map(bytes, images.astype(np.int8)), caps):
        assert cap_of.setdefault(img, c) == c
    n = config.task.n_labels
    lefts = {int(pair_left(n, x, y)) for x in range(1, 5) for y in range(1, 5) if x != y}
    rights = {int(pair_right(n, y, x)) for x in range(1, 5) for y in range(1, 5) if x != y}
    kinds = {("left" if int(c) in lefts else "right" if int(c) in rights else "?") for c in caps}
    assert "?" not in kinds
    assert kinds == ({"left"} if mode == "left" else {"left", "right"})


def test_step_budget_follows_epochs_and_set_size():
    config = Config().replace(epochs=60)
    budgets = [
        int(step_budget(config.replace(n_pair_labels=p).settings(), config)) for p in (5, 10, 15)
    ]
    # 60 epochs over N(N-1)*15 pair items, 128 pair samples per batch
    assert budgets == [-(-60 * p * (p - 1) * 15 // 128) for p in (5, 10, 15)]
    assert int(step_budget(Config().settings(), Config())) == 1500  # streaming: steps


def test_model_is_frozen_after_its_budget():
    config = Config().replace(epochs=1, steps=20, eval_every=10, **TINY)
    settings = stack_settings([config.replace(seed=0, n_pair_labels=p).settings() for p in (3, 5)])
    budgets = np.asarray(step_budget(settings, config))
    assert budgets.tolist() == [-(-1 * 18 // 8), -(-1 * 60 // 8)]  # 3 and 8 steps
    mid, _ = train_models(config, settings, n_chunks=1)  # 10 steps
    end, _ = train_models(config, settings, state=mid, n_chunks=1)  # 20 steps
    for a, b in zip(jax.tree_util.tree_leaves(mid.params), jax.tree_util.tree_leaves(end.params)):
        np.testing.assert_array_equal(a, b)  # both budgets (3, 8) were spent by step 10
    # the optimiser counted only the budget's steps
    counts = [x for x in jax.tree_util.tree_leaves(end.opt_state) if x.dtype == jnp.int32]
    assert all(np.asarray(c).tolist() == budgets.tolist() for c in counts)


def test_finite_sweep_derives_steps_stops_early_and_records_steps(tmp_path):
    config = Config().replace(eval_every=10, **TINY)
    grid = expand(config, {"n_pair": "3,5", "epochs": "2"}, seeds=2)
    # budgets: 2*6*3/8 -> 5 and 2*20*3/8 -> 15; steps = 20 (a multiple of eval_every)
    assert grid.config.train.steps == 20 and grid.config.train.epochs == 2
    lines = []
    # chunks of 2 (the program of test_model_is_frozen_after_its_budget): (3, 3), (5, 5)
    out = run_grid(grid, str(tmp_path / "run"), chunk_size=2, log=lines.append)
    assert [r["steps_trained"] for r in out["rows"]] == [5, 5, 15, 15]
    assert any("chunk 1/2: every model's budget done at step 10" in line for line in lines)
    assert not any("chunk 2/2: every model's budget done" in line for line in lines)
    run = results.load_run(str(tmp_path / "run"))
    first = [r for r in run.curves if r["model"] == 0]
    assert [r["step"] for r in first] == [10, 20]
    assert first[0]["unseen_acc"] == first[-1]["unseen_acc"]  # frozen: copied evaluation


@pytest.mark.parametrize(
    "specs, match",
    [
        ({"epochs": "0,3"}, "mixes 0"),
        ({"epochs": "3", "steps": "500"}, "--steps and --epochs"),
        ({"epochs": "-1"}, "epochs"),
        ({"epochs": "2", "single_frac": "1.0"}, "single_frac"),
    ],
)
def test_bad_finite_specs_fail_clearly(specs, match):
    with pytest.raises(ConfigError, match=match):
        expand(Config().replace(**TINY), specs, seeds=1)


def test_streaming_config_refuses_finite_settings():
    config = Config().replace(steps=10, eval_every=10, **TINY)
    settings = stack_settings([config.replace(epochs=2).settings()])
    with pytest.raises(ValueError, match="epochs"):
        train_models(config, settings)
