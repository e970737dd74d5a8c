"""Output folders: one writer at a time, a resumable --overwrite, clean failure."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import TINY, Interrupted, file_bytes, quiet, stop_after, tiny_config

from jaxmech import outdir, results
from jaxmech.outdir import FolderLockedError
from jaxmech.sweep import expand, run_grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grid(steps=40, n_pair="3,5", seeds=2):
    return expand(tiny_config(steps=steps, eval_every=10), {"n_pair": n_pair}, seeds=seeds)


def _hold_lock(out):
    """A child process that holds `out`'s lock until killed; returns it once it holds."""
    code = (
        "import sys, time\n"
        "from jaxmech import outdir\n"
        "with outdir.locked(sys.argv[1]):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(300)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, out], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_and_a_killed_writers_lock_taken_over(tmp_path):
    out = str(tmp_path / "run")
    holder = _hold_lock(out)
    try:
        with pytest.raises(FolderLockedError, match=f"process {holder.pid} on"):
            run_grid(_grid(steps=20), out, log=quiet)
        assert not os.path.exists(out)  # refused before anything was written
    finally:
        holder.send_signal(signal.SIGKILL)  # as kill -9: the lock file stays behind
        holder.wait()
    assert os.path.exists(outdir.lock_path(out))
    lines = []
    run_grid(_grid(steps=20), out, log=lines.append)
    assert any(f"taking over the lock left by process {holder.pid}" in ln for ln in lines)
    assert os.path.isfile(os.path.join(out, "results.csv"))
    assert not os.path.exists(outdir.lock_path(out))  # released when done


def test_the_cli_prints_a_busy_folder_once_as_its_last_line(tmp_path):
    out = str(tmp_path / "run")
    holder = _hold_lock(out)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.sweep", f"--out={out}", "--n_pair=3,5"]
            + [f"--{k}={v}" for k, v in TINY.items() if k != "n_pair_labels"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"process {holder.pid}" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr


def test_an_interrupted_overwrite_resumes_and_replaces_only_when_finished(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("old")
    grid = _grid()  # 4 models: one chunk of 4, 40 steps
    with pytest.raises(Interrupted):
        run_grid(grid, str(out), overwrite=True, log=stop_after(2))  # at step 20
    assert (out / "notes.txt").read_text() == "old"  # untouched until the new run is whole
    resumed = run_grid(grid, str(out), overwrite=True, log=quiet)
    assert resumed["trained_steps"] == 4 * 20  # resumed at step 20, not restarted
    assert not (out / "notes.txt").exists() and (out / "results.csv").is_file()
    assert os.listdir(tmp_path) == ["run"]  # no staging, old, temporary or lock left behind
    assert not (out / "checkpoints").exists()
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == (0o777 & ~umask)  # as any new folder, not 0700
    first = file_bytes(out / "results.csv")
    # --overwrite on this very sweep, finished: the user asked for a fresh run
    again = run_grid(grid, str(out), overwrite=True, log=quiet)
    assert again["trained_steps"] == 4 * 40
    assert file_bytes(out / "results.csv") == first  # and it is the same (same machine, program)


def test_a_regular_file_as_out_is_refused_untouched(tmp_path):
    path = tmp_path / "results.txt"
    path.write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="is a file, not a folder"):
            run_grid(_grid(steps=20), str(path), overwrite=overwrite, log=quiet)
    assert path.read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["results.txt"]


def test_chunk_size_zero_is_refused_before_anything_is_written(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(ValueError, match="chunk_size = 0 is invalid"):
        run_grid(_grid(steps=20), out, chunk_size=0, log=quiet)
    assert not os.path.exists(out)


def test_a_finished_run_folder_loads_after_an_interrupted_swap(tmp_path):
    """A crash between moving the old folder aside and putting the new one in place
    leaves the finished run in the staging folder; the next --overwrite publishes it."""
    out = str(tmp_path / "run")
    grid = _grid(steps=20)
    run_grid(grid, out, log=quiet)
    staging = outdir.staging_path(out)
    os.rename(out, staging)  # as if killed after the first rename of the swap
    again = run_grid(grid, out, overwrite=True, log=quiet)
    assert again["trained_steps"] == 0
    assert results.load_run(out).config == grid.config
    assert not os.path.exists(staging)


def test_a_failed_save_write_is_one_error_line_last(tmp_path, monkeypatch, capsys):
    """A full disk mid-run (simulated): the entry point prints the error once, last."""
    import orbax.checkpoint as ocp
    from absl import flags

    from experiments import sweep as entry

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    out = str(tmp_path / "run")
    argv = [
        entry.__file__,
        f"--out={out}",
        "--n_pair=3,5",
        "--seeds=1",
        "--steps=10",
        "--eval_every=10",
    ]
    argv += [f"--{k}={v}" for k, v in TINY.items() if k != "n_pair_labels"]
    try:
        with pytest.raises(SystemExit) as e:
            from jaxmech.cli import run_main

            monkeypatch.setattr(sys, "argv", argv)
            flags.FLAGS.unparse_flags()
            run_main(entry.main)
    finally:
        flags.FLAGS.unparse_flags()
    assert e.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: could not write save step 10") and "No space" in last
    assert not os.path.exists(os.path.join(out, "results.csv"))
