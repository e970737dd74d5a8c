"""Sweeps: devices, interruption and resume, refusal of foreign folders, CLI errors;
sweeps from a trained run's params (`init_from`)."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import (
    TINY,
    Interrupted,
    file_bytes,
    flip_middle_byte,
    kill_after_first_save,
    quiet,
    stop_after,
    subprocess_env,
    tiny_config,
)

from jaxmech import results, saves
from jaxmech.config import Config, Settings
from jaxmech.sweep import Grid, InitFrom, SweepMismatchError, expand, run_grid

TINY_FLAGS = [f"--{k}={v}" for k, v in TINY.items() if k != "n_pair_labels"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grid(steps=40, eval_every=10, n_pair="3,5", seeds=2):
    config = tiny_config(steps=steps, eval_every=eval_every)
    return expand(config, {"n_pair": n_pair}, seeds=seeds)


def _params_equal(a_dir, b_dir, rtol=1e-5, atol=1e-6, exact=True):
    a, b = results.load_run(a_dir), results.load_run(b_dir)
    flat_a = jax.tree_util.tree_flatten_with_path(a.params)[0]
    for (path, x), y in zip(flat_a, jax.tree_util.tree_leaves(b.params)):
        name = jax.tree_util.keystr(path)
        if "b_K" in name and not exact:
            continue  # softmax-invariant: rounding noise scaled by Adam (BUILD_NOTES.md)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=name)
    for ra, rb in zip(a.results, b.results):
        for k in ("single_acc", "seen_acc", "unseen_acc", "labelset_acc", "final_loss"):
            np.testing.assert_allclose(ra[k], rb[k], rtol=1e-5, atol=1e-6)


def test_interrupted_sweep_resumes_to_the_same_result(tmp_path):
    grid = _grid()
    full = str(tmp_path / "full")
    run_grid(grid, full, chunk_size=2, log=lambda *_: None)
    part = str(tmp_path / "part")
    with pytest.raises(Interrupted):
        run_grid(grid, part, chunk_size=2, log=stop_after(5))  # mid second chunk
    assert not os.path.exists(os.path.join(part, "results.csv"))
    resumed = run_grid(grid, part, chunk_size=2, log=lambda *_: None)
    # 4 models: chunk 0 (2 models) done, chunk 1 (2 models) at step 10 of 40
    assert resumed["trained_steps"] == 2 * 30
    _params_equal(full, part)
    for name in ("results.csv", "curves.csv"):  # same bytes: same columns in the same order
        assert file_bytes(os.path.join(part, name)) == file_bytes(os.path.join(full, name)), name
    assert not os.path.exists(os.path.join(part, "checkpoints"))  # cleaned when finished


def test_a_damaged_save_falls_back_to_the_last_intact_step(tmp_path):
    grid = _grid()  # 4 models: one chunk, saves at steps 10, 20, 30 (two kept)
    full = str(tmp_path / "full")
    run_grid(grid, full, log=quiet)
    out = str(tmp_path / "run")
    with pytest.raises(Interrupted):
        run_grid(grid, out, log=stop_after(3))
    newest = os.path.join(out, "checkpoints", "chunk_0000", "30")
    data = [f for f in glob.glob(os.path.join(newest, "state", "**"), recursive=True)]
    target = max((f for f in data if os.path.isfile(f)), key=os.path.getsize)
    flip_middle_byte(target)  # the parameter values: Orbax alone would load it silently
    lines = []
    resumed = run_grid(grid, out, log=lines.append)
    warned = [line for line in lines if os.path.basename(target) in line]
    assert warned, lines  # the warning names the damaged file
    assert resumed["trained_steps"] == 4 * 20  # from step 20: not from 30, not from 0
    for name in ("results.csv", "curves.csv"):  # byte-identical to the uninterrupted run
        assert file_bytes(os.path.join(out, name)) == file_bytes(os.path.join(full, name)), name


def test_mismatched_sweep_is_refused_before_compute(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(Interrupted):
        run_grid(_grid(), out, chunk_size=4, log=stop_after(1))
    listing = sorted(os.listdir(out))
    with pytest.raises(SweepMismatchError, match="different sweep"):
        run_grid(_grid(n_pair="3,4"), out, chunk_size=4, log=lambda *_: None)
    assert sorted(os.listdir(out)) == listing
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(SweepMismatchError, match="other files"):
        run_grid(_grid(), str(stranger), log=lambda *_: None)
    assert (stranger / "notes.txt").read_text() == "mine"


def _sweep_cmd(out, *extra):
    return [
        sys.executable,
        "-m",
        "experiments.sweep",
        f"--out={out}",
        "--n_pair=3,5",
        "--seeds=2",
        *TINY_FLAGS,
        *extra,
    ]


def test_sharded_over_four_devices_equals_one_device(tmp_path):
    """~25 s: a CLI subprocess on 4 fake devices compiles its own sharded programs."""
    one = str(tmp_path / "one")
    run_grid(_grid(), one, chunk_size=4, log=lambda *_: None)
    four = str(tmp_path / "four")
    env = subprocess_env(devices=4)
    proc = subprocess.run(
        _sweep_cmd(four, "--steps=40", "--eval_every=10", "--chunk_size=4"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 cpu device(s)" in proc.stdout
    _params_equal(one, four, rtol=1e-4, atol=1e-5, exact=False)


@pytest.mark.slow
def test_kill_minus_9_then_rerun_matches_uninterrupted(tmp_path):
    """Slow (~16-25 s: two CLI subprocesses, each ~2.5 s of imports, then the shared
    cache's programs, 10 saves each). In the suite, a CLI sweep killed with SIGKILL
    and resumed to the uninterrupted run's bits is `test_toy_vlm_family`'s, and in-process
    interrupted resumes are tested here and in `test_trained_family`."""
    steps = ["--steps=100", "--eval_every=10"]
    out = str(tmp_path / "killed")
    proc = subprocess.Popen(
        _sweep_cmd(out, *steps, "--chunk_size=4"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_after_first_save(proc, out)
    rerun = subprocess.run(
        _sweep_cmd(out, *steps, "--chunk_size=4"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    ref = str(tmp_path / "ref")
    run_grid(_grid(steps=100), ref, chunk_size=4, log=lambda *_: None)
    _params_equal(ref, out)


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--n_pair=9:5", "empty range"),
        ("--n_pair=5:16", "n_pair_labels"),
        ("--layouts_per_pair=0,46", "layouts_per_pair"),
        ("--no_such_field=3", "no_such_field"),
        ("--preset=nope", "--preset='nope' is unknown"),
        ("--epochs=0,5", "mixes 0"),
        ("--model_kind=nope", "model_kind = 'nope' is invalid"),
        ("--chunk_size=0", "--chunk_size=0: allowed an integer >= 1"),
        ("--save_every=0", "--save_every=0"),
        ("--n_pair=5,5", "5 is given twice"),
    ],
)
def test_bad_cli_specs_fail_with_clear_errors(tmp_path, flag, message):
    """In-process: the entry point's flags are parsed and refused before any compute."""
    from absl import app, flags

    from experiments import sweep as entry

    out = str(tmp_path / "never")
    try:
        entry.FLAGS([entry.__file__, f"--out={out}", flag])
        with pytest.raises(app.UsageError, match=re.escape(message)):
            entry.main([])
    except flags.Error as e:  # an unknown flag fails in the parser itself
        assert message in str(e)
    finally:
        entry.FLAGS.unparse_flags()
    assert not os.path.exists(out)


def test_cli_error_exits_nonzero_with_the_message():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", "--out=/nonexistent/never", "--n_pair=9:5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "empty range" in proc.stderr


def test_sweep_identity_compares_values_not_text():
    """A folder written before a field existed matches when that field is at its default."""
    import json

    from jaxmech.sweep import identity, sweep_difference

    ident = identity(_grid())
    old = json.loads(json.dumps(ident))
    del old["config"]["task"]["task_kind"], old["config"]["model"]["vision_pos"]
    for s in old["settings"]:
        del s["epochs"]
    assert sweep_difference(old, ident) is None
    old["config"]["model"]["d_model"] = 32
    assert sweep_difference(old, ident) is not None
    assert sweep_difference({"format": 1}, ident) is not None


def test_preset_is_the_protocol_config_and_flags_override_it():
    from jaxmech.cli import preset_config

    assert preset_config(None) == Config()
    assert preset_config("finite_e60").train.epochs == 60
    grid = expand(preset_config("finite_e60"), {"n_pair": "5"}, seeds=1)
    assert grid.config.train.epochs == 60 and grid.config.train.steps == 250  # 141 -> 250
    grid = expand(preset_config("left_right_t2"), {"text_n_layers": "1"}, seeds=1)
    assert grid.config.task.caption_mode == "left_right" and grid.config.model.text_layers == 1


def test_a_model_gives_the_same_numbers_in_sweeps_of_different_sizes(tmp_path):
    """Chunks have a fixed size per backend, so a model's numbers do not depend on how
    many models share its sweep or which ones are its neighbours."""
    import json

    from jaxmech.sweep import default_chunk_size

    alone = str(tmp_path / "alone")
    run_grid(_grid(steps=20, n_pair="5", seeds=1), alone, log=quiet)  # model (5, seed 0)
    crowd = str(tmp_path / "crowd")
    run_grid(_grid(steps=20, n_pair="3,5", seeds=3), crowd, log=quiet)  # (5, 0) is 4th of 6
    a, b = results.load_run(alone), results.load_run(crowd)
    (row,) = a.results
    (same,) = [r for r in b.results if r["n_pair_labels"] == 5 and r["seed"] == 0]
    assert {k: v for k, v in row.items() if k != "model"} == {
        k: v for k, v in same.items() if k != "model"
    }
    curve = [{k: v for k, v in r.items() if k != "model"} for r in a.curves]
    assert curve == [
        {k: v for k, v in r.items() if k != "model"} for r in b.curves if r["model"] == 3
    ]
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(x[0], y[3])
    with open(os.path.join(crowd, "sweep.json")) as f:
        program = json.load(f)["program"]
    assert program["chunk_size"] == default_chunk_size() and program["backend"] == "cpu"
    # resuming with another chunk size would mix programs: refused, naming both
    refused = r"chunks of 4 .*not chunks of 2.*JAXMECH_CPU_DEVICES=1"  # the resume's device count
    with pytest.raises(SweepMismatchError, match=refused):
        run_grid(_grid(steps=20, n_pair="3,5", seeds=3), crowd, chunk_size=2, log=quiet)


# --- sweeps from trained params (init_from) -------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """(base, other): two finished 2-model runs of the tiny config (seeds 0, 1 and 2, 3),
    the trained params init_from sweeps start from."""
    root = tmp_path_factory.mktemp("bases")
    out = []
    for name, first in (("base", 0), ("other", 2)):
        grid = expand(tiny_config(steps=20), {"n_pair": "5"}, seeds=2, first_seed=first)
        run_grid(grid, str(root / name), log=quiet)
        out.append(str(root / name))
    return tuple(out)


def _from_grid(steps=30):
    return expand(tiny_config(steps=steps), {"n_pair": "5"}, seeds=2)


def test_init_from_starts_every_model_from_its_base_models_params(bases, tmp_path):
    """With lr 0 the models never move: the folder's params are the chosen base models'
    (the static override in place), and every evaluation repeats the base's last one."""
    from jaxmech.sweep import identity, params_fingerprint

    base = results.load_run(bases[0])
    with open(os.path.join(bases[0], "sweep.json")) as f:  # a fresh sweep: keys as ever
        assert list(json.load(f)) == ["format", "config", "swept", "settings", "program"]
    assert list(identity(_from_grid())) == ["format", "config", "swept", "settings", "program"]
    models = (1, 0, 1)
    config = tiny_config(steps=20)
    own = [Settings(*(np.asarray(col)[m].item() for col in base.settings)) for m in models]
    grid = Grid(config, (), tuple(s._replace(lr=0.0) for s in own))  # by hand: lr 0
    scale = np.asarray([2.0, 3.0, 4.0], np.float32)
    init = InitFrom(bases[0], models, {"logit_scale_max": scale})
    out = str(tmp_path / "still")
    run_grid(grid, out, init_from=init, log=quiet)
    got = results.load_run(out)
    pick = lambda t: jax.tree_util.tree_map(lambda x: np.asarray(x)[list(models)], t)  # noqa: E731
    start = pick(base.params)
    start = {**start, "static": {**start["static"], "logit_scale_max": scale}}
    flat = jax.tree_util.tree_flatten_with_path(start)[0]
    for (path, x), y in zip(flat, jax.tree_util.tree_leaves(got.params)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    last = {int(r["model"]): r for r in base.results}
    metrics = ("single_acc", "seen_acc", "unseen_acc", "labelset_acc")
    for r in got.curves:
        for m in metrics:
            assert r[m] == last[models[r["model"]]][m], (r, m)
    with open(os.path.join(out, "sweep.json")) as f:
        record = json.load(f)["init_from"]
    assert record["run"] == os.path.abspath(bases[0]) and record["models"] == list(models)
    assert record["static"] == ["logit_scale_max"]
    assert record["base_sha256"] == params_fingerprint(pick(base.params))
    assert record["sha256"] == params_fingerprint(start)
    _, meta = saves.restore(os.path.join(out, "params"))
    assert meta["base"] == os.path.abspath(bases[0]) and meta["init_from"] == record


def test_init_from_resumes_and_refuses_a_changed_base(bases, tmp_path):
    """Interrupted, resumed: the uninterrupted run's CSVs byte for byte and params bit
    for bit; a resume against a changed base (or other base models, or no init_from)
    is refused before any compute, naming what differs."""
    base, other = bases
    copy = str(tmp_path / "base")
    shutil.copytree(base, copy)
    grid, init = _from_grid(), InitFrom(copy, (1, 0))
    full = str(tmp_path / "full")
    run_grid(grid, full, init_from=init, log=quiet)
    part = str(tmp_path / "part")
    with pytest.raises(Interrupted):
        run_grid(grid, part, init_from=init, log=stop_after(1))  # at step 10 of 30
    listing = sorted(os.listdir(part))
    shutil.rmtree(copy)
    shutil.copytree(other, copy)  # the base trained again, differently
    with pytest.raises(SweepMismatchError, match=r"base run .* changed since"):
        run_grid(grid, part, init_from=init, log=quiet)
    shutil.rmtree(copy)
    shutil.copytree(base, copy)
    with pytest.raises(SweepMismatchError, match=r"other models of .*init_from.models"):
        run_grid(grid, part, init_from=init._replace(models=(0, 1)), log=quiet)
    with pytest.raises(SweepMismatchError, match=r"started from the params of .*not a fresh"):
        run_grid(grid, part, log=quiet)
    assert sorted(os.listdir(part)) == listing  # nothing was changed
    resumed = run_grid(grid, part, init_from=init, log=quiet)  # the base as it was
    assert resumed["trained_steps"] == 2 * 20
    for name in ("results.csv", "curves.csv", "sweep.json"):
        assert file_bytes(os.path.join(part, name)) == file_bytes(os.path.join(full, name)), name
    _params_equal(full, part)
    a, b = results.load_run(full), results.load_run(part)
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    assert run_grid(grid, part, init_from=init, log=quiet)["trained_steps"] == 0  # finished


def _diverged_copy(base: str, folder: str) -> str:
    """A copy of `base` whose results.csv says model 0 diverged at step 7."""
    shutil.copytree(base, folder)
    rows = results.load_run(base).results
    rows[0]["diverged_step"] = 7
    results.write_csv(os.path.join(folder, "results.csv"), rows)
    return folder


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", r"init_from.run: path = .*nope' does not exist"),
        ("not_init_from", r"init_from = .*: expected a sweep.InitFrom"),
        ("out_of_range", r"init_from.models\[1\] = 2 is out of range: .* has 2 model"),
        ("negative", r"init_from.models\[0\] = -1 is out of range"),
        ("count", r"init_from.models has 1 entries for the grid's 2 model"),
        ("not_ints", r"init_from.models = .*expected one base model index"),
        ("family", r"model_kind = 'dual_encoder' models, this grid trains 'toy_vlm'"),
        ("shape", r"init_from.run = .*do not fit .*\['E'\] has shape"),
        ("static_name", r"init_from.static\['nope'\]: not a constant .*logit_scale_max"),
        ("static_shape", r"init_from.static\['logit_scale_max'\] has shape \(3,\)"),
        ("own_out", r"init_from.run = .* is the sweep's own output folder"),
        ("diverged", r"init_from.models\[0\] = 0: base model 0 of .* diverged at step 7"),
    ],
)
def test_bad_init_from_is_refused_before_compute(bases, tmp_path, case, message):
    """Every bad argument is named before anything is compiled or written."""
    from conftest import tiny_vlm_config

    base, grid, out = bases[0], _from_grid(), str(tmp_path / "never")
    init = {
        "missing": InitFrom(str(tmp_path / "nope"), (0, 1)),
        "not_init_from": base,
        "out_of_range": InitFrom(base, (0, 2)),
        "negative": InitFrom(base, (-1, 0)),
        "count": InitFrom(base, (0,)),
        "not_ints": InitFrom(base, ("0", "1")),
        "family": InitFrom(base, (0, 1)),
        "shape": InitFrom(base, (0, 1)),
        "static_name": InitFrom(base, (0, 1), {"nope": np.zeros(2)}),
        "static_shape": InitFrom(base, (0, 1), {"logit_scale_max": np.zeros(3)}),
        "own_out": InitFrom(base, (0, 1)),
        "diverged": InitFrom(_diverged_copy(base, str(tmp_path / "div")), (0, 1))
        if case == "diverged"
        else None,
    }[case]
    if case == "family":
        grid = expand(tiny_vlm_config(), {}, seeds=2)
    if case == "shape":
        grid = expand(tiny_config(steps=30, d_model=24, d_embed=24), {"n_pair": "5"}, seeds=2)
    if case == "own_out":
        out = base
    error = TypeError if case == "not_init_from" else ValueError
    listing = sorted(os.listdir(tmp_path))
    with pytest.raises(error, match=message):
        run_grid(grid, out, init_from=init, log=quiet)
    assert sorted(os.listdir(tmp_path)) == listing  # nothing written
