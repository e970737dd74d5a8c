"""Spatial-ID extraction (`analysis.spatial_ids`): a planted linear ID is
recovered, and the probe scenes are what the extraction assumes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis import spatial_ids as si
from jaxmech.data.tasks import scenes as sc
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import Spans, cell_tokens


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
    params = toy_vlm.init_params(config, jax.random.PRNGKey(0))
    states = si.word_states(view, params, batch, pr.spans.x_B)
    assert states.shape == (si.n_sites(view, params), N, config.model.d_model) == (3, N, 16)
    basis = view.position_basis(params)
    assert basis.shape == (task.image_len, 2 * config.model.d_model)


def test_analytic_ids_without_mlp_the_attention_writes_the_whole_block_id():
    """In a block without an MLP the residual gains exactly the attention's output, so
    the ID of the attention output is the block's whole ID; and the peak is a weight."""
    config = tiny_vlm_config(lm_n_layers=2, mlp=False)
    task, view = config.task, toy_view(config)
    params = toy_vlm.init_params(config, jax.random.PRNGKey(1))
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


def _two_cell_probe():
    """A hand-made probe run: 8 image tokens in a 2 x 4 token grid, two cells
    of 2 x 2 tokens (`cell_I` row-major, so a cell's tokens are not contiguous), each
    cell's first token background (value 0), the others carrying a per-cell value; one
    LM block, the object word at position 0, the image at 1..8."""
    rng = np.random.default_rng(0)
    cell_I = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int32)
    label = np.repeat([1, 2], 4)
    cell = np.tile(np.repeat([0, 1], 2), 2)
    N, S, D, Dh = len(label), 9, 3, 2
    spans = Spans(np.tile(np.arange(1, 9, dtype=np.int32), (N, 1)), np.zeros((8, 3), np.int32),
                  cell_I, np.zeros(N, np.int32), np.zeros(N, np.int32),
                  np.zeros((N, S), bool), np.zeros(N, np.int32))  # fmt: skip
    signal = rng.normal(size=(2, Dh))  # per cell
    v = np.zeros((N, S, 1, Dh), np.float32)
    for n in range(N):
        own = np.flatnonzero(cell_I == cell[n])
        v[n, 1 + own[1:], 0] = signal[cell[n]] + label[n]  # own[0]: the background token
    logits = rng.normal(size=(N, 1, S, S))
    pattern = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    aux = {"lm/v.0": v, "lm/pattern.0": pattern.astype(np.float32)}
    for k in ("lm/resid_pre.0", "lm/resid_post.0", "lm/attn_out.0"):
        aux[k] = rng.normal(size=(N, S, D)).astype(np.float32)
    params = {"lm": {"block_0": {"W_O": rng.normal(size=(1, Dh, D)).astype(np.float32)}}}
    return spans, aux, params, label, cell, signal


def test_a_cells_value_is_the_mean_over_all_its_tokens_not_its_first():
    """At 448 px a Qwen cell is 4 x 4 merged tokens and its first mostly background:
    `cell_tokens` gives every token of the cell, the reduced probe run averages the
    values over them and sums the attention on them, and the analytic ID is the
    cell's mean value's (the first token's alone would be 0 here)."""
    spans, aux, params, label, cell, signal = _two_cell_probe()
    token = np.asarray(cell_tokens(spans, cell))
    assert token.shape == (8, 4)
    np.testing.assert_array_equal(token[cell == 1][0], [3, 4, 7, 8])
    red = si.at_two_positions(aux, spans.x_B, token, n_blocks=1)
    want_v = np.stack([aux["lm/v.0"][n, token[n]].mean(0) for n in range(8)])
    np.testing.assert_allclose(red["lm/v.0"][:, 1], want_v, atol=1e-6)
    mass = np.stack([aux["lm/pattern.0"][n, :, 0, token[n]].sum(0) for n in range(8)])
    np.testing.assert_allclose(red["lm/pattern.0"][:, :, 0, 1], mass, atol=1e-6)
    assert (np.asarray(red["lm/pattern.0"]).sum(-1) <= 1 + 1e-6).all()  # still weights
    full = si.analytic_ids(params, aux, spans.x_B, token, label, cell, 2)
    got = si.analytic_ids(params, red, np.zeros(8, int), np.ones(8, int), label, cell, 2)
    gamma = 0.75 * (signal - signal.mean(0))  # 3 of the 4 tokens carry the cell's value
    want = np.einsum("le,ed->ld", gamma, params["lm"]["block_0"]["W_O"][0])
    for a in (full, got):
        np.testing.assert_allclose(a["pred"][0], want, atol=1e-5)
        np.testing.assert_allclose(a["peak_N"][0], mass[:, 0], atol=1e-6)
    with pytest.raises(ValueError, match="the same number in every cell"):
        cell_tokens(spans._replace(cell_I=np.array([0, 0, 0, 1, 0, 0, 1, 1])), cell)


def test_the_additive_baseline_fits_an_additive_id_whole():
    """R^2 note: an ID exactly f(row) + g(col) is fitted whole by the one-hot
    row + column basis at rank h + w - 2; one with a row x column interaction is not."""
    rng = np.random.default_rng(1)
    gh, gw, D = 3, 4, 6
    row, col = np.divmod(np.arange(gh * gw), gw)
    additive = rng.normal(size=(gh, D))[row] + rng.normal(size=(gw, D))[col]
    basis = jnp.asarray(si.additive_basis(gh, gw))
    assert basis.shape == (gh * gw, gh + gw)
    ranks = (1, gh + gw - 2)
    r2 = si.rank_k_r2(basis, jnp.asarray(additive[None]), ranks)
    np.testing.assert_allclose(r2[0, -1], 1.0, atol=1e-5)
    mixed = additive + 3.0 * (row * col)[:, None] * rng.normal(size=D)
    assert float(si.rank_k_r2(basis, jnp.asarray(mixed[None]), ranks)[0, -1]) < 0.99


def test_the_report_on_a_checkpoint_under_the_authors_protocol(tmp_path, capsys):
    """The spatial-ID report on the fixture checkpoint (2 x 2 grid at 112 px: 4 merged
    tokens per cell), `--protocol=authors --layers=1:2`, end to end (~5-10 s): factorial
    probes (10 shapes x 4 cells x 3 other cells), only sites 1 and 2 (block 1's
    analytic ID) in the tables and summary, the baseline R^2 beside the R^2, no NaN
    interval: the fits' values alone, the analytic peak (a mean over probes) with its
    finite per-probe bootstrap interval."""
    import os

    from jaxmech.reports import spatial_ids as report
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    folder = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
    run = open_checkpoint(folder, grid=(2, 2), size=112, questions=2, layers=(1, 2),
                          batch=1024, protocol="authors", log=lambda *_: None)  # fmt: skip
    lines = []
    out = analyse_subject(report.REPORT, run, str(tmp_path), log=lines.append)
    printed = capsys.readouterr().out  # the estimate, before the compile and the compute
    assert "estimate ~" in printed and "compiling (" in printed
    assert printed.index("estimate ~") < printed.index(": compiling") < printed.index("computed in")
    assert (tmp_path / "spatial_ids" / "r2.csv").exists()
    assert (tmp_path / "spatial_ids" / "spatial_ids_paper.png").exists()  # Fig. 5, beside
    assert {r["site"] for r in out["tables"]["r2"]} == {r["site"] for r in out["tables"]["axes"]}
    assert {r["site"] for r in out["tables"]["r2"]} == {1, 2}
    assert {r["block"] for r in out["tables"]["analytic"]} == {1}
    assert all(np.isfinite(r["baseline_r2"]) for r in out["tables"]["r2"])
    s = out["summary"]
    assert s["sites"] == [1, 2] and "r2/0" not in s and "factorial" in s["probes"]
    assert out["res"]["peak_probes"].shape == (1, 1, 10 * 4 * 3)
    m, lo, hi, n = s["analytic/1"]["peak"]
    assert n == 120 and np.isfinite([m, lo, hi]).all() and 0 <= lo <= m <= hi <= 1
    assert all(isinstance(v, float) for v in s["r2/1"].values())  # a value, not a NaN CI
    text = "\n".join(lines)
    assert "no interval: one fit of one model" in text and "nan" not in text.lower()
    assert "one-hot row + one-hot column" in text


def test_the_paper_figure_draws_the_id_grid_on_its_two_axes(tmp_path, saved_figures):
    """Fig. 5 beside the table: a planted ID col * h + row * v (h, v orthogonal) lands
    on the plane at (col |h|, row |v|), all of its variance explained; the grid's points
    joined along rows and columns, v pointing down as in the image; a site without an
    axis (h = 0) says n = 0."""
    from conftest import texts

    from jaxmech.reports import spatial_ids as report

    H, W, D = 2, 3, 5
    h, v = np.eye(D)[0] * 2.0, np.eye(D)[1] * 0.5
    rows, cols = np.divmod(np.arange(H * W), W)
    delta = cols[:, None] * h + rows[:, None] * v
    delta -= delta.mean(0)  # an ID is centred over the cells
    xy, explained = report.plane_coords(delta, h, v)
    np.testing.assert_allclose(xy - xy.mean(0), np.stack([2.0 * cols, 0.5 * rows], -1)
                               - [2.0, 0.25], atol=1e-12)  # fmt: skip
    assert explained == pytest.approx(1.0)
    res = {"delta": np.stack([delta, delta])[None], "h": np.stack([h, 0 * h])[None],
           "v": np.stack([v, v])[None]}  # fmt: skip
    report.plot_paper(res, str(tmp_path / "spatial_ids_paper.png"), H, W, [4, 5])
    assert (tmp_path / "spatial_ids_paper.png").exists()
    fig = saved_figures[-1]
    full, empty = [ax for ax in fig.axes if ax.get_visible()]
    assert len(full.get_lines()) == H + W  # a line per row and per column
    assert full.yaxis_inverted() and full.get_xlabel() == "ID along h (column axis)"
    assert full.get_title() == "Layer 4: Explained 1.00"
    assert not empty.get_lines() and "n = 0" in texts(fig)
