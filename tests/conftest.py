"""Shared test setup: how the suite compiles (one persistent XLA compilation cache for
the xdist workers and the CLI subprocesses they start, machine code at -O0), the tiny
configs most tests train (shared, so their compiled programs are reused), and an
interrupting log callback for resume tests."""

import os
import tempfile

# Set before JAX starts; xdist workers and the CLI subprocesses the tests start inherit
# the environment, so a program compiled by one is a cache hit for the others.
_CACHE = os.environ.get("JAXMECH_CACHE_DIR") or tempfile.mkdtemp(prefix="jaxmech-test-xla-")
os.environ["JAXMECH_CACHE_DIR"] = _CACHE

# The suite is compile-bound (BUILD_NOTES, "The test suite"): LLVM at -O0 compiles the
# same XLA programs (HLO passes, fusion, layouts unchanged) in about half the time, into
# slower machine code whose float rounding may differ from a default build's. Every test
# compares runs within the suite, never with numbers from a default build. The slow set
# (any -m other than the default 'not slow') is run-time-bound and keeps XLA's default
# level, as does JAXMECH_TEST_OPT=default.
_O0 = "--xla_backend_optimization_level=0"


def pytest_configure(config):
    # before any test computes (JAX reads XLA_FLAGS when its backend starts), and
    # before xdist starts its workers, which inherit the environment
    suite = config.getoption("markexpr") == "not slow"
    flags = os.environ.get("XLA_FLAGS", "")
    if suite and os.environ.get("JAXMECH_TEST_OPT") != "default" and _O0 not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_O0}".strip()


# The suite's processes run on one CPU device, as its in-process tests do (JAX's
# default; entry points would take one per core: `sizing.cpu_devices`), so that a CLI
# subprocess's sweep is the same program as the in-process run it is compared with.
os.environ["JAXMECH_CPU_DEVICES"] = "1"


def subprocess_env(devices: int | None = None) -> dict:
    """The environment for a CLI subprocess: this one's (the shared compile cache, the
    XLA flags, one CPU device), with `devices` CPU devices if given (through the entry
    points' own setting, `sizing.cpu_devices`)."""
    env = dict(os.environ)
    if devices is not None:
        env["JAXMECH_CPU_DEVICES"] = str(devices)
    return env


import jax  # noqa: E402

from jaxmech.cli import enable_compilation_cache  # noqa: E402

enable_compilation_cache()
# Every program goes to the cache, also the small ones of eager ops (~5000 in a run, half
# the compile time): what one worker compiled, the other and the subprocesses read.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

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


# The tiny autoregressive VLM on the scenes task (`model_kind = "toy_vlm"`): small enough
# to compile and train in seconds. The VLM tests share it (and so its compiled programs
# and the eager ops of its data: `train.build_data` on this task is built once per shape).
TINY_VLM = dict(
    task_kind="scenes",
    model_kind="toy_vlm",
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
    """A sweep log callback that interrupts after n progress lines (n saves)."""
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


def kill_after_first_save(proc, out):
    """SIGKILLs a sweep subprocess writing `out` once its first chunk's first save
    exists (kill -9: no handler runs), and checks it had not finished."""
    import signal
    import time

    from jaxmech import saves

    # "checkpoints": the saves' folder name on disk (`sweep.runs.SAVES`)
    chunk = os.path.join(out, "checkpoints", "chunk_0000")
    deadline = time.time() + 300
    while time.time() < deadline and saves.latest_step(chunk) is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(os.path.join(out, "results.csv")), "finished before the kill"


import pytest  # noqa: E402


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures `jaxmech.plots.save` writes during a test, in order (closed, but
    their axes, lines and texts still readable): a figure's labels are checked on
    matplotlib's objects, not its pixels."""
    from jaxmech import plots

    figs, real = [], plots.save
    monkeypatch.setattr(plots, "save", lambda fig, path: figs.append(fig) or real(fig, path))
    return figs


def texts(fig) -> str:
    """Every text a figure shows: titles, axis labels, legend entries, free texts."""
    out = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in ax.texts]
        out += [t.get_text() for t in ax.get_yticklabels() + ax.get_xticklabels()]
        legend = ax.get_legend()
        out += [t.get_text() for t in legend.get_texts()] if legend else []
    return "\n".join(out)


def block_scan(eqn) -> bool:
    """Whether a jaxpr equation is a scan over blocks (or layers), not the attention
    core's map over heads (`models.attention_core`, on a CPU)."""
    from jaxmech.models.attention_core import SCOPE

    return eqn.primitive.name == "scan" and SCOPE not in str(eqn.source_info.name_stack)
