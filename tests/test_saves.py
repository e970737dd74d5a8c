"""Orbax saves (`jaxmech.saves`) and their integrity: every file of a step is checksummed
at save, damage anywhere is an error naming the file before Orbax reads anything,
`restore_latest` falls back past damaged steps, legacy steps (no manifest) and saves
written before the module's rename still load, and Orbax's 'Event loop is closed' noise
after a failed read stays off stderr. Small numpy pytrees, no training."""

import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from jaxmech import saves


def _state(k: int) -> dict:
    """A small pytree whose values depend on `k`, so steps are told apart."""
    return {
        "w": k + np.arange(600, dtype=np.float32).reshape(20, 30),
        "b": {"n": k * np.arange(7, dtype=np.int32), "s": np.float32(k)},
    }


def _meta(k: int) -> dict:
    return {"step": k, "config": {"d_model": 16, "name": "tiny"}, "settings": [1, 2]}


def _assert_same(got: dict, want: dict) -> None:
    flat_got, flat_want = _flat(got), _flat(want)
    assert flat_got.keys() == flat_want.keys()
    for k in flat_want:
        assert np.asarray(flat_got[k]).dtype == np.asarray(flat_want[k]).dtype, k
        np.testing.assert_array_equal(flat_got[k], flat_want[k], err_msg=k)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: v})
    return out


def _files(step_dir: str) -> list[str]:
    """Absolute paths of all files of a step folder, manifest included."""
    return sorted(
        os.path.join(root, name) for root, _, names in os.walk(step_dir) for name in names
    )


def _data_file(directory: str, step: int) -> str:
    """The largest file of `state/d/`: the array data Orbax reads on restore."""
    d = os.path.join(directory, str(step), "state", "d")
    return max((os.path.join(d, n) for n in os.listdir(d)), key=os.path.getsize)


def _flip(path: str, where: str) -> None:
    """XOR-flips one byte at the start, middle or end of the file."""
    data = bytearray(open(path, "rb").read())
    i = {"start": 0, "middle": len(data) // 2, "end": len(data) - 1}[where]
    data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _damage(path: str, how: str) -> None:
    if how == "truncate":
        _truncate(path)
    elif how == "delete":
        os.remove(path)
    else:
        _flip(path, how)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A folder with step 1 saved once; tests damage copies of it."""
    d = str(tmp_path_factory.mktemp("saved") / "save")
    saves.save(d, 1, _state(1), _meta(1))
    return d


@pytest.mark.parametrize("how", ["start", "middle", "end", "truncate", "delete"])
def test_damage_to_any_file_is_named_before_orbax_reads(saved, tmp_path, how, monkeypatch):
    # Orbax must not be reached: opening a manager fails the test.
    def no_orbax(*_, **__):
        raise AssertionError("Orbax was reached despite damage")

    monkeypatch.setattr(saves.ocp, "CheckpointManager", no_orbax)
    names = [os.path.relpath(f, saved) for f in _files(os.path.join(saved, "1"))]
    assert os.path.join("1", saves.MANIFEST) in names
    if how == "delete":  # a step without its manifest is legacy (tested below)
        names.remove(os.path.join("1", saves.MANIFEST))
    for i, name in enumerate(names):
        copy = str(tmp_path / f"c{i}")
        shutil.copytree(saved, copy)
        path = os.path.join(copy, name)
        _damage(path, how)
        with pytest.raises(saves.SaveError, match="damaged") as err:
            saves.restore(copy, 1)
        assert path in str(err.value), (name, str(err.value))


def test_intact_step_restores_exactly(saved):
    assert saves.verify(saved, 1) is True
    state, meta = saves.restore(saved, like=_state(0))
    _assert_same(state, _state(1))
    assert meta == _meta(1)
    state, meta, step = saves.restore_latest(saved, log=pytest.fail)
    assert step == 1 and meta == _meta(1)
    _assert_same(state, _state(1))


def test_legacy_step_without_manifest_restores_unchecked(saved, tmp_path):
    copy = str(tmp_path / "legacy")
    shutil.copytree(saved, copy)
    os.remove(os.path.join(copy, "1", saves.MANIFEST))
    assert saves.verify(copy, 1) is False
    state, meta = saves.restore(copy)
    _assert_same(state, _state(1))
    assert meta == _meta(1)


def test_a_save_from_before_the_rename_restores(saved, tmp_path):
    # Saves written when the module was `jaxmech.checkpoint` carry this manifest format
    # (the literal, not the module's constant: renaming it would call them all damaged).
    path = os.path.join(saved, "1", saves.MANIFEST)
    with open(path) as fh:
        assert json.load(fh)["format"] == "jaxmech-checkpoint-manifest/1"
    state, meta = saves.restore(saved, 1, like=_state(0))
    _assert_same(state, _state(1))
    # ... and the format is checked, so another one would not be accepted silently
    copy = str(tmp_path / "other_format")
    shutil.copytree(saved, copy)
    path = os.path.join(copy, "1", saves.MANIFEST)
    with open(path) as fh:
        body = json.load(fh)
    with open(path, "w") as fh:
        json.dump(body | {"format": "jaxmech-save-manifest/1"}, fh)
    with pytest.raises(saves.SaveError, match="manifest is damaged"):
        saves.restore(copy, 1)


def test_manifests_stay_valid_across_later_saves_and_cleanup(tmp_path):
    d = str(tmp_path / "save")
    for step in (1, 2, 3):
        saves.save(d, step, _state(step), _meta(step), max_to_keep=2)
    assert sorted(os.listdir(d)) == ["2", "3"]  # max_to_keep still drops whole steps
    assert saves.latest_step(d) == 3
    # Orbax rewrote nothing of step 2 when saving step 3 or opening the manager again.
    assert saves.verify(d, 2) is True and saves.verify(d, 3) is True


def test_restore_latest_falls_back_past_a_damaged_step(tmp_path):
    d = str(tmp_path / "checkpoints" / "chunk_0000")
    saves.save(d, 1, _state(1), _meta(1))
    saves.save(d, 2, _state(2), _meta(2))
    bad = _data_file(d, 2)
    _flip(bad, "middle")
    lines = []
    state, meta, step = saves.restore_latest(d, like=_state(0), log=lines.append)
    assert step == 1 and meta == _meta(1)
    _assert_same(state, _state(1))
    assert len(lines) == 1 and bad in lines[0] and "falling back to step 1" in lines[0]
    assert saves.latest_step(d) == 1  # out of Orbax's view
    # The same step number saves and restores again.
    saves.save(d, 2, _state(3), _meta(3))
    state, meta, step = saves.restore_latest(d, log=pytest.fail)
    assert step == 2 and meta == _meta(3)
    _assert_same(state, _state(3))


def test_restore_latest_with_every_step_damaged_is_none(tmp_path):
    d = str(tmp_path / "save")
    bad = []
    for step in (1, 2):
        saves.save(d, step, _state(step), _meta(step))
        bad.append(_data_file(d, step))
        _truncate(bad[-1])
    lines = []
    assert saves.restore_latest(d, log=lines.append) is None
    assert len(lines) == 2
    assert bad[1] in lines[0] and "falling back to step 1" in lines[0]
    assert bad[0] in lines[1] and "no older step" in lines[1]
    assert saves.latest_step(d) is None
    assert saves.restore_latest(str(tmp_path / "none"), log=pytest.fail) is None


def test_unraisable_filter_drops_only_closed_loop_noise():
    passed = []
    hook = saves._without_closed_loop_noise(passed.append)
    for exc in (
        RuntimeError("Event loop is closed"),
        RuntimeError("something else"),
        ValueError("Event loop is closed"),
    ):
        hook(types.SimpleNamespace(exc_value=exc))
    assert [repr(u.exc_value) for u in passed] == [
        "RuntimeError('something else')",
        "ValueError('Event loop is closed')",
    ]


def test_orbax_failure_on_legacy_step_prints_one_clean_error(saved, tmp_path):
    # A legacy step is not checked, so Orbax itself fails on the truncated data file.
    copy = str(tmp_path / "legacy")
    shutil.copytree(saved, copy)
    os.remove(os.path.join(copy, "1", saves.MANIFEST))
    _truncate(_data_file(copy, 1))
    code = "import sys\nfrom jaxmech import saves\nsaves.restore(sys.argv[1], 1)"
    run = subprocess.run(
        [sys.executable, "-c", code, copy], capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0
    assert "Event loop is closed" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxmech.saves.SaveError: save step 1"), last
