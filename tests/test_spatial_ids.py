"""Spatial-ID extraction (`analysis.spatial_ids`, issue 13): a planted linear ID is
recovered, and the probe scenes are what the extraction assumes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis import spatial_ids as si
from jaxmech.data import scenes as sc
from jaxmech.families.toy_vlm import model as ar_vlm
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import cell_tokens


def test_a_planted_linear_id_is_recovered_with_its_rank():
    rng = np.random.default_rng(0)
    n_labels, L, D, Y = 6, 12, 10, 2
    feats = rng.normal(size=(L, 5))
    maps = rng.normal(size=(2, D))  # a rank-2 ID: two feature directions
    planted = feats[:, :2] @ maps  # [L, D]
    label = np.repeat(np.arange(1, n_labels + 1), L * 3)
    cell = np.tile(np.repeat(np.arange(L), 3), n_labels)
    content = rng.normal(size=(n_labels + 1, D))
    noise = 0.01 * rng.normal(size=(Y, len(label), D))
    states = (
        content[label][None] + planted[cell][None] * np.array([1.0, 2.0])[:, None, None] + noise
    )
    delta = si.spatial_ids(jnp.asarray(states), label, cell, L)
    centred = planted - planted.mean(0)
    np.testing.assert_allclose(delta[0], centred, atol=0.02)
    np.testing.assert_allclose(delta[1], 2 * centred, atol=0.04)
    r2 = si.rank_k_r2(jnp.asarray(feats), delta, (1, 2, 3))
    assert (r2[:, 1] > 0.99).all() and (r2[:, 0] < 0.95).all(), r2
    assert np.all(np.diff(np.asarray(r2), axis=1) >= -1e-6)  # more rank never fits worse


def test_grid_axes_of_a_planted_grid():
    gh, gw, D = 3, 4, 5
    h, v = np.eye(D)[0], np.eye(D)[1]
    r, c = np.divmod(np.arange(gh * gw), gw)
    delta = (c[:, None] * h + r[:, None] * v)[None]
    got_h, got_v = si.grid_axes(jnp.asarray(delta), gh, gw)
    np.testing.assert_allclose(got_h[0], h, atol=1e-6)
    np.testing.assert_allclose(got_v[0], v, atol=1e-6)


def test_probe_scenes_and_states():
    config = tiny_vlm_config(lm_n_layers=2)
    task, view = config.task, toy_view(config)
    pr = si.probe(view, range(1, task.n_labels + 1), placements=2)
    batch, label, cell = pr.inputs, pr.label_N, pr.cell_N
    N = task.n_labels * task.image_len * 2
    assert batch.labels_BxL.shape == (N, task.image_len)
    assert (batch.labels_BxL[np.arange(N), cell] == label).all()
    assert ((batch.labels_BxL > 0).sum(1) == 2).all()
    assert (batch.question_BxQ[:, sc.X_SLOT] == sc.label_token(label)).all()
    params = ar_vlm.init_params(config, jax.random.PRNGKey(0))
    states = si.word_states(view, params, batch, pr.spans.x_B)
    assert states.shape == (si.n_sites(view, params), N, config.model.d_model) == (3, N, 16)
    basis = view.position_basis(params)
    assert basis.shape == (task.image_len, 2 * config.model.d_model)


def test_analytic_ids_without_mlp_the_attention_writes_the_whole_block_id():
    """In a block without an MLP the residual gains exactly the attention's output, so
    the ID of the attention output is the block's whole ID; and the peak is a weight."""
    config = tiny_vlm_config(lm_n_layers=2, mlp=False)
    task, view = config.task, toy_view(config)
    params = ar_vlm.init_params(config, jax.random.PRNGKey(1))
    pr = si.probe(view, range(1, task.n_labels + 1), placements=2)
    label, cell, L = pr.label_N, pr.cell_N, task.image_len
    _, aux = view.forward(params, pr.inputs, capture=True)
    a = si.analytic_ids(params, aux, pr.spans.x_B, cell_tokens(pr.spans, cell), label, cell, L)
    assert a["pred"].shape == a["attn"].shape == (2, task.image_len, config.model.d_model)
    np.testing.assert_allclose(a["attn"], a["total"], atol=1e-5)
    np.testing.assert_allclose(si.id_cosine(a["attn"], a["total"]), 1.0, atol=1e-4)
    assert ((a["peak"] > 0) & (a["peak"] < 1)).all()
    ids = si.spatial_ids(si.word_states(view, params, pr.inputs, pr.spans.x_B), label, cell, L)
    np.testing.assert_allclose(a["total"].sum(0), ids[-1] - ids[0], atol=1e-5)


def test_probe_scenes_can_name_the_probed_label_as_y():
    view = toy_view(tiny_vlm_config())
    labels = range(1, view.n_labels + 1)
    bx = si.probe(view, labels, placements=2)
    by = si.probe(view, labels, placements=2, named_first=False)
    np.testing.assert_array_equal(bx.inputs.labels_BxL, by.inputs.labels_BxL)  # same scenes
    q_x, q_y = bx.inputs.question_BxQ, by.inputs.question_BxQ
    assert (q_y[:, sc.Y_SLOT] == sc.label_token(by.label_N)).all()
    np.testing.assert_array_equal(q_y[:, sc.X_SLOT], q_x[:, sc.Y_SLOT])


def test_split_half_ceiling_is_the_share_of_the_id_the_label_halves_share():
    """States = a per-cell signal + per-(label, cell) noise of known size: the ceiling
    is 1 without noise, ~|s|^2 / (|s|^2 + sigma^2 / n_labels) with it, ~0 without signal."""
    rng = np.random.default_rng(0)
    L, D, n_labels, reps = 9, 256, 40, 3
    label = np.repeat(np.arange(1, n_labels + 1), L * reps)
    cell = np.tile(np.repeat(np.arange(L), reps), n_labels)
    signal = rng.normal(size=(L, D))
    signal -= signal.mean(0)
    noise = rng.normal(size=(n_labels, L, D))  # the same for a label's repeats
    for scale, want in ((0.0, 1.0), (4.0, 1 / (1 + 16 / n_labels)), (None, 0.0)):
        s = 0.0 if scale is None else signal
        states = (s + (1.0 if scale is None else scale) * noise)[label - 1, cell][None]
        got = float(si.split_half_ceiling(jnp.asarray(states), label, cell, L)[0])
        np.testing.assert_allclose(got, want, atol=1e-5 if scale == 0.0 else 0.06)
    with pytest.raises(ValueError, match="needs >= 2 labels"):
        si.split_half_ceiling(jnp.asarray(states[:, :L]), label[:L], cell[:L], L)
