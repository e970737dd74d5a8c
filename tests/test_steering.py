"""Steering with spatial IDs (`analysis.steering`, `reports.steering`)
and the small statistics it and the diagnostics use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis import steering as st
from jaxmech.data import scenes as sc
from jaxmech.families.toy_vlm import model as ar_vlm
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import examples
from jaxmech.models.edits import Edits
from jaxmech.reports import steering as report
from jaxmech.stats import correlation_ci, mann_whitney_u


@pytest.fixture(scope="module")
def model_and_set():
    config = tiny_vlm_config(lm_n_layers=2)
    params = ar_vlm.init_params(config, jax.random.PRNGKey(5))
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    view = toy_view(config)
    return config, params, view, examples(view, sc.eval_specs(config.task, s)["examples"])


def test_steering_with_a_zero_vector_is_a_no_op(model_and_set):
    config, params, view, ex = model_and_set
    B, D = ex.answer_B.shape[0], config.model.d_model
    plain, _ = view.forward(params, ex.inputs)
    steered = st.steered_logits(view, params, ex.inputs, ex.spans, 1, jnp.zeros((B, D)))
    np.testing.assert_array_equal(steered, plain)  # eager: x + 0 is x
    # and alpha 0 leaves every margin, the ID's and the controls', at the plain one
    delta = jax.random.normal(jax.random.PRNGKey(0), (view.grid.cells, D))
    cells = jnp.asarray(ex.spec.cells_BxK[:, 0])
    run = lambda p, d, c, a, k: st.flip_margins(view, p, ex, 1, d, c, (c + 1) % 9, a, k)  # noqa: E731
    out = jax.jit(run)(params, delta, cells, jnp.asarray([0.0, 1.0]), jax.random.PRNGKey(1))
    for kind in st.KINDS:
        np.testing.assert_allclose(out[kind][0], out["plain"], atol=1e-5)
        assert np.abs(np.asarray(out[kind][1] - out["plain"])).max() > 1e-4  # alpha 1 moves
    assert float(jnp.abs(out["rel_norm"][0]).max()) == 0.0


def test_the_vector_lands_on_the_object_word_only(model_and_set):
    config, params, view, ex = model_and_set
    B, D = ex.answer_B.shape[0], config.model.d_model
    v = jax.random.normal(jax.random.PRNGKey(2), (B, D))
    added = st.at_word(v, ex.spans.x_B, ex.spans.length)
    assert added.shape == (B, 9 + sc.Q_LEN, D)
    np.testing.assert_array_equal(added[:, 9 + sc.X_SLOT], v)
    assert float(jnp.abs(added).sum()) == pytest.approx(float(jnp.abs(v).sum()), rel=1e-6)
    # at the site, the edited residual is the plain one plus v at X's word
    _, aux = view.forward(params, ex.inputs, capture=True)
    edits = Edits(add={"lm/resid_pre.1": added})
    _, aux_steered = view.forward(params, ex.inputs, edits, capture=True)
    np.testing.assert_allclose(
        aux_steered["lm/resid_pre.1"], aux["lm/resid_pre.1"] + added, atol=1e-6
    )


def test_the_controls_match_norms_and_the_orthogonal_one_avoids_the_id_span():
    rng = np.random.default_rng(0)
    D, L = 12, 9
    delta = jnp.asarray(rng.normal(size=(L, 3)) @ rng.normal(size=(3, D)))  # rank 3
    P = st.id_span_projector(delta, energy=0.999)
    np.testing.assert_allclose(P @ P, P, atol=1e-5)
    np.testing.assert_allclose(P, P.T, atol=1e-6)
    np.testing.assert_allclose(delta @ P, delta, atol=1e-4)  # the ID lies in the span
    assert float(jnp.trace(P)) == pytest.approx(3.0, abs=1e-4)
    like = jnp.asarray(rng.normal(size=(50, D)))
    for proj in (None, P):
        z = st.matched_noise(jax.random.PRNGKey(0), like, proj)
        np.testing.assert_allclose(
            jnp.linalg.norm(z, axis=-1), jnp.linalg.norm(like, axis=-1), rtol=1e-5
        )
    orth = st.matched_noise(jax.random.PRNGKey(0), like, P)
    assert float(jnp.abs(orth @ delta.T).max()) < 1e-3 * float(jnp.abs(like @ delta.T).max())


def test_adversarial_targets_cross_to_the_far_edge_beyond_y():
    # 4 x 4 grid; cells row-major: (row, col) -> 4 row + col
    cells = np.array([[5, 7, -1], [14, 3, -1], [6, 4, -1], [1, 13, -1]])
    relation = np.array([0, 1, 0, 1])
    got = st.adversarial_targets(cells, relation, 4, 4)
    # X (1,1) left of Y (1,3): to (1,3); X (3,2) below Y (0,3): to row 0, col 2;
    # X (1,2) right of Y (1,0): to (1,0); X (0,1) above Y (3,1): to row 3, col 1
    assert got.tolist() == [7, 2, 4, 13]


def test_flip_rates_count_flips_among_answers_right_before():
    plain = np.array([[[1.0, 1.0, -1.0, 2.0]]])  # [K=1, Y'=1, B=4]
    res = {
        "relation": np.array([0, 0, 0, 1]),
        "flips": {
            "plain": plain,
            "id": np.array([[[[-1.0, 1.0, -2.0, -1.0]]]]),  # [K, Y', A=1, B]
            "noise": np.array([[[[1.0, 1.0, -2.0, 1.0]]]]),
            "orthogonal": np.array([[[[1.0, -1.0, 1.0, 1.0]]]]),
            "rel_norm": np.array([[[[0.5, 1.5, 9.0, 2.0]]]]),
        },
    }
    fr = st.flip_rates(res)
    assert fr[("n", "horizontal")].tolist() == [[2]] and fr[("n", "vertical")].tolist() == [[1]]
    assert fr[("id", "horizontal")][0, 0, 0] == 0.5 and fr[("id", "vertical")][0, 0, 0] == 1.0
    assert fr[("noise", "horizontal")][0, 0, 0] == 0.0
    assert fr[("orthogonal", "horizontal")][0, 0, 0] == 0.5
    assert fr[("rel_norm", "horizontal")][0, 0, 0] == 1.0  # the wrong example is left out


def test_the_authors_protocol_arithmetic_on_hand_made_numbers():
    """5 x the token's norm along the unit ID difference; a flip is any sign change over
    all examples (a wrong answer turned right counts); the top-3-site mean reads the
    controls at the ID's best sites."""
    delta = jnp.asarray([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])  # [L=3, D=2]
    v = st.authors_vectors(
        delta, jnp.asarray([0, 2]), jnp.asarray([1, 0]), jnp.asarray([2.0, 1.0]), 5.0
    )
    np.testing.assert_allclose(
        v, [[6.0, 8.0], [0.0, -5.0]], atol=1e-6
    )  # 10 x (0.6, 0.8); 5 x (0, -1)
    res = {
        "relation": np.array([0, 0, 0, 1]),
        "authors": {  # [K=1, Y'=4, B=4]
            "plain": np.tile([[1.0, -1.0, 2.0, 1.0]], (1, 4, 1)),
            "id": np.array([[[-1.0, 1.0, 2.0, 1.0], [-1.0, -1.0, 2.0, 1.0], [1.0, -1.0, 2.0, 1.0], [-1.0, 1.0, -2.0, -1.0]]]),
            "noise": np.array([[[1.0, -1.0, 2.0, 1.0], [1.0, 1.0, 2.0, 1.0], [-1.0, 1.0, -2.0, 1.0], [1.0, -1.0, 2.0, 1.0]]]),
            "orthogonal": np.tile([[1.0, -1.0, 2.0, 1.0]], (1, 4, 1)),
        },
    }  # fmt: skip
    ar = st.authors_flip_rates(res)
    np.testing.assert_allclose(ar[("id", "horizontal")], [[2 / 3, 1 / 3, 0.0, 1.0]])
    np.testing.assert_allclose(ar[("noise", "horizontal")], [[0.0, 1 / 3, 1.0, 0.0]])
    top = ar[("top", "horizontal")]  # the best 3 ID sites: 3, 0, 1
    np.testing.assert_allclose(
        [top["id"][0], top["noise"][0], top["orthogonal"][0]], [2 / 3, 1 / 9, 0.0]
    )
    assert ar[("id", "vertical")][0].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_the_authors_steering_is_a_no_op_at_scale_zero_and_acts_at_five(model_and_set):
    """Scale 0 adds zeros to both words (a no-op); 5 x their norms changes the margins."""
    config, params, view, ex = model_and_set
    delta = jax.random.normal(jax.random.PRNGKey(0), (config.task.image_len, config.model.d_model))
    src = jnp.asarray(ex.spec.cells_BxK)[:, 0]
    tgt = (src + 1) % config.task.image_len
    run = jax.jit(
        lambda s: st.authors_margins(view, params, ex, 1, delta, src, tgt, s, jax.random.PRNGKey(1))
    )
    zero, five = run(0.0), run(5.0)
    np.testing.assert_allclose(zero["id"], zero["plain"], atol=1e-5)
    assert np.abs(np.asarray(five["id"] - five["plain"])).max() > 1e-3


def test_steering_refuses_a_one_block_lm(tmp_path):
    config = tiny_vlm_config()
    assert "lm_n_layers" in report.steering_refusal(config, "RUN")
    assert report.steering_refusal(tiny_vlm_config(lm_n_layers=2), "RUN") is None


def test_correlation_ci():
    rng = np.random.default_rng(0)
    x = rng.normal(size=30)
    y = 0.5 * x + rng.normal(size=30)
    r, lo, hi, n = correlation_ci(x, y)
    assert n == 30 and r == pytest.approx(np.corrcoef(x, y)[0, 1]) and lo < r < hi
    assert correlation_ci(x, np.exp(2 * x), rank=True)[0] == pytest.approx(1.0)  # monotone
    assert correlation_ci(x, np.exp(2 * x))[0] < 0.99  # Pearson is not rank-based
    assert np.isnan(correlation_ci(x, np.ones(30))[0])  # a constant side
    assert np.isnan(correlation_ci([1, 2, 3], [1, 3, 2])[1])  # too few pairs for an interval


def test_mann_whitney_u():
    u, p = mann_whitney_u([1, 2, 3], [4, 5, 6])
    assert u == 0.0 and p == pytest.approx(0.0809, abs=5e-4)  # normal approx., continuity
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=40), rng.normal(size=35) + 0.3
    a[3] = b[5]  # a tie
    brute = sum(float(x > y) + 0.5 * float(x == y) for x in a for y in b)
    assert mann_whitney_u(a, b)[0] == pytest.approx(brute)
    assert mann_whitney_u(rng.normal(size=200), rng.normal(size=200) + 1.0)[1] < 1e-6
