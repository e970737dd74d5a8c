"""`python -m experiments.bench --real_size --reference`: jaxmech's forward beside the
reference's (transformers), each in its own process (`bench.real_size.against_reference`).

The comparison itself needs a python with torch and transformers (the `fixtures`
extra): this one if it has them, else `$JAXMECH_REFERENCE_PYTHON`; without one (CI) that
test is skipped. The refusals run everywhere."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxmech.bench import real_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "qwen2_vl", "qwen2_vl")
HAS_REFERENCE = all(importlib.util.find_spec(m) for m in real_size.REFERENCE_MODULES)


def test_without_the_reference_the_flags_are_named():
    """A python that cannot import torch / transformers is refused by name, and the
    command stops before anything runs (no stand-in written)."""
    with pytest.raises(ValueError, match="--reference_python=/no/such/python.*fixtures"):
        real_size.reference_python("/no/such/python")
    if not HAS_REFERENCE:
        with pytest.raises(ValueError, match="fixtures.*--reference_python="):
            real_size.reference_python(None)


def test_the_command_refuses_before_writing(tmp_path):
    folder = tmp_path / "stand_in"
    cmd = [sys.executable, "-m", "experiments.bench", "--real_size", "--reference",
           f"--real_dir={folder}", "--reference_python=/no/such/python"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode != 0 and "--reference_python=/no/such/python" in done.stderr
    assert not folder.exists()


@pytest.mark.skipif(
    not (HAS_REFERENCE or os.environ.get("JAXMECH_REFERENCE_PYTHON")),
    reason="no python with torch and transformers (the fixtures extra): set "
    "JAXMECH_REFERENCE_PYTHON=/path/to/venv/bin/python to run it",
)
def test_the_forwards_side_by_side_on_the_tiny_fixture(tmp_path):
    """On the Qwen2-VL fixture in float32 (~25 s: two processes, each importing its
    library): both sides timed, their ratio, peak memory each, and the two forwards'
    answer-row log-probabilities equal within float32's reference bound."""
    python = real_size.reference_python(os.environ.get("JAXMECH_REFERENCE_PYTHON"))
    (row,) = real_size.against_reference(FIXTURE, python, str(tmp_path), ("float32",),
                                         repeats=1, size=112, log=lambda *_: None)  # fmt: skip
    for side in ("jaxmech", "reference"):
        assert row[f"{side}_median_s"] > 0 and row[f"{side}_first_s"] > 0
        assert 0.05 < row[f"{side}_peak_gb"] < 4  # each its own process
    assert row["ratio"] == row["jaxmech_median_s"] / row["reference_median_s"]
    assert row["max_logp_diff"] < 1e-4 and row["top5_same"]
    assert row["products"].startswith("float32")
