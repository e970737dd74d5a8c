"""Results folders: the CSV writer, and `load_run`'s strict checks on what it is given."""

import os
import shutil

import numpy as np
import pytest
from conftest import flip_middle_byte

from jaxmech import results, saves
from jaxmech.config import Config
from jaxmech.families.dual_encoder.evaluate import METRICS
from jaxmech.train import stack_settings

EXPECTED = "expected a results folder written by experiments.train or experiments.sweep"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A finished results folder of two models (tiny stand-in params; nothing trains)."""
    out = str(tmp_path_factory.mktemp("results") / "run")
    config = Config()
    settings = stack_settings([config.replace(seed=s).settings() for s in (3, 4)])
    steps = np.asarray([[0, 10], [0, 10]])
    curves = {"step": steps, "loss": np.asarray([[2.0, 1.0], [2.0, 0.5]])}
    curves.update({m: np.asarray([[0.5, 0.75], [0.5, 1.0]]) for m in METRICS})
    params = {"vision": {"W": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    results.write_files(out, config, settings, params, curves, np.asarray([-1, -1]))
    return out


def _copy(folder, tmp_path, drop=None):
    dst = str(tmp_path / "copy")
    shutil.copytree(folder, dst)
    if drop:
        target = os.path.join(dst, drop)
        (shutil.rmtree if os.path.isdir(target) else os.remove)(target)
    return dst


def test_load_run_round_trips_what_write_files_wrote(folder):
    run = results.load_run(folder)
    assert run.config == Config()
    np.testing.assert_array_equal(run.settings.seed, [3, 4])
    np.testing.assert_array_equal(run.params["vision"]["W"], np.arange(6).reshape(2, 3))
    assert [r["seed"] for r in run.results] == [3, 4]
    assert [r["unseen_acc"] for r in run.results] == [0.75, 1.0]
    assert len(run.curves) == 4 and run.curves[-1]["step"] == 10
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")], "temporary file left"


def test_load_run_refuses_a_path_that_is_not_a_folder(folder, tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="does not exist") as e:
        results.load_run(missing)
    assert repr(missing) in str(e.value) and EXPECTED in str(e.value)
    a_file = os.path.join(folder, "results.csv")
    with pytest.raises(ValueError, match=f"path = {a_file!r} is not a folder; {EXPECTED}"):
        results.load_run(a_file)
    with pytest.raises(ValueError, match="path = None is a NoneType, not a path"):
        results.load_run(None)


@pytest.mark.parametrize("name", ["config.json", "curves.csv", "results.csv", "params"])
def test_load_run_refuses_a_folder_missing_a_part(folder, tmp_path, name):
    path = _copy(folder, tmp_path, drop=name)
    with pytest.raises(ValueError, match=f"has no {name} ") as e:
        results.load_run(path)
    assert repr(path) in str(e.value) and EXPECTED in str(e.value)
    with pytest.raises(ValueError, match=f"has no {name} "):
        results.load_config(path)  # the cheap check entry points run first


@pytest.mark.parametrize(
    "text, why",
    [
        ("{not json", "JSONDecodeError"),
        ("[1, 2]", "expected a JSON object"),
        ('{"model": {"d_model": -3}}', "d_model"),
        ('{"model": {"no_such_field": 1}}', "no_such_field"),
        ('{"tsak": {}}', "tsak"),
    ],
)
def test_load_run_refuses_a_broken_config_json(folder, tmp_path, text, why):
    path = _copy(folder, tmp_path)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match="has a broken config.json") as e:
        results.load_run(path)
    assert why in str(e.value) and repr(path) in str(e.value)


def test_load_run_refuses_unreadable_params(folder, tmp_path):
    path = _copy(folder, tmp_path, drop="params")
    os.makedirs(os.path.join(path, "params"))
    with pytest.raises(ValueError, match="has unreadable params") as e:
        results.load_run(path)
    assert repr(path) in str(e.value)


def test_write_csv_writes_header_and_rows_and_refuses_no_rows(tmp_path):
    path = str(tmp_path / "t.csv")
    results.write_csv(path, [{"a": 1, "b": 0.5}, {"a": 2, "b": "x"}])
    assert open(path).read().splitlines() == ["a,b", "1,0.5", "2,x"]
    assert os.listdir(tmp_path) == ["t.csv"]
    with pytest.raises(ValueError, match="no rows"):
        results.write_csv(str(tmp_path / "empty.csv"), [])
    assert os.listdir(tmp_path) == ["t.csv"]


def test_a_flipped_byte_in_params_is_an_error_naming_the_file(folder, tmp_path):
    """Every data file of params/ is checksummed: one changed byte is not loaded silently."""
    path = _copy(folder, tmp_path)
    files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(path, "params"))
        for f in fs
        if os.path.getsize(os.path.join(d, f)) > 0 and f != saves.MANIFEST
    ]
    target = max(files, key=os.path.getsize)  # the largest: the parameter values
    flip_middle_byte(target)
    with pytest.raises(ValueError, match="has unreadable params") as e:
        results.load_run(path)
    assert os.path.relpath(target, path) in str(e.value) or target in str(e.value)


def test_diverged_models_have_nan_metrics_and_loss_in_results_csv(tmp_path):
    """A diverged model's last-finite params are not a trained model: NaN, not 0.0."""
    config = Config()
    settings = stack_settings([config.replace(seed=s).settings() for s in (0, 1)])
    curves = {"step": np.asarray([[10], [10]]), "loss": np.asarray([[0.5], [np.nan]])}
    curves.update({m: np.asarray([[0.75], [0.0]]) for m in METRICS})
    out = str(tmp_path / "run")
    params = {"vision": {"W": np.zeros((2, 3), np.float32)}}
    results.write_files(out, config, settings, params, curves, np.asarray([-1, 7]))
    finite, diverged = results.load_run(out).results
    assert finite["unseen_acc"] == 0.75 and finite["diverged_step"] == -1
    assert diverged["diverged_step"] == 7
    for m in (*METRICS, "final_loss"):
        assert np.isnan(diverged[m]), m
    table = results.summary_table([finite, diverged], (), METRICS)
    assert "1 diverged model(s) excluded" in table and "nan" not in table.split("DIVERGED")[1]
