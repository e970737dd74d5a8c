"""A real-size check anyone can run: a random checkpoint with a real model's config,
tensor names, shapes and file layout (its family's `stand_in.write`; for Qwen2-VL,
Qwen2-VL-2B-Instruct's), and every checkpoint report run on it in its own process,
with its peak resident memory (from the OS), wall time and the plan the sizing logged.

* `run_reports(folder, out)`: `experiments.ask` and each paper 003 / 004 report on it
  (`REPORTS`, with `--questions=2`, two LM layers, bfloat16), one subprocess each; one
  row per command: wall seconds, peak resident GB (`memory.peak_run`), the plan's GB and the
  first chunk's measured GB where the log states them.

* `against_reference(folder, python, out)`: jaxmech's forward and the reference's
  (transformers, sdpa; the stand-in family's `StandIn.reference_script --inputs`, run by
  `python`, an interpreter with torch and transformers: the `fixtures` extra) on the
  same folder and the same processed inputs, for each dtype, each side its own process:
  the first call apart, the median of `repeats` calls after it, peak resident memory,
  their ratio and the largest difference of the answer row's log-probabilities. The
  library never imports torch; jaxmech's side is `forward_time` (this module run as
  `python -m jaxmech.bench.real_size`).

No real weights: the values are random, so the answers mean nothing; memory and time
are what a real download of the same size costs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

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
    ("arbitrary_steering", ["--layers=6:8", *SMALL]),
    ("depth_diagnosis", ["--layers=6:8", *SMALL]),
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
    from jaxmech.data.inputs import pictures
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


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE_MODULES = ("torch", "transformers", "safetensors")


def reference_script(family: str | None = None) -> str:
    """The absolute path of the script that runs the reference's forward for `family`'s
    stand-ins (None: the default stand-in family; its `StandIn.reference_script`);
    ValueError naming `--family` where the family has none."""
    from jaxmech.families.registry import stand_in_family

    fam = stand_in_family(family)
    if not fam.stand_in.reference_script:
        raise ValueError(f"--reference: --family = {fam.name!r} has no scripted reference "
                         "forward (its StandIn.reference_script)")  # fmt: skip
    return os.path.join(ROOT, fam.stand_in.reference_script)


def reference_python(given: str | None, script: str | None = None) -> str:
    """The interpreter that runs the reference's forward (`script`, None:
    `reference_script()`): `given` (`--reference_python`) where it imports
    `REFERENCE_MODULES`, else this one where it does; ValueError naming the flag and the
    `fixtures` extra otherwise, or where the script (a source checkout's) is missing.
    Checked before anything runs."""
    script = script or reference_script()
    if not os.path.exists(script):
        raise ValueError(f"--reference runs {script}, a source checkout's "
                         "script: not found (run from a clone of the repository)")  # fmt: skip
    python = given or sys.executable
    probe = ("import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in "
             f"{REFERENCE_MODULES!r}) else 3)")  # fmt: skip
    try:
        code = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode
    except OSError as e:
        code = f"not runnable ({e.strerror})"
    if code == 0:
        return python
    need = ", ".join(REFERENCE_MODULES)
    if given:
        raise ValueError(f"--reference_python={given}: cannot import {need} (exit {code}); "
                         "give a python where the `fixtures` extra is installed")  # fmt: skip
    raise ValueError(f"--reference: this python ({sys.executable}) cannot import {need}; "
                     "install the `fixtures` extra (pip install -e '.[fixtures]') or give "
                     "a python that has it as --reference_python=/path/to/venv/bin/python")  # fmt: skip


def forward_time(folder: str, dtype: str, size: int, repeats: int, inputs_out: str,
                 logits_out: str) -> dict:  # fmt: skip
    """jaxmech's forward (every row's logits, as the reference's) on checkpoint `folder`
    in `dtype`, one drawn `size` px scene and its first question: the first call
    (compile included) timed apart, then `repeats` calls. Writes the processed inputs
    to `inputs_out` (.npz, the arrays `reference_speed.batch_from_arrays` reads) and the
    last row's float32 logits to `logits_out` (.npy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmech.data.inputs import pictures
    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.model import load
    from jaxmech.models.precision import describe

    grid = Grid(4, 4)
    spec = pair_questions(grid, 1, len(pictures.SHAPES), len(pictures.COLOURS))["examples"]
    t = time.perf_counter()
    model = load(folder, dtype=getattr(jnp, dtype))
    load_s = time.perf_counter() - t
    enc = model.encode([pictures.draw(grid, spec, size)[0]], [pictures.questions(spec)[0]])
    x = enc.inputs
    np.savez(inputs_out, tokens=np.asarray(x.tokens_BxS), valid=np.asarray(x.valid_BxS),
             pixels=np.asarray(x.pixels_BxPxF[0], np.float32), grid=np.asarray([enc.grid]),
             image_token_id=np.asarray(model.config.image_token_id))  # fmt: skip
    fwd = jax.jit(lambda p, x: model.family.forward(p, x, config=model.config)[0])
    t = time.perf_counter()
    logits = fwd(model.params, x).block_until_ready()
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fwd(model.params, x).block_until_ready()
        times.append(time.perf_counter() - t)
    np.save(logits_out, np.asarray(logits[:, -1], np.float32))
    return {"side": "jaxmech", "dtype": dtype, "load_s": load_s, "first_s": first,
            "times": times, "median_s": float(np.median(times)), "products": describe(dtype),
            "tokens": int(x.tokens_BxS.shape[1])}  # fmt: skip


def _result(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else {}


def _log_softmax(x):
    import numpy as np

    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def against_reference(folder: str, python: str, out: str, dtypes=("float32", "bfloat16"),
                      repeats: int = 3, size: int = 448, log=print,
                      script: str | None = None) -> list[dict]:  # fmt: skip
    """jaxmech's forward and the reference's (`script`, None: `reference_script()`, run
    on the same folder) on checkpoint `folder` (the stand-in family's layout),
    for each of `dtypes`, each side in its own process (`memory.peak_run`; jaxmech's
    with a compilation cache of its own, so its first call compiles), the reference's
    run by `python` (`reference_python`). One row per dtype: each side's first call,
    median of `repeats` calls after it and peak resident GB, jaxmech / reference, and
    the largest |log p difference| at the last row with whether the top 5 agree.
    Logs under `out`; a side that fails raises RuntimeError with its log's tail."""
    import numpy as np

    script = script or reference_script()
    os.makedirs(out, exist_ok=True)
    rows = []
    for dtype in dtypes:
        inputs, ours_path, theirs_path = (os.path.join(out, f"{n}_{dtype}.{e}") for n, e in
                                          (("inputs", "npz"), ("jaxmech_logits", "npy"),
                                           ("reference_logits", "npy")))  # fmt: skip
        cmds = {
            "jaxmech": [sys.executable, "-m", "jaxmech.bench.real_size", folder, dtype,
                        str(size), str(repeats), inputs, ours_path],
            "reference": [python, script, f"--checkpoint={folder}",
                          f"--dtype={dtype}", f"--inputs={inputs}", f"--repeats={repeats}",
                          f"--logits_out={theirs_path}"],
        }  # fmt: skip
        row = {"dtype": dtype}
        for side, cmd in cmds.items():
            log(f"  {side}, {dtype}: {' '.join(cmd)}")
            code, wall, peak, text = peak_run(cmd, os.path.join(out, f"{side}_{dtype}.log"))
            res = _result(text)
            if code or not res:
                tail = "\n    ".join(text.strip().splitlines()[-8:])
                raise RuntimeError(
                    f"the {side} forward ({dtype}) failed (exit {code}):\n    {tail}"
                )
            row |= {f"{side}_first_s": res["first_s"], f"{side}_median_s": res["median_s"],
                    f"{side}_peak_gb": peak}  # fmt: skip
            if side == "reference":
                row["threads"] = res["threads"]
            else:
                row["tokens"], row["products"] = res["tokens"], res["products"]
            log(f"    first call {res['first_s']:.2f} s, median {res['median_s']:.2f} s over "
                f"{len(res['times'])}, peak {peak:.2f} GB resident, {wall:.0f} s in all")  # fmt: skip
        ours, theirs = (
            _log_softmax(np.load(p).astype(np.float64)) for p in (ours_path, theirs_path)
        )
        top = lambda a: np.argsort(-a, -1)[:, :5]  # noqa: E731
        row |= {"ratio": row["jaxmech_median_s"] / row["reference_median_s"],
                "max_logp_diff": float(np.abs(ours - theirs).max()),
                "top5_same": bool((top(ours) == top(theirs)).all())}  # fmt: skip
        rows.append(row)
    return rows


def main(argv) -> None:
    """`python -m jaxmech.bench.real_size FOLDER DTYPE SIZE REPEATS INPUTS LOGITS`:
    `forward_time` in a process of its own, its result one `RESULT {json}` line."""
    folder, dtype, size, repeats, inputs, logits = argv
    # one device, no compilation cache (as `reference_speed.py`'s forwards): the first
    # call compiles
    res = forward_time(folder, dtype, int(size), int(repeats), inputs, logits)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
