"""A real-size check anyone can run: a random checkpoint with a real model's config,
tensor names, shapes and file layout (its family's `stand_in.write`; for Qwen2-VL,
Qwen2-VL-2B-Instruct's), and every checkpoint report run on it in its own process,
with its peak resident memory (from the OS), wall time and the plan the sizing logged.

* `run_reports(folder, out)`: `experiments.ask` and each paper 003 / 004 report on it
  (`REPORTS`, with `--questions=2`, two LM layers, bfloat16), one subprocess each; one
  row per command: wall seconds, peak resident GB (`memory.peak_run`), the plan's GB and the
  first chunk's measured GB where the log states them.

No real weights: the values are random, so the answers mean nothing; memory and time
are what a real download of the same size costs.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

from jaxmech.families.registry import stand_in_family
from jaxmech.memory import peak_run

# (entry point, extra flags): each paper 003 / 004 report, small. Patching at the
# default 448 px 4 x 4 scenes; the probe reports (hundreds of probe pictures each) and
# the counterfactual table (80 conditions) at 2 x 2 scenes of 56 px
SMALL = ["--grid=2x2", "--size=56"]
REPORTS = (
    ("patching", ["--layers=6:8"]),
    ("spatial_ids", ["--layers=6:8", *SMALL]),
    ("steering", ["--layers=6:8", *SMALL]),
    ("diagnostics", ["--layers=6:8", *SMALL]),
    ("counterfactuals", SMALL),
)


def write_stand_in(folder: str, family: str | None = None, log=print):
    """(folder, the real model's name): the family's real-size random checkpoint written
    into `folder` (once; `registry.stand_in_family`), or ValueError if it has none."""
    fam = stand_in_family(family)
    if fam.stand_in.write is None:
        raise ValueError(f"family = {fam.name!r} has no real-size stand-in (stand_in.write)")
    return fam.stand_in.write(folder, log=log), fam.stand_in.real_name or fam.name


def _gb_after(pattern: str, text: str) -> float:
    m = re.findall(pattern + r" ([0-9.]+) GB", text)
    return float(m[-1]) if m else float("nan")


def run_reports(folder: str, out: str, dtype: str = "bfloat16", questions: int = 2,
                reports=REPORTS, log=print) -> list[dict]:  # fmt: skip
    """`experiments.ask` and each of `reports` on checkpoint `folder`, one subprocess
    each (results and logs under `out`); one row per command (module docstring). Each
    compiles cold: a compilation cache of its own (so a rerun times what a first run
    costs), which its run's compiles may reuse from its sizing."""
    from jaxmech.data import pictures
    from jaxmech.data.spec import Grid, pair_questions

    os.makedirs(out, exist_ok=True)
    grid = Grid(4, 4)
    spec = pair_questions(grid, 1, len(pictures.SHAPES), len(pictures.COLOURS))["examples"]
    image = os.path.join(out, "scene.png")
    from PIL import Image

    Image.fromarray(pictures.draw(grid, spec, 448)[0]).save(image)
    question = pictures.questions(spec)[0]
    common = [f"--checkpoint={folder}", f"--dtype={dtype}"]
    runs = [("ask", [f"--image={image}", f"--question={question}"])]
    runs += [(r, [*flags, f"--questions={questions}", f"--out={out}"]) for r, flags in reports]
    rows = []
    for name, flags in runs:
        cmd = [sys.executable, "-m", f"experiments.{name}", *common, *flags]
        log(f"  running {' '.join(cmd[2:])}")
        cache = tempfile.mkdtemp(prefix="jaxmech_cache_")
        env = os.environ | {"JAXMECH_CACHE_DIR": cache}
        code, wall, peak, text = peak_run(cmd, os.path.join(out, f"{name}.log"), env)
        shutil.rmtree(cache, ignore_errors=True)
        row = {
            "command": name,
            "exit": code,
            "wall_s": wall,
            "peak_gb": peak,
            "plan_gb": _gb_after("plan", text),
            "first_chunk_gb": _gb_after("the first chunk peaked at", text),
        }
        rows.append(row)
        log(
            f"    exit {code}, {wall:.0f} s, peak {peak:.2f} GB resident, plan {row['plan_gb']:.2f} GB"
        )
        if code:
            log("    " + "\n    ".join(text.strip().splitlines()[-5:]))
    return rows
