"""Families are imported lazily: `import jaxmech` and an entry point's `--help` import no
family package (only the registry, the contracts and the VLM view), and a family asked
for (by kind, by a folder's `model_type`, by a config of its kind, by a top-level export)
imports its own package and no other."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# the shared modules; `families.hf_vlm` and `families.fields`, the checkpoint families' kit,
# come with any of them
SHARED = {"jaxmech.families.registry", "jaxmech.families.contract", "jaxmech.families.vlm_view",
          "jaxmech.families.hf_vlm", "jaxmech.families.fields"}  # fmt: skip
FOLDER = REPO / "tests" / "fixtures" / "internvl" / "internvl"

HELP = """import runpy
sys.argv = ["patching", "--help"]
try:
    runpy.run_module("experiments.patching", run_name="__main__")
except SystemExit:
    pass"""

# (code, the family package it may add), run in this order in one interpreter
STEPS = [
    ("import jaxmech", None),
    (HELP, None),
    ("from jaxmech.families import get_family; get_family('llava')", "llava"),
    (
        f"from jaxmech.families.registry import read_checkpoint_config\n"
        f"read_checkpoint_config({str(FOLDER)!r})",
        "internvl",
    ),
    ("from jaxmech.config import Config; Config()", "dual_encoder"),
    ("jaxmech.dual_encoder.forward", None),  # imported by the step before
]


def family_modules_after_each(steps: list[str]) -> list[set[str]]:
    """The `jaxmech.families.*` modules a fresh interpreter holds after each step."""
    show = "print('FAMILIES', sorted(m for m in sys.modules if m.startswith('jaxmech.families.')))"
    code = "import sys\n" + "\n".join(f"{step}\n{show}" for step in steps)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("FAMILIES ")]
    return [set(eval(line.partition(" ")[2])) for line in lines]


def packages(modules: set[str]) -> set[str]:
    """The family packages (`jaxmech.families.NAME`) of the modules, the shared ones not."""
    return {".".join(m.split(".")[:3]) for m in modules - SHARED}


def test_a_family_is_imported_when_asked_for_and_alone():
    # one interpreter (~5 s: it imports JAX) for every step
    after = family_modules_after_each([code for code, _ in STEPS])
    assert len(after) == len(STEPS)
    before: set[str] = set()
    for (code, family), now in zip(STEPS, after):
        added = packages(now) - packages(before)
        assert added == ({f"jaxmech.families.{family}"} if family else set()), code
        before = now


def test_every_listed_family_is_what_its_listing_says():
    from jaxmech.families.registry import FAMILIES, LISTED, Listed, register

    for entry in LISTED:  # importing checks the name, the model_types, a config
        family = FAMILIES[entry.name]
        assert family.name == entry.name and FAMILIES.held()[entry.name] is family
    register(Listed("llava_twin", "jaxmech.families.llava.family", ("llava",)))
    try:
        with pytest.raises(RuntimeError, match="registry lists 'llava_twin'"):
            FAMILIES["llava_twin"]
    finally:
        FAMILIES.pop("llava_twin", None)
