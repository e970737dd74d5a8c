"""The spatial-ID loss (`families.toy_vlm.id_loss`): zero at its target, gradient only
below its site, weight 0 as the plain loss, the probe's layout, the config checks; the
fine-tuning (`reports.id_loss.finetune`, a sweep from a trained run's params): its
paired folder and report, and its resume after kill -9."""

import csv
import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import file_bytes, kill_after_first_save, subprocess_env, tiny_vlm_config

from jaxmech import results, saves
from jaxmech.config import ConfigError
from jaxmech.data.tasks import get_task
from jaxmech.families import trainable
from jaxmech.families.toy_vlm import id_loss
from jaxmech.families.toy_vlm import loss as answer
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.train import build_data, stack_settings, train_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def _setup():
    """(config, params, batch) of a tiny 2-block VLM with the ID loss at site 1; position
    codes of scale 1, so the IDs are far above the loss's norm epsilon at init."""
    cfg = tiny_vlm_config(lm_n_layers=2, id_site=1, id_weight=1.0, init_P=1.0)
    data = build_data(cfg)
    batch = get_task("scenes").sample_batch(
        data.tables, jax.random.key(1), cfg.settings(), cfg.task, 16
    )
    return cfg, jax.jit(toy_vlm.init_params, static_argnums=0)(cfg, jax.random.key(0)), batch


def test_pair_probe_puts_x_at_every_cell_and_keeps_y():
    cfg, _, batch = _setup()
    probe = id_loss.pair_probe(batch, 2)
    L = cfg.task.image_len
    assert probe.labels_BxL.shape == (2 * L, L)
    for p in range(2):
        row = jax.tree_util.tree_map(lambda a: np.asarray(a)[-2 + p], batch)
        x, y = row.question_BxQ[1] - 10, max(row.question_BxQ[6] - 10, 0)
        y_cell = int(np.argmax(row.labels_BxL == y))
        for c in range(L):
            img = np.asarray(probe.labels_BxL[p * L + c])
            assert img[c] == x
            assert (img == y).sum() == (1 if y else 0)
            if y and c != y_cell:
                assert img[y_cell] == y
        np.testing.assert_array_equal(probe.question_BxQ[p * L], row.question_BxQ)


def test_loss_is_zero_at_its_target_and_positive_elsewhere():
    cfg, params, batch = _setup()
    states = id_loss.id_states(params, id_loss.pair_probe(batch, 1), 1)  # [1, L, D]
    assert float(id_loss.id_loss(params, batch, 1, n_pairs=1)) > 0.05
    at_target = {**params, "static": {**params["static"], "id_target": states[0]}}
    assert abs(float(id_loss.id_loss(at_target, batch, 1, n_pairs=1))) < 1e-5
    shifted = {**params, "static": {**params["static"], "id_target": states[0] + 3.0}}
    assert abs(float(id_loss.id_loss(shifted, batch, 1, n_pairs=1))) < 1e-5  # centred


def test_gradient_reaches_only_the_layers_below_the_site():
    cfg, params, batch = _setup()
    grads = jax.jit(jax.grad(lambda p: id_loss.id_loss(p, batch, 1)))(params)
    norms = {
        jax.tree_util.keystr(path): float(jnp.abs(g).max())
        for path, g in jax.tree_util.tree_leaves_with_path(trainable(grads))
    }
    below = [k for k in norms if "['lm']['block_0']" in k or "'vit'" in k or "'proj'" in k]
    above = [k for k in norms if "['lm']['block_1']" in k or "W_U" in k or "lnf" in k]
    assert above and below
    assert all(norms[k] == 0.0 for k in above), {k: norms[k] for k in above}
    assert all(norms[k] > 0 for k in below if "'lm'" in k and "W_" in k)
    assert norms["['vit']['label_E']"] > 0 and norms["['proj']['W']"] > 0


def test_weight_zero_adds_nothing_to_loss_or_gradient():
    """Both losses and gradients in one compiled program: XLA computes their shared
    answer part once, so what the ID path adds is compared exactly (eager op by op, the
    same check took ~35 s: ~440 small compiles)."""
    cfg, params, batch = _setup()
    with_site = cfg.replace(id_weight=0.0)
    settings = with_site.settings()

    def value_grad(p, c):
        return jax.value_and_grad(lambda q: answer.answer_loss(q, batch, None, settings, c))(p)

    both = jax.jit(
        lambda p: (value_grad(p, with_site), value_grad(p, with_site.replace(id_site=0)))
    )
    (v1, g1), (v0, g0) = both(params)
    assert float(v1) == float(v0)
    diff = jax.tree_util.tree_map(lambda a, b: float(jnp.abs(a - b).max()), g1, g0)
    assert max(jax.tree_util.tree_leaves(diff)) == 0.0


@pytest.mark.slow
def test_weight_zero_trains_as_the_plain_model():
    """Same data, init and loss; the programs differ (the ID path is compiled in), so
    the params agree up to float rounding, not bit for bit (BUILD_NOTES, guarantees).
    Slow (~20 s: two training programs compiled); in the suite, weight 0 adding nothing
    to the loss or its gradient is `test_weight_zero_adds_nothing_to_loss_or_gradient`."""
    base = tiny_vlm_config(steps=10, eval_every=10)
    out = []
    for cfg in (base, base.replace(id_site=1, id_weight=0.0)):
        settings = stack_settings([cfg.replace(seed=s % 2).settings() for s in range(4)])
        out.append(trainable(train_models(cfg, settings)[0].params))
    diff = jax.tree_util.tree_map(lambda a, b: float(np.abs(a - b).max()), *out)
    assert max(jax.tree_util.tree_leaves(diff)) < 1e-4
    moved = jax.tree_util.tree_map(lambda a: float(np.abs(a).max()), out[0])
    assert max(jax.tree_util.tree_leaves(moved)) > 0


# slow: a two-model sweep over the ID weight (~13 s); the loss's identities and the weight-zero gradient stay in the suite
@pytest.mark.slow
def test_weight_is_sweepable_and_changes_training():
    cfg = tiny_vlm_config(steps=10, eval_every=10, id_site=1)
    both = [cfg.replace(id_weight=w).settings() for w in (0.0, 1.0)]
    state, curves = train_models(cfg, stack_settings(both + both))  # 4: the shared program
    assert {"id_loss_train", "id_loss_unseen"} <= set(curves)
    assert curves["id_loss_train"][1, -1] < curves["id_loss_train"][0, -1]
    same_seed = jax.tree_util.tree_map(lambda a: float(np.abs(a[0] - a[1]).max()), state.params)
    assert same_seed["static"]["id_target"] == 0.0  # the target comes from the seed
    assert same_seed["lm"]["E"] > 0


def test_planted_target_is_a_centred_linear_grid():
    cfg, params, _ = _setup()
    t = np.asarray(params["static"]["id_target"])
    g = t.reshape(cfg.task.grid_h, cfg.task.grid_w, -1)
    np.testing.assert_allclose(t.mean(0), 0, atol=1e-6)
    right, down = g[:, 1:] - g[:, :-1], g[1:] - g[:-1]
    np.testing.assert_allclose(right, np.broadcast_to(right[0, 0], right.shape), atol=1e-5)
    np.testing.assert_allclose(down, np.broadcast_to(down[0, 0], down.shape), atol=1e-5)
    assert abs(float(right[0, 0] @ down[0, 0])) < 1e-5


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match="id_weight"):
        tiny_vlm_config(id_weight=0.5)
    with pytest.raises(ConfigError, match="id_site"):
        tiny_vlm_config(id_site=2)  # the tiny LM has 1 block: sites 0..1
    with pytest.raises(ValueError, match="id_site"):
        _, params, batch = _setup()
        id_loss.id_loss(params, batch, 0)


def _quiet(*_, **__):
    pass


@pytest.fixture(scope="module")
def vlm_base(tmp_path_factory):
    """Two tiny VLMs (seeds 0, 1) trained 10 steps by `run_grid`: the base run the
    fine-tuning tests start from."""
    from jaxmech.sweep import expand, run_grid

    base = str(tmp_path_factory.mktemp("id_loss") / "base")
    run_grid(expand(tiny_vlm_config(steps=10, eval_every=10), {}, seeds=2), base, log=_quiet)
    return base


# three saves (eval_every 10, the base's): a kill after the first leaves work to redo
FT_STEPS = 30
FT_OVERRIDES = {"id_site": 1, "steps": FT_STEPS, "lr": 1e-3}


@pytest.fixture(scope="module")
def finetuned(vlm_base, tmp_path_factory):
    """The base's models fine-tuned uninterrupted, once per weight 0 and 1: the folder."""
    from jaxmech.reports import id_loss as report

    out = str(tmp_path_factory.mktemp("id_loss") / "ft")
    report.finetune(vlm_base, out, [0.0, 1.0], FT_OVERRIDES, log=_quiet)
    return out


# slow: a trained base and two fine-tune sweeps (~35 s); the checkpoint fine-tune (test_qwen2_vl_view) and the toy ID loss's identities stay in the suite
@pytest.mark.slow
def test_finetune_writes_a_paired_run_and_its_report(vlm_base, finetuned, tmp_path):
    from jaxmech.reports import id_loss as report
    from jaxmech.reports.common import analyse, open_run
    from jaxmech.sweep import params_fingerprint

    quiet, base, out = _quiet, vlm_base, finetuned
    with pytest.raises(ValueError, match="weights"):
        report.finetune(base, str(tmp_path / "x"), [0.5], {"id_site": 1}, log=quiet)
    assert not (tmp_path / "x").exists()  # refused before anything was written
    run, ft = open_run(base, log=quiet), open_run(out, log=quiet)
    assert ft.k == 4 and list(np.asarray(ft.settings.id_weight)) == [0, 1, 0, 1]
    np.testing.assert_array_equal(np.asarray(ft.settings.seed), [0, 0, 1, 1])
    targets = report.extract_targets(run, 1)
    # it started exactly from the base models' params with the IDs extracted beforehand
    with open(os.path.join(out, "sweep.json")) as f:
        start = json.load(f)["init_from"]
    assert start["run"] == os.path.abspath(base) and start["models"] == [0, 0, 1, 1]
    assert start["static"] == ["id_target"]
    params = jax.tree_util.tree_map(lambda x: x[[0, 0, 1, 1]], results.load_run(base).params)
    params["static"]["id_target"] = np.repeat(targets, 2, axis=0)
    assert start["sha256"] == params_fingerprint(params)
    # AdamW's weight decay reaches the 2-D constant (its mask goes by ndim): ~5e-4 here
    got = np.asarray(ft.params["static"]["id_target"])
    np.testing.assert_allclose(got[::2], targets, rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(got[1::2], targets, rtol=2e-3, atol=1e-6)
    moved = np.abs(np.asarray(ft.params["lm"]["E"])[::2] - np.asarray(run.params["lm"]["E"]))
    assert 0 < moved.max() < 0.1  # continued from the base model, not from scratch
    _, meta = saves.restore(os.path.join(out, "params"))
    assert meta["base"] == os.path.abspath(base) and meta["swept"] == ["id_weight"]
    lines = []
    report.finetune(base, out, [0.0, 1.0], FT_OVERRIDES, log=lines.append)
    assert any("already finished" in line for line in lines), lines
    # grouped by the base models' generalisation before fine-tuning (seed 1 of the base
    # marked generalising by hand: 10 steps reach no 0.9)
    file = os.path.join(base, "results.csv")
    kept, rows = file_bytes(file), results.load_run(base, with_data=False).results
    try:
        with open(file, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows([{**r, "unseen_min_acc": 0.95 if r["model"] == 1 else 0.5} for r in rows])
        assert report.base_groups(ft) == ["others", "others", "generalising", "generalising"]
        summary = analyse(report.REPORT, out, log=quiet)["summary"]
    finally:
        with open(file, "wb") as f:
            f.write(kept)
    for g in ("generalising", "others"):
        assert summary[f"{g}/id_loss_train@1"]["pairs"] == 1
        assert summary[f"{g}/seen_h_acc@0"]["n"] == 1
    assert os.path.exists(os.path.join(out, "id_loss", "curves.png"))
    with pytest.raises(ValueError, match="id_site = 0"):
        analyse(report.REPORT, base, log=quiet)


# slow: two fine-tune sweeps (~20 s); the kill -9 resume identity of a sweep stays in the suite (test_toy_vlm_family)
@pytest.mark.slow
def test_finetune_killed_then_rerun_matches_an_uninterrupted_one(vlm_base, finetuned, tmp_path):
    """~10 s alone (~35 s while the other worker compiles: the subprocess shares the two
    cores): a CLI fine-tune (imports, then the shared cache's programs: the in-process
    fixture compiled them first) killed with SIGKILL after its first save, then
    resumed in-process, against the uninterrupted fine-tune: params bit for bit, CSVs
    and sweep.json byte for byte (so the subprocess extracted the same targets, or the
    resume would have been refused)."""
    from jaxmech.reports import id_loss as report

    out = str(tmp_path / "killed")
    flags = [f"--base={vlm_base}", f"--out={out}", "--weights=0,1", "--id_site=1"]
    flags += [f"--steps={FT_STEPS}", "--lr=1e-3"]
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.id_loss", *flags],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    chunk = os.path.join(out, "checkpoints", "chunk_0000")
    deadline = time.time() + 300
    while proc.poll() is None and saves.latest_step(chunk) is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, err.read_text()[-3000:]  # still running: it did not fail
    kill_after_first_save(proc, out)
    lines = []
    report.finetune(vlm_base, out, [0.0, 1.0], FT_OVERRIDES, log=lines.append)
    assert not any(f"step 10/{FT_STEPS}" in line for line in lines), lines  # resumed
    for name in ("results.csv", "curves.csv", "sweep.json"):
        assert file_bytes(os.path.join(out, name)) == file_bytes(os.path.join(finetuned, name)), (
            name
        )
    a, b = results.load_run(finetuned), results.load_run(out)
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # ~14 s: `train_only` is static, so its own program; in the suite a
# checkpoint's frozen leaves stay bit-equal through the same `train.path_mask`
# (test_qwen2_vl_view.py::test_id_loss_fine_tunes_a_checkpoint_with_the_lm_frozen)
def test_train_only_keeps_the_frozen_parameters_bit_equal():
    """With the ID loss on and only the projector and one ViT matrix training (the authors'
    recipe freezes the LM), a further segment of training leaves every other parameter
    bit for bit where it was (both states from the training program: its init rounds
    differently from another program's)."""
    from jaxmech.train import param_paths

    cfg, settings = _train_only_config()
    first = train_models(cfg, settings, n_chunks=1)[0]
    second = train_models(cfg, settings, state=first, n_chunks=1)[0]
    a, b = first.params, second.params
    for path, x, y in zip(
        param_paths(a), jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    ):
        trained = path.startswith("proj/") or path == "vit/block_0/W_V"
        assert (np.abs(np.asarray(x) - np.asarray(y)).max() > 0) == trained, path


def _train_only_config():
    cfg = tiny_vlm_config(steps=20, eval_every=10, id_site=1, train_only="proj/*+vit/block_0/W_V")
    return cfg, stack_settings([cfg.replace(id_weight=w).settings() for w in (0.0, 1.0)] * 2)


def test_a_train_only_pattern_matching_nothing_is_refused_before_compute():
    cfg, settings = _train_only_config()
    with pytest.raises(ConfigError, match="train_only = 'lm/nothing'"):
        train_models(cfg.replace(train_only="lm/nothing"), settings)
    with pytest.raises(ConfigError, match="train_only = 'proj/\\*\\+'"):
        cfg.replace(train_only="proj/*+")


QWEN_FIXTURES = os.path.join(ROOT, "tests", "fixtures", "qwen2_vl")


def test_checkpoint_id_site_defaults_to_the_authors_layer():
    """A checkpoint's ID loss sits at the authors' layer (train.py's --spatial_id_layer
    11, hidden_states[11] = lm/resid_pre.11) of Qwen2-VL-2B's 28 LM blocks, and at the
    same relative depth, round(11 n / 28) and at least 1, in a smaller LM; the log says
    which; an explicit site is kept and checked."""
    from jaxmech.families.qwen2_vl.config import from_hf
    from jaxmech.families.qwen2_vl.stand_in import QWEN2_VL_2B
    from jaxmech.families.registry import read_checkpoint_config
    from jaxmech.reports import id_finetune as idf

    n_2b = from_hf(QWEN2_VL_2B).lm_layers
    lines = []
    assert n_2b == 28 and idf.site_of(n_2b, None, lines.append) == 11
    assert "layer 11 (lm/resid_pre.11)" in lines[0] and "scaled" not in lines[0]
    n_fixture = read_checkpoint_config(os.path.join(QWEN_FIXTURES, "qwen2_vl"))[1].lm_layers
    lines = []
    assert idf.site_of(n_fixture, None, lines.append) == max(1, round(11 * n_fixture / 28))
    assert f"scaled to {n_fixture} blocks" in lines[0]
    assert [idf.authors_site(n) for n in (1, 2, 4, 14, 56)] == [1, 1, 2, 6, 22]  # halves up
    assert idf.site_of(n_fixture, 2, lines.append) == 2
    with pytest.raises(ValueError, match="id_site = 3"):
        idf.site_of(n_fixture, 3)


def _trained_paths(params, spec: str) -> set:
    from jaxmech.train import param_paths, path_mask

    mask = jax.tree_util.tree_leaves(path_mask(params, spec))
    return {p for p, m in zip(param_paths(params), mask) if m}


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_checkpoint_fine_tune_trains_the_authors_leaves(variant):
    """The default leaves (the family's `trainable`) are train.py's
    vision_mlp_lastk selection: the MLP weights (no biases) of the ViT's last
    min(6, depth) blocks (Qwen2.5-VL's SwiGLU gate too); the merger, the ViT's other
    leaves and the LM are frozen. On both fixtures (every block: fewer than 6) and on
    Qwen2-VL-2B's layout (blocks 26-31 of 32)."""
    from jaxmech.families import load_checkpoint
    from jaxmech.families.qwen2_vl.config import from_hf
    from jaxmech.families.qwen2_vl.family import trainable
    from jaxmech.families.qwen2_vl.params import is_shape, param_shapes
    from jaxmech.families.qwen2_vl.stand_in import QWEN2_VL_2B
    from jaxmech.finetune import trained_leaves
    from jaxmech.train import param_paths, path_mask

    _, config, params = load_checkpoint(os.path.join(QWEN_FIXTURES, variant))
    mlp = ("W_in", "W_out") + (("W_gate",) if variant == "qwen2_5_vl" else ())
    want = {f"vit/block_{i}/{w}" for i in range(config.vit_depth) for w in mlp}
    assert config.vit_depth < 6
    spec = trainable(params)
    trained = _trained_paths(params, spec)
    assert trained == want and not any(p.startswith("merger/") for p in trained)
    # what a finished fine-tune keeps (`trained_leaves`): those leaves and no other
    kept = trained_leaves(params, jax.tree_util.tree_leaves(path_mask(params, spec)))
    assert {param_paths(params)[int(i)] for i in kept} == want
    big = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                                 param_shapes(from_hf(QWEN2_VL_2B)), is_leaf=is_shape)  # fmt: skip
    assert _trained_paths(big, trainable(big)) == {
        f"vit/block_{i}/{w}" for i in range(26, 32) for w in ("W_in", "W_out")
    }
