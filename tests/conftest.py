"""Shared test setup: one persistent XLA compilation cache for the tests and the CLI
subprocesses they start (each distinct program compiles once per session), the tiny
configs most tests train (shared, so their compiled programs are reused), and an
interrupting log callback for resume tests."""

import os
import tempfile

_CACHE = os.environ.get("JAXMECH_CACHE_DIR") or tempfile.mkdtemp(prefix="jaxmech-test-xla-")
os.environ["JAXMECH_CACHE_DIR"] = _CACHE

from jaxmech.cli import enable_compilation_cache  # noqa: E402

enable_compilation_cache()

# The tiny 1D task and model most training tests use (flat config overrides).
TINY = dict(
    d_model=16,
    d_head=4,
    d_embed=16,
    batch_size=16,
    n_labels=8,
    n_val_labels=3,
    n_pair_labels=5,
    layouts_per_pair=5,
    image_len=6,
)


def tiny_config(**overrides):
    """The TINY config (20 steps, evaluated every 10) with flat overrides. Tests that
    share it share compiled programs: a run's length (`steps`, epochs) is not part of
    the program (`train.program_config`)."""
    from jaxmech.config import Config

    return Config().replace(**{**TINY, "steps": 20, "eval_every": 10, **overrides})


# The tiny autoregressive VLM on the scenes task (`model_kind = "ar_vlm"`): small enough
# to compile and train in seconds. The VLM tests share it (and so its compiled programs
# and the eager ops of its data: `train.build_data` on this task is built once per shape).
TINY_VLM = dict(
    task_kind="scenes",
    model_kind="ar_vlm",
    grid_h=3,
    grid_w=3,
    n_labels=8,
    n_val_labels=3,
    n_pair_labels=5,
    layouts_per_pair=10,
    n_colours=2,
    eval_size=64,
    d_model=16,
    d_head=4,
    n_heads=2,
    d_mlp=32,
    n_layers=1,
    lm_n_layers=1,
    batch_size=16,
    steps=20,
    eval_every=10,
)


def tiny_vlm_config(**overrides):
    """The TINY_VLM config with flat overrides (20 steps, evaluated every 10)."""
    from jaxmech.config import Config

    return Config().replace(**{**TINY_VLM, **overrides})


class Interrupted(Exception):
    """Raised by `stop_after`'s callback: a sweep stopped as if killed."""


def stop_after(n):
    """A sweep log callback that interrupts after n progress lines (n checkpoints)."""
    seen = []

    def log(line):
        if line.lstrip().startswith("chunk"):
            seen.append(line)
            if len(seen) >= n:
                raise Interrupted(line)

    return log


def quiet(*_):
    """A log callback that drops everything."""


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def flip_middle_byte(path):
    """Damages a file as a bad disk sector would: one byte in its middle changes."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def kill_after_first_checkpoint(proc, out):
    """SIGKILLs a sweep subprocess writing `out` once its first chunk's first checkpoint
    exists (kill -9: no handler runs), and checks it had not finished."""
    import signal
    import time

    from jaxmech import checkpoint

    ckpt = os.path.join(out, "checkpoints", "chunk_0000")
    deadline = time.time() + 300
    while time.time() < deadline and checkpoint.latest_step(ckpt) is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(os.path.join(out, "results.csv")), "finished before the kill"
