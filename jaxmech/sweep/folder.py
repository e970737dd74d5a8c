"""Opening a sweep's folder (`open_folder`): new, resumed, finished, or a finished
`--seeds_until` run reopened by a raised cap (`reuse`), and what process 0 found there
as one array for the other processes (`opened_code`, `opened`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxmech import outdir
from jaxmech.sweep import reuse
from jaxmech.sweep.record import _folder_difference
from jaxmech.sweep.until import _write_selection, raised_until


def opened_code(k: int, finished=False, raised_from=(), reused=0) -> np.ndarray:
    """[k + 2] int32: what `open_folder` found, as process 0 hands it to the others."""
    code = np.zeros(k + 2, np.int32)
    code[0], code[1] = finished, reused
    code[2 + np.asarray(raised_from, int)] = 1
    return code


def opened(code) -> tuple[bool, tuple[int, ...], int]:
    """(finished, the caps raised from, models reused) of an `opened_code`; None (what
    a process other than 0 gets when it is alone, as a test fakes it): a new folder."""
    if code is None:
        return False, (), 0
    return bool(code[0]), tuple(int(c) for c in np.flatnonzero(code[2:])), int(code[1])


def open_folder(out: str, ident: dict, overwrite: bool, until, log) -> tuple:
    """(folder to train in, whether it holds the finished sweep, the caps `until` was
    raised from, how many models it reuses), `outdir.prepare`d; a new or resumed one
    holds sweep.json (and the `until` rule) before any model trains. A finished
    `--seeds_until` run whose cap is raised and whose models fall short of the rule
    is reopened (`reuse.reopen`): its models are kept, the seeds after them train."""
    work, finished = outdir.prepare(out, _folder_difference(ident), overwrite)
    raised_from, reused = (), 0
    if until is not None:
        stored = reuse.stored_until(work)
        until = raised_until(stored, until)
        ident = ident | {"until": until.record()}  # the caps before, in the folder
        if finished and reuse.reopens(work, until, log):
            reuse.reopen(work)
            finished = False
        if not finished and stored is not None and until.max_seeds > stored["max_seeds"]:
            log(f"{out}: cap raised from {stored['max_seeds']} to {until.max_seeds} seeds "
                f"(the rule stays {until.rule.text()}, {until.passing} models)")  # fmt: skip
        raised_from, reused = until.raised_from, 0 if finished else reuse.reused_count(work)
    if not finished:
        os.makedirs(work, exist_ok=True)
        with open(os.path.join(work, "sweep.json"), "w") as f:
            json.dump(ident, f, indent=1)
        if until is not None:  # the rule, before any model trains
            _write_selection(work, until.record())
    return work, finished, raised_from, reused
