"""The video task (`data.tasks.video`) and the VLM reading frames (`vit_frames`): the tables
keep objects in different frames, answers follow time, time-reversed twins flip
before / after, the ViT sees each frame alone and no time, the LM's ids carry it."""

import os

import batch_twins as bt
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.config import ConfigError
from jaxmech.data.tasks import scenes as sc
from jaxmech.data.tasks import video
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.results import load_run
from jaxmech.sweep import expand, run_grid
from jaxmech.train import build_data

T, W = 4, 3


def _config(**kw):
    return tiny_vlm_config(task_kind="video", grid_h=T, grid_w=W, vit_frames=True, **kw)


def _frames(batch, label_B):
    """[B] the frame of each row's object with label `label_B` (-1 if absent)."""
    here = np.asarray(batch.labels_BxL) == np.asarray(label_B)[:, None]
    return np.where(here.any(1), np.argmax(here, 1) // W, -1)


def test_tables_keep_objects_in_different_frames():
    cfg = _config()
    tables = video.build_tables(cfg.task)
    rows = tables.layouts // W
    assert np.all(rows[:, 0] != rows[:, 1])
    assert len(tables.layouts) == (T * W) * (T * W - 1) // 2 - T * W * (W - 1) // 2
    perm = np.sort(tables.pair_perm, axis=-1)
    assert np.all(perm == np.arange(len(tables.layouts)))
    assert tables.rel_ok[:, 1].all() and not tables.rel_ok[:, 0].any()


def test_samples_ask_before_or_after_and_answer_by_time():
    cfg = _config(single_frac=0.25)
    data = build_data(cfg)
    b = video.sample_batch(data.tables, jax.random.key(3), cfg.settings(), cfg.task, 256)
    b = jax.tree_util.tree_map(np.asarray, b)
    assert set(np.unique(b.relation_B)) <= {video.TIME, sc.PRESENCE}
    q = b.question_BxQ
    pair = q[:, 6] != sc.TOKEN["mid"]
    x_f, y_f = _frames(b, q[:, 1] - 10), _frames(b, q[:, 6] - 10)
    assert pair.sum() > 100 and np.all(x_f[pair] != y_f[pair])
    before = sc.TOKEN["above"]  # `before` has the id of `above`
    assert video.VIDEO_WORDS[before] == "before"
    np.testing.assert_array_equal(b.answer_B[pair] == before, x_f[pair] < y_f[pair])
    side = ~pair & (x_f >= 0) & (b.relation_B == video.TIME)
    np.testing.assert_array_equal(b.answer_B[side] == before, x_f[side] < T / 2)


def test_time_reversed_twins_flip_before_and_after():
    cfg = _config(third_frac=0.0)
    data = build_data(cfg)
    for s in data.evals:
        ex, rev = s.examples, s.mirror
        assert set(np.unique(ex.relation_B)) == {video.TIME}
        flip = {sc.TOKEN["above"]: sc.TOKEN["below"], sc.TOKEN["below"]: sc.TOKEN["above"]}
        np.testing.assert_array_equal(rev.answer_B, [flip[a] for a in ex.answer_B])
        x = ex.question_BxQ[:, 1] - 10
        np.testing.assert_array_equal(_frames(rev, x), T - 1 - _frames(ex, x))
        back = bt.mirror_height(rev, cfg.task)
        np.testing.assert_array_equal(back.labels_BxL, ex.labels_BxL)
        np.testing.assert_array_equal(back.answer_B, ex.answer_B)
        np.testing.assert_array_equal(s.mirror_pos.labels_BxL, rev.labels_BxL)


def test_vit_sees_each_frame_alone_and_no_time():
    cfg = _config(n_layers=2, lm_pos_ids="mrope")
    p = toy_vlm.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    labels = rng.integers(1, 8, (2, T * W)).astype(np.int32)
    ones = np.ones_like(labels)
    q = np.asarray(sc.question_tokens(np.ones(2, np.int32), labels[:, 0], labels[:, 1]))

    def vit_out(lab):
        _, aux = toy_vlm.forward(p, lab, ones, ones, q, capture=True)
        return np.asarray(aux["proj/out"])

    base = vit_out(labels)
    other = labels.copy()
    other[:, W : 2 * W] = 8 - other[:, W : 2 * W]  # change frame 1 only
    changed = np.abs(vit_out(other) - base).max(-1)  # [B, L]
    frame = np.arange(T * W) // W
    assert np.all(changed[:, frame != 1] < 1e-5) and np.all(changed[:, frame == 1] > 1e-4)
    rolled = np.roll(labels, W, axis=1)  # every frame one step later
    np.testing.assert_allclose(vit_out(rolled), np.roll(base, W, axis=1), atol=1e-5)
    ids = np.asarray(toy_vlm.lm_position_ids(p, 8))
    np.testing.assert_array_equal(ids[0, : T * W], frame)  # mrope t is the frame
    np.testing.assert_array_equal(ids[1, : T * W], 0)


def test_bad_layouts_per_pair_names_the_field():
    with pytest.raises(ConfigError, match="layouts_per_pair"):
        video.build_tables(_config(layouts_per_pair=60).task)  # 66 layouts, 48 across frames


def test_temporal_id_extraction_recovers_a_planted_id():
    from jaxmech.analysis import spatial_ids as si
    from jaxmech.analysis.temporal_ids import id_stats, temporal_ids

    rng = np.random.default_rng(0)
    D, n_labels, reps = 12, 5, 3
    u, v = np.linalg.qr(rng.normal(size=(D, 2)))[0].T
    label = np.repeat(np.arange(1, n_labels + 1), T * W * reps)
    cell = np.tile(np.repeat(np.arange(T * W), reps), n_labels)
    frame, col = cell // W, cell % W
    planted_f = 2.0 * (frame - (T - 1) / 2)  # a linear temporal ID along u
    states = (
        rng.normal(size=(n_labels + 1, D))[label]  # what depends on the label
        + planted_f[:, None] * u
        + 0.5 * (col - (W - 1) / 2)[:, None] * v  # where in the frame
        + 0.01 * rng.normal(size=(len(label), D))
    )
    delta = np.asarray(si.spatial_ids(jnp.asarray(states[None]), label, cell, T * W))
    tid = temporal_ids(delta, T)[0]  # [T, D]
    want = 2.0 * (np.arange(T) - (T - 1) / 2)[:, None] * u
    np.testing.assert_allclose(tid, want, atol=0.02)
    stats = id_stats(delta, T)
    share = (want**2).sum() / ((want**2).sum() + (0.5**2) * ((np.arange(W) - 1) ** 2).sum() * T / W)
    assert abs(stats["time_share"][0] - share) < 0.01
    assert stats["linear_r2"][0] > 0.999
    np.testing.assert_allclose(np.abs(stats["on_axis"][0]), np.abs(want @ u), atol=0.02)


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    """Two tiny video VLMs (2 LM blocks, three-part ids) trained by `run_grid`."""
    out = str(tmp_path_factory.mktemp("video") / "run")
    cfg = _config(lm_n_layers=2, lm_pos_ids="mrope", steps=10, eval_every=10)
    run_grid(expand(cfg, {}, seeds=2), out, log=lambda *a, **k: None)
    return out


def test_video_trains_with_time_metrics(video_run):
    run = load_run(video_run)
    assert {"unseen_t_acc", "seen_t_acc", "single_t_acc", "unseen_t_p"} <= set(run.curves[0])
    assert "unseen_h_acc" not in run.curves[0]
    for row in run.curves:
        assert row["unseen_min_acc"] == row["unseen_t_acc"]


# slow: every temporal report on a trained video run (~20 s); the video task, view and time metrics stay in the suite
@pytest.mark.slow
def test_time_reports_run_on_a_video_run(video_run):
    from jaxmech.reports import patching, temporal_ids
    from jaxmech.reports.common import analyse

    quiet = lambda *a, **k: None  # noqa: E731
    rep = analyse(temporal_ids.REPORT, video_run, log=quiet)
    ids = rep["res"]["ids"]
    assert ids["time_share"].shape == (2, 3)  # models x sites
    assert np.all(np.isnan(ids["time_share"][:, 0]))  # the embedding sees no image
    assert np.all(np.isfinite(ids["time_share"][:, 1:]))
    assert rep["res"]["beliefs"].shape == (2, 1, T)
    assert os.path.exists(os.path.join(video_run, "temporal_ids", "temporal_ids.png"))
    pat = analyse(patching.REPORT, video_run, log=quiet)
    assert {r["word"] for r in pat["tables"]["shifts"]} == {"before", "after", "both"}
    msg = temporal_ids.temporal_refusal(tiny_vlm_config(lm_n_layers=2), "scenes")
    assert "task_kind = 'scenes' has no temporal_ids report" in msg


def test_spatial_reports_refuse_a_video_run_by_name():
    from jaxmech.reports.counterfactuals import counterfactuals_refusal
    from jaxmech.reports.diagnostics import diagnostics_refusal
    from jaxmech.reports.steering import steering_refusal
    from jaxmech.reports.vit_terms import vit_terms_refusal

    cfg = _config(lm_n_layers=2)
    for refusal in (
        steering_refusal,
        diagnostics_refusal,
        counterfactuals_refusal,
        vit_terms_refusal,
    ):
        assert "task_kind = 'video'" in refusal(cfg, "runs/v")
        assert refusal(tiny_vlm_config(lm_n_layers=2), "runs/s") is None
