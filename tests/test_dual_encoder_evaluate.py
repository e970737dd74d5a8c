"""evaluate: one path for every task kind's grouped sets, and strict inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from jaxmech.config import Config, Settings
from jaxmech.data.tasks import relations1d as r1
from jaxmech.data.tasks import relations2d as r2
from jaxmech.data.tasks.grouped import GroupedEvalSets, seen_mask
from jaxmech.families.dual_encoder.evaluate import METRICS, evaluate
from jaxmech.families.dual_encoder.model import encode_images, encode_texts, init_params
from jaxmech.train import stack_settings

CFG = Config.from_flat(TINY)


@pytest.fixture(scope="module")
def line():
    """A tiny 1D model with two seeds' params [K=2], its settings and its data."""
    tables = r1.build_tables(CFG.task)
    evals = r1.build_eval_sets(CFG.task, tables)
    init = jax.jit(init_params, static_argnums=0)
    params_K = stack_params([init(CFG, jax.random.PRNGKey(k)) for k in (3, 4)])
    settings = [CFG.settings(), CFG.replace(n_pair_labels=3, layouts_per_pair=2).settings()]
    return params_K, settings, tables, evals


def stack_params(params_list):
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *params_list)


def _model(params_K, k):
    return jax.tree_util.tree_map(lambda x: x[k], params_K)


@jax.jit
def _embed_images(params, images_IxL):
    return encode_images(params, images_IxL, readout_only=True)[0]


@jax.jit
def _embed_texts(params, captions_CxT):
    return encode_texts(params, captions_CxT, readout_only=True)[0]


def _reference(params, evals, captions, settings):
    """The 1D accuracies as plain fractions of rows, from the towers' embeddings."""
    txt = np.asarray(_embed_texts(params, jnp.asarray(captions)))
    sets = ("single", "seen", "unseen")
    images = np.concatenate([getattr(evals, f"{s}_images") for s in sets])
    img = np.split(
        np.asarray(_embed_images(params, jnp.asarray(images))),
        np.cumsum([len(getattr(evals, f"{s}_images")) for s in sets[:2]]),
    )
    img = dict(zip(sets, img))

    def wins(img, true, swap):
        return (
            np.einsum("nz,nfz->nf", img, txt[true]) > np.einsum("nz,nfz->nf", img, txt[swap])
        ).mean(-1)

    mask = np.asarray(seen_mask(evals, settings))
    return {
        "single_acc": wins(img["single"], evals.single_true, evals.single_swap).mean(),
        "seen_acc": wins(img["seen"], evals.seen_true, evals.seen_swap)[mask].mean(),
        "unseen_acc": wins(img["unseen"], evals.unseen_true, evals.unseen_swap).mean(),
        "labelset_acc": wins(
            img["unseen"], evals.labelset_true[:, None], evals.labelset_false[:, None]
        ).mean(),
    }


def _one_model_eval(evals, captions):
    return jax.jit(lambda p, s: evaluate(p, evals, captions, s))


def test_line_metrics_are_the_fractions_of_rows_won(line):
    params_K, settings, tables, evals = line
    fn = _one_model_eval(evals, tables.captions)
    for k in range(2):
        params = _model(params_K, k)
        got = fn(params, settings[k])
        assert set(got) == set(METRICS)  # the 1D sets add no per-group metric
        want = _reference(params, evals, tables.captions, settings[k])
        for m in METRICS:
            # a fraction k/N: one row more or less would move it by >= 1/N >> 1e-6
            np.testing.assert_allclose(got[m], want[m], rtol=0, atol=1e-6, err_msg=m)
    # the two models' seen-pair sets differ (settings decide them)
    assert seen_mask(evals, settings[0]).sum() != seen_mask(evals, settings[1]).sum()


def test_vmapped_over_models_equals_a_loop(line):
    params_K, settings, tables, evals = line
    fn = jax.jit(jax.vmap(lambda p, s: evaluate(p, evals, tables.captions, s)))
    out = fn(params_K, stack_settings(settings))
    one = _one_model_eval(evals, tables.captions)
    for k in range(2):
        want = one(_model(params_K, k), settings[k])
        for m in METRICS:
            np.testing.assert_allclose(out[m][k], want[m], rtol=0, atol=1e-6, err_msg=m)


def test_stacked_settings_without_vmap_name_settings(line):
    params_K, settings, tables, evals = line
    stacked = stack_settings(settings)
    with pytest.raises(ValueError, match=r"settings\.\w+ has shape \(2,\).*vmap"):
        evaluate(_model(params_K, 0), evals, tables.captions, stacked)
    # also under jit (shapes are static there)
    fn = jax.jit(lambda p, s: evaluate(p, evals, tables.captions, s))
    with pytest.raises(ValueError, match=r"settings\.\w+ has shape \(2,\)"):
        fn(_model(params_K, 0), stacked)
    with pytest.raises(ValueError, match="settings is a dict: expected a config.Settings"):
        evaluate(_model(params_K, 0), evals, tables.captions, settings[0]._asdict())


def test_evals_must_be_grouped_sets(line):
    params_K, settings, tables, evals = line
    as_tuple = tuple(evals)
    with pytest.raises(ValueError, match="evals is a tuple: expected a data.tasks.grouped"):
        evaluate(_model(params_K, 0), as_tuple, tables.captions, settings[0])
    assert isinstance(evals, GroupedEvalSets)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda c: c[0], r"captions_CxT has shape \(9,\): expected an int \[C, T\]"),
        (lambda c: c[None], r"captions_CxT has shape \(1, \d+, 9\)"),
        (lambda c: c.astype(np.float32), "captions_CxT has dtype float32: expected int"),
        # a table too short for the eval sets' caption ids (another task's table)
        (
            lambda c: c[:10],
            r"evals.single_true has caption ids in \[\d+, \d+\]: expected ids in \[0, 9\]",
        ),
    ],
)
def test_bad_caption_tables_name_captions(line, bad, match):
    params_K, settings, tables, evals = line
    with pytest.raises(ValueError, match=match):
        evaluate(_model(params_K, 0), evals, bad(np.asarray(tables.captions)), settings[0])


def test_evals_of_another_task_are_refused(line):
    params_K, settings, tables, _ = line
    task2 = CFG.replace(task_kind="2d").task  # a 4 x 4 grid: 16 pixels
    evals2 = r2.build_eval_sets(task2, r2.build_tables(task2))
    # the 2D caption ids run past the 1D table: a gather would silently clamp them
    with pytest.raises(ValueError, match=r"evals\.\w+ has caption ids .*same task"):
        evaluate(_model(params_K, 0), evals2, tables.captions, settings[0])


def test_settings_fields_must_be_scalars_under_vmap_too(line):
    params_K, settings, tables, evals = line
    # vmapping params but not a stacked settings leaves [K] settings inside: refused
    stacked = stack_settings(settings)
    fn = jax.vmap(lambda p: evaluate(p, evals, tables.captions, stacked))
    with pytest.raises(ValueError, match=r"settings\.\w+ has shape \(2,\)"):
        fn(params_K)
    assert isinstance(stacked, Settings)


def test_per_group_metrics_are_means_over_each_groups_rows():
    from jaxmech.families.dual_encoder.evaluate import _accuracies

    rng = np.random.default_rng(0)
    wins = {
        s: jnp.asarray(rng.integers(0, 3, 40) / 2, jnp.float32)
        for s in r2.GridEvalSets.GROUPED_SETS
    }
    group = {s: jnp.asarray(rng.integers(0, 2, 40)) for s in wins}
    seen = jnp.asarray(rng.random(40) < 0.5, jnp.float32)
    out = _accuracies(wins, group, seen, r2.GridEvalSets)
    w, g = {s: np.asarray(v) for s, v in wins.items()}, {s: np.asarray(v) for s, v in group.items()}
    rows = {s: np.ones(40, bool) for s in w} | {"seen": np.asarray(seen) > 0}
    for s in w:
        np.testing.assert_allclose(out[f"{s}_acc"], w[s][rows[s]].mean(), rtol=1e-6)
        for i, name in enumerate(r2.RELATIONS):
            want = w[s][rows[s] & (g[s] == i)].mean()
            np.testing.assert_allclose(out[f"{s}_{name}_acc"], want, rtol=1e-6)
    # the 1D sets split nothing: the four metrics only
    assert set(_accuracies(wins, group, seen, r1.LineEvalSets)) == set(METRICS)
