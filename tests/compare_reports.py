"""Refactors keep the numbers: every report on the fixtures and small default toy runs,
with the code at two revisions, compared file by file (BUILD_NOTES, "Guarantees").

    python tests/compare_reports.py BEFORE [AFTER] [--work=/tmp/compare_reports]

Each revision is checked out as a git worktree under --work (AFTER defaults to the
working tree as committed at HEAD) and runs the same commands (`COMMANDS`, each its own
process, the persistent compile cache off); then every output file of one is compared
with the other's: byte for byte, except the logs, the chunk stores' file names (their
key hashes the checkpoint's path), whose arrays are compared instead, JSON / Markdown
lines naming a path or a wall time, and Orbax's own files (random names and
timestamps; the params they hold are read back into `results.csv`, compared). Not run by
the suite (~20 min on 2 cores); exits 1 when anything differs.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import numpy as np

QWEN = "tests/fixtures/qwen2_vl/qwen2_vl"
SMALL = ["--grid=2x2", "--questions=2"]
TOY_REPORTS = ("patching", "spatial_ids", "steering", "diagnostics", "counterfactuals",
               "vit_terms", "attribute_swapping")  # fmt: skip
CK_REPORTS = ("patching", "spatial_ids", "steering", "diagnostics", "counterfactuals",
              "attribute_swapping")  # fmt: skip


def commands(out: str) -> list[tuple[str, list[str]]]:
    """(name, argv after `python -m`) of every run, writing under `out`."""
    runs = [("train_dual", ["experiments.train", "--seeds=2", "--steps=300",
                            "--eval_every=100", f"--out={out}/dual"]),
            ("train_vlm", ["experiments.train", "--preset=vlm", "--seeds=2", "--steps=300",
                           "--eval_every=100", f"--out={out}/vlm"])]  # fmt: skip
    runs += [(f"toy_{r}", [f"experiments.{r}", f"--run={out}/dual"])
             for r in ("mechanism", "text_align")]  # fmt: skip
    runs += [(f"toy_{r}", [f"experiments.{r}", f"--run={out}/vlm"]) for r in TOY_REPORTS]
    for p in ("jaxmech", "authors"):
        runs += [(f"ck_{r}_{p}", [f"experiments.{r}", f"--checkpoint={QWEN}", *SMALL,
                                  "--size=112", f"--protocol={p}", f"--out={out}/ck_{r}_{p}"])
                 for r in CK_REPORTS]  # fmt: skip
    for ck in ("llava/llava", "gemma3/gemma3", "internvl/internvl", "mllama/mllama"):
        name = ck.split("/")[0]
        runs += [(f"{name}_{r}", [f"experiments.{r}", f"--checkpoint=tests/fixtures/{ck}",
                                  *SMALL, f"--out={out}/{name}_{r}"])
                 for r in ("patching", "counterfactuals")]  # fmt: skip
    runs += [("arbitrary", ["experiments.arbitrary_steering", "--checkpoint=tests/fixtures/"
                            "llava/llava", *SMALL, f"--out={out}/arbitrary"]),
             ("photos", ["experiments.counterfactuals", f"--checkpoint={QWEN}", "--size=112",
                         "--questions_from=coco_spatial",
                         "--data=tests/fixtures/datasets/whatsup", f"--out={out}/photos"])]  # fmt: skip
    return runs


def run_all(tree: str, out: str) -> dict:
    """Every command with the code in `tree`; {name: exit status}."""
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, JAXMECH_CACHE_DIR="", PYTHONPATH=tree)
    status = {}
    for name, argv in commands(out):
        with open(os.path.join(out, name + ".log"), "w") as log:
            status[name] = subprocess.call([sys.executable, "-m", *argv], cwd=tree, env=env,
                                           stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        print(f"  {os.path.basename(out)} {name}: exit {status[name]}", flush=True)
    return status


def _lines(path: str, volatile: tuple) -> list[str]:
    """A text output's lines without those naming one of the `volatile` strings (the
    trees' and outputs' paths, "wall")."""
    with open(path, errors="replace") as f:
        text = f.read()
    if path.endswith(".json"):
        text = json.dumps(json.loads(text), indent=1, sort_keys=True)
    return [ln for ln in text.splitlines() if not any(v in ln for v in volatile)]


def _chunks(root: str) -> dict:
    """{(folder, report, chunk file): path} of the chunk stores under `root`."""
    out = {}
    for dirpath, _, files in os.walk(root):
        if os.sep + "chunks" + os.sep in dirpath + os.sep:
            for f in files:
                if f.endswith(".npz"):
                    rel = os.path.relpath(dirpath, root).split(os.sep)
                    out[(rel[0], rel[1], f)] = os.path.join(dirpath, f)
    return out


def compare(a: str, b: str, volatile: tuple = ()) -> list[str]:
    """What differs between the outputs under `a` and `b` (empty: nothing); lines naming
    a `volatile` string (or `a`, `b`, "wall") are left out of text files' comparison."""
    volatile = (a, b, "wall", *volatile)
    bad = []
    A, B = _chunks(a), _chunks(b)
    for k in sorted(set(A) | set(B)):
        if k not in A or k not in B:
            bad.append(f"chunk {k}: only in one")
            continue
        x, y = np.load(A[k]), np.load(B[k])
        if sorted(x.files) != sorted(y.files) or not all(
            np.array_equal(x[f], y[f], equal_nan=True) for f in x.files
        ):
            bad.append(f"chunk {k}: arrays differ")
    for dirpath, _, files in os.walk(a):
        rel_dir = os.path.relpath(dirpath, a)
        if os.sep + "chunks" in os.sep + rel_dir or "/params" in "/" + rel_dir:
            continue
        for f in files:
            if f.endswith(".log"):
                continue
            pa = os.path.join(dirpath, f)
            pb = os.path.join(b, os.path.relpath(pa, a))
            if not os.path.exists(pb):
                bad.append(f"{os.path.relpath(pa, a)}: only in {a}")
            elif filecmp.cmp(pa, pb, shallow=False):
                continue
            elif not f.endswith((".json", ".md", ".txt")) or (
                _lines(pa, volatile) != _lines(pb, volatile)
            ):
                bad.append(f"{os.path.relpath(pa, a)}: differs")
    return bad


def main(argv: list[str]) -> int:
    work = next((x.split("=", 1)[1] for x in argv if x.startswith("--work=")),
                "/tmp/compare_reports")  # fmt: skip
    revs = [x for x in argv if not x.startswith("--")]
    if not 1 <= len(revs) <= 2:
        print(__doc__)
        return 2
    revs = (revs + ["HEAD"])[:2]
    root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
    outs = []
    trees = [os.path.join(work, f"tree{i}") for i in range(2)]
    for i, rev in enumerate(revs):
        tree = os.path.join(work, f"tree{i}")
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=root,
                       capture_output=True)  # fmt: skip
        subprocess.check_call(["git", "worktree", "add", "--detach", "-q", tree, rev], cwd=root)
        print(f"{rev}: {tree}", flush=True)
        outs.append((run_all(tree, os.path.join(work, f"out{i}"))))
    if outs[0] != outs[1]:
        print("exit statuses differ:", outs[0], outs[1])
        return 1
    bad = compare(os.path.join(work, "out0"), os.path.join(work, "out1"), tuple(trees))
    print("\n".join(bad) or f"every output equal ({len(outs[0])} runs)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
