"""Sweeps over several processes (`--distributed`, `jax.distributed`): the flags and
their refusals, which process writes (a faked process index), and, as `slow` tests, two
real processes on localhost (gloo CPU collectives) against one process."""

import os
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from conftest import TINY, file_bytes, quiet, subprocess_env, tiny_config

from jaxmech import outdir, results, saves, sweep
from jaxmech.cli import distributed_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_FLAGS = [f"--{k}={v}" for k, v in TINY.items() if k != "n_pair_labels"]


def _flags(distributed=True, coordinator_address=None, num_processes=None, process_id=None):
    return types.SimpleNamespace(**locals())


@pytest.fixture
def no_peer_env(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_distributed_flags_give_initialize_its_arguments(no_peer_env):
    assert distributed_args(_flags(distributed=False)) is None
    assert distributed_args(_flags()) == {}  # a pod, SLURM, Open MPI: JAX finds its peers
    got = distributed_args(_flags(coordinator_address="localhost:1234", num_processes=2,
                                  process_id=1))  # fmt: skip
    assert got == {"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1}
    no_peer_env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.2:8476")
    no_peer_env.setenv("JAX_NUM_PROCESSES", "4")
    no_peer_env.setenv("JAX_PROCESS_ID", "3")
    env = distributed_args(_flags())
    assert env == {"coordinator_address": "10.0.0.2:8476", "num_processes": 4, "process_id": 3}
    assert distributed_args(_flags(process_id=0))["process_id"] == 0  # the flag wins


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(num_processes=2, process_id=0), "also give --coordinator_address"),
        (dict(coordinator_address="h:1", process_id=0), "also give --num_processes"),
        (dict(coordinator_address="h:1", num_processes=2), "also give --process_id"),
        (
            dict(coordinator_address="h:1", num_processes=2, process_id=2),
            "--process_id=2: allowed 0 .. 1",
        ),  # fmt: skip
        (dict(coordinator_address="h:1", num_processes=2, process_id=-1), "--process_id=-1"),
        (dict(coordinator_address="h:1", num_processes=0, process_id=0), "--num_processes=0"),
        (dict(coordinator_address="localhost", num_processes=2, process_id=0), "HOST:PORT"),
        (dict(distributed=False, process_id=0), "--process_id is read with --distributed only"),
    ],
)
def test_bad_distributed_flags_are_refused_naming_the_flag(no_peer_env, given, message):
    with pytest.raises(ValueError, match=message):
        distributed_args(_flags(**given))


def test_a_bad_peer_environment_variable_is_named(no_peer_env):
    no_peer_env.setenv("JAX_PROCESS_ID", "one")
    with pytest.raises(ValueError, match=r"--process_id: \$JAX_PROCESS_ID='one'"):
        distributed_args(_flags(coordinator_address="h:1", num_processes=2))


def test_cli_refuses_bad_distributed_flags_before_compute(tmp_path):
    """In-process, as test_sweep's CLI refusals: a usage error, nothing joined or written."""
    from absl import app

    from experiments import sweep as entry

    out = str(tmp_path / "never")
    argv = [entry.__file__, f"--out={out}", "--distributed", "--coordinator_address=h:1",
            "--num_processes=2", "--process_id=5"]  # fmt: skip
    try:
        entry.FLAGS(argv)
        with pytest.raises(app.UsageError, match="--process_id=5: allowed 0 .. 1"):
            entry.main([])
    finally:
        entry.FLAGS.unparse_flags()
    assert not os.path.exists(out) and not jax.distributed.is_initialized()


# slow: a faked process 1 training a sweep (~10 s); the 2-process test (slow) checks the same on real processes, the error hand-off stays in the suite
@pytest.mark.slow
def test_only_process_0_writes_the_folder(tmp_path, monkeypatch):
    """A process other than 0 trains (its devices' share) and writes nothing: no lock,
    no sweep.json, no saves, no results (here it is alone, so it trains all)."""
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    out = tmp_path / "run"
    grid = sweep.expand(tiny_config(steps=40), {"n_pair": "3,5"}, seeds=2)
    got = sweep.run_grid(grid, str(out), log=quiet)
    assert not got["writer"] and got["rows"] is None and got["trained_steps"] == 4 * 40
    assert sorted(os.listdir(tmp_path)) == []  # not `out`, not `.run.lock`, nothing


def test_an_error_on_process_0_stops_the_others(monkeypatch):
    told = []
    monkeypatch.setattr(sweep.processes, "_share", lambda x: told.append(int(x)) or x)

    def fails():
        raise saves.SaveError("damaged")

    with pytest.raises(saves.SaveError):  # process 0: its own error ...
        sweep.processes._on_writer(fails, np.int32(0))
    assert told == [2]  # ... after telling the others
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(sweep.processes, "_share", lambda x: np.int32(2))
    with pytest.raises(sweep.OtherProcessError, match="process 0"):
        sweep.processes._on_writer(lambda: pytest.fail("only process 0 reads"), np.int32(0))


# --- two real processes on localhost -------------------------------------------------

SWEEP = ["--eval_every=10", "--n_pair=3,5", "--seeds=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cmd(out, steps, *extra, sweep=tuple(SWEEP)):
    return [sys.executable, "-m", "experiments.sweep", f"--out={out}", *TINY_FLAGS, *sweep,
            f"--steps={steps}", *extra]  # fmt: skip


def _start_pair(out, steps, log_dir, tag, sweep=tuple(SWEEP)):
    """Two processes of one sweep (`sweep`: its flags), started as a pod starts them
    (coordinator, count, id), one CPU device each: 2 devices in all."""
    port, procs = _free_port(), []
    for i in range(2):
        peers = ["--distributed", f"--coordinator_address=localhost:{port}",
                 "--num_processes=2", f"--process_id={i}"]  # fmt: skip
        log = open(os.path.join(log_dir, f"{tag}_{i}.log"), "w")
        cmd = _cmd(out, steps, *peers, sweep=sweep)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(1), stdout=log,
                                      stderr=subprocess.STDOUT))  # fmt: skip
    return procs


def _finish_pair(procs, log_dir, tag, timeout=600):
    """(return codes, each process's output) once both have exited."""
    codes = [p.wait(timeout=timeout) for p in procs]
    texts = []
    for i in range(2):
        with open(os.path.join(log_dir, f"{tag}_{i}.log")) as f:
            texts.append(f.read())
    return codes, texts


def _one_process(out, steps, sweep=tuple(SWEEP)):
    """The same sweep in one process on 2 CPU devices."""
    proc = subprocess.run(_cmd(out, steps, sweep=sweep), cwd=ROOT, env=subprocess_env(2),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def _assert_same_run(a, b):
    for name in ("results.csv", "curves.csv"):
        assert file_bytes(os.path.join(a, name)) == file_bytes(os.path.join(b, name)), name
    ra, rb = results.load_run(a), results.load_run(b)
    flat_a = jax.tree_util.tree_flatten_with_path(ra.params)[0]
    for (path, x), y in zip(flat_a, jax.tree_util.tree_leaves(rb.params), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    """Slow (100-200 s on a shared 2-core machine): three CLI processes, each compiling
    the sharded program at XLA's default level, two of them at once. The 2-process sweep's results.csv, curves.csv and
    params equal the 1-process run's on as many devices, bit for bit; only process 0
    writes; a second launch into the finished folder trains nothing."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _one_process(one, 40)
    codes, texts = _finish_pair(_start_pair(two, 40, tmp_path, "a"), tmp_path, "a")
    assert codes == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    assert "2 cpu device(s)" in texts[0] and "results:" in texts[0]
    assert "results:" not in texts[1]  # process 1 wrote no summary and said nothing
    _assert_same_run(one, two)
    codes, texts = _finish_pair(_start_pair(two, 40, tmp_path, "b"), tmp_path, "b")
    assert codes == [0, 0] and "already finished" in texts[0]


@pytest.mark.slow
def test_two_processes_killed_then_restarted_resume_to_the_same_results(tmp_path):
    """Slow (45-240 s on a shared 2-core machine): a 2-process sweep is refused a folder
    another 2-process sweep is writing (both its processes stop with a message); one
    process of the running sweep is killed (-9) after the first save, then its peer
    (as a pod's scheduler would); both restarted resume and end equal to an uninterrupted
    run."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "run")
    steps = 200  # the first pair must still be training when it is stopped
    first = _start_pair(out, steps, tmp_path, "first")
    chunk = os.path.join(out, "checkpoints", "chunk_0000")
    deadline = time.time() + 300
    while saves.latest_step(chunk) is None and time.time() < deadline:
        time.sleep(0.05)
    for p in first:
        p.send_signal(signal.SIGSTOP)  # holds the lock while the second pair tries
    codes, texts = _finish_pair(_start_pair(out, steps, tmp_path, "second"), tmp_path, "second")
    assert codes == [1, 1], texts
    assert "is being written by" in texts[0] and "process 0 of this multi-process" in texts[1]
    first[1].kill()  # one process dies ...
    first[0].kill()  # ... and the scheduler stops its peer
    for p in first:
        p.wait()
    assert not outdir.is_finished(out) and saves.latest_step(chunk) is not None
    codes, texts = _finish_pair(_start_pair(out, steps, tmp_path, "again"), tmp_path, "again")
    assert codes == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    _one_process(ref, steps)
    _assert_same_run(ref, out)
