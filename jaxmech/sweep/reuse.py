"""A `--seeds_until` run resumed with its cap raised (`--max_seeds`): a finished run
whose models fall short of its rule trains on, and keeps the models it trained.

`reopens` says whether a finished folder trains on; `reopen` copies its results into
`REUSED` and then removes results.csv (the folder is a run in progress from there:
a kill at any point resumes); `reused_count` and `read_reused` give those models back
as a trained chunk's (state, curves), never trained again.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from jaxmech import results, saves
from jaxmech.sweep.until import SELECTION_FILE, Until
from jaxmech.train import TrainState

REUSED = "reused"  # a reopened run's models, until the results of the raised cap replace them
_KEPT = ("params", "curves.csv", "results.csv")  # what of a finished folder is reused


def stored_until(folder: str) -> dict | None:
    """The "until" record of `folder`'s sweep.json (None: a new folder or a plain sweep)."""
    path = os.path.join(folder, "sweep.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("until")


def reopens(folder: str, until: Until, log) -> bool:
    """Whether the finished run in `folder` trains on under `until`: its cap is raised
    above the seeds it trained and fewer than `until.passing` of them pass. A run with
    enough passing models is left as it is (the rule stopped it, not the cap)."""
    with open(os.path.join(folder, SELECTION_FILE)) as f:
        sel = json.load(f)
    if until.max_seeds <= sel["trained"]:
        return False
    n = len(sel["passing_models"])
    if n >= until.passing:
        log(f"{folder}: {n} of {sel['trained']} trained already pass {until.rule.text()}; "
            f"the cap raised to {until.max_seeds} trains none")  # fmt: skip
        return False
    return True


def reopen(folder: str) -> None:
    """Copies the finished results of `folder` into `REUSED`, then removes results.csv:
    a kill before that leaves the finished run (reopened again by the next raise), one
    after it a run in progress that resumes with the models in `REUSED`."""
    tmp, kept = os.path.join(folder, REUSED + ".tmp"), os.path.join(folder, REUSED)
    for path in (tmp, kept):
        if os.path.isdir(path):
            shutil.rmtree(path)
    os.makedirs(tmp)
    shutil.copytree(os.path.join(folder, "params"), os.path.join(tmp, "params"))
    for name in _KEPT[1:]:
        shutil.copy2(os.path.join(folder, name), os.path.join(tmp, name))
    os.rename(tmp, kept)
    os.remove(os.path.join(folder, "results.csv"))  # results.csv marks a finished run


def reused_count(folder: str) -> int:
    """How many models (the first ones) a run in progress in `folder` reuses."""
    path = os.path.join(folder, REUSED, "results.csv")
    return len(results.read_csv(path)) if os.path.isfile(path) else 0


def read_reused(folder: str, like: dict) -> dict:
    """{"state": TrainState (params, no optimiser state, step = steps trained,
    diverged_step) [T], "curves": {field: [T, E]}} of the models in `REUSED`, shaped
    and ordered as `like` (a trained chunk's part: `runs._reused_part`). The curves
    come back bit for bit: curves.csv holds each float32 exactly."""
    base = os.path.join(folder, REUSED)
    params, _ = saves.restore(os.path.join(base, "params"), like=like["state"].params)
    rows = results.read_csv(os.path.join(base, "results.csv"))
    column = lambda name: np.asarray([r[name] for r in rows], np.int32)  # noqa: E731
    state = TrainState(params, None, column("steps_trained"), column("diverged_step"))
    table = results.read_csv(os.path.join(base, "curves.csv"))
    curves = {}
    for name, x in like["curves"].items():
        curves[name] = np.asarray([r[name] for r in table], x.dtype).reshape(x.shape)
    return {"state": state, "curves": curves}
