"""Results folders as report subjects: the cheap checks an entry point runs on every
folder of `--run` before any compute (`check_run`, `check_runs`), a `--seeds_until` run's
`Selection` (the rule fixed before training, checked against sweep.json and results.csv),
opening a folder's finite models (`open_run`: a `LoadedRun` whose subject is a
`subjects.TrainedSubject`) and their groups (`model_groups`). Diverged models
(results.csv `diverged_step >= 0`) are left out and named (`excluded_lines`), so no
report averages them in; a run with a selection has its passing models as every
report's main group.
"""

from __future__ import annotations

import csv
import os
from typing import NamedTuple

import numpy as np

from jaxmech.config import SWEEPABLE, Config
from jaxmech.reports.subjects import LoadedRun, TrainedSubject, subset
from jaxmech.results import load_config, load_run
from jaxmech.sweep import read_selection
from jaxmech.sweep.until import cap_words

GENERALISING = 0.9  # unseen_min_acc at which a model counts as generalising


class Selection(NamedTuple):
    """A run's selection (`sweep.read_selection`, checked there against the rule it
    trained under and its results): the rule's text, the models trained (diverged
    ones included) and those that pass (results.csv `model`). Reports take the passing
    models as their main group and the others beside them (`model_groups`)."""

    rule: str
    trained: int
    passing: tuple[int, ...]
    cap: str = ""  # the seeds it might try, and the caps it was raised from (`cap_words`)

    def words(self) -> str:
        cap = f"; {self.cap}" if self.cap else ""
        return f"n = {len(self.passing)} of {self.trained} trained (rule: {self.rule}{cap})"

    def record(self) -> dict:
        """What a report's summary.json says of it."""
        return {"rule": self.rule, "n": len(self.passing), "trained": self.trained,
                "passing_models": list(self.passing), "cap": self.cap,
                "words": self.words()}  # fmt: skip


def run_selection(path: str, rows: list[dict]) -> Selection | None:
    """The `Selection` of results folder `path` with results.csv `rows` (None: the
    run has no selection.json); ValueError naming the file when it was changed."""
    sel = read_selection(path, rows)
    if sel is None:
        return None
    passing = tuple(sel["passing_models"])
    return Selection(sel["text"], int(sel["trained"]), passing, cap_words(sel))


def is_diverged(row: dict) -> bool:
    """Whether a results.csv row is a model whose loss or gradient went non-finite."""
    return row["diverged_step"] >= 0


def setting_text(value) -> str:
    # settings are stored as float32: print the shortest text that reads back the same
    return str(np.float32(value)) if isinstance(value, float) else str(value)


def excluded_lines(rows: list[dict]) -> list[str]:
    """One line per diverged model of results.csv `rows`, naming it for the reader.

    A model is named by its index in the run and the settings that tell it apart: the
    sweepable fields that vary over the run or differ from the defaults, then its seed.
    """
    if not rows:
        return []
    defaults = Config().flat()
    names = [
        n
        for n in SWEEPABLE
        if n != "seed"
        and n in rows[0]
        and (
            len({r[n] for r in rows}) > 1
            or not np.isclose(float(rows[0][n]), float(defaults[n]), rtol=1e-6)
        )
    ]
    lines = []
    for r in rows:
        if is_diverged(r):
            fields = ", ".join(f"{n}={setting_text(r[n])}" for n in (*names, "seed") if n in r)
            lines.append(
                f"excluded: model {r['model']} ({fields}): diverged at step {r['diverged_step']}"
            )
    return lines


def _results_rows(path: str) -> list[dict]:
    """results.csv of folder `path` as rows with int `model` and `diverged_step`
    (`_checked_rows`)."""
    file = os.path.join(path, "results.csv")
    with open(file, newline="") as f:
        return _checked_rows(file, list(csv.DictReader(f)))


def _checked_rows(file: str, rows: list[dict]) -> list[dict]:
    """`rows` of results table `file` with int `model` and `diverged_step`; a
    ValueError naming the file when it has no rows or lacks those columns."""
    if not rows:
        raise ValueError(f"{file} holds no model rows; train the run again (or --overwrite it)")
    try:
        for r in rows:
            r["model"], r["diverged_step"] = int(r["model"]), int(r["diverged_step"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{file} is not a results table (each row needs integer `model` and "
            "`diverged_step` columns); train the run again (or --overwrite it)"
        ) from None
    return rows


def _refuse_all_diverged(path: str, rows: list[dict]) -> None:
    if all(is_diverged(r) for r in rows):
        raise ValueError(
            f"{path}: every model of this run diverged ({len(rows)} model(s)), so there is "
            "nothing to analyse; train it again with a smaller lr or weight_decay"
        )


def check_run(path: str) -> Config:
    """The Config of a finished results folder, after the checks a report needs.

    Cheap (reads config.json and results.csv), so entry points refuse a bad folder
    before any compute. Raises ValueError naming the folder or file: not a finished
    results folder (`results.load_config`), a results.csv without model rows, or a run
    whose every model diverged.
    """
    config = load_config(path)
    rows = _results_rows(path)
    _refuse_all_diverged(path, rows)
    run_selection(path, rows)  # a selection changed after training: refused here
    return config


def check_runs(text: str, refusal) -> list[str]:
    """The results folders named by a `--run` flag (comma-separated), each checked
    (`check_run`, then `refusal(config, path)`: why the report does not apply, or
    None) before any compute. Raises ValueError starting "--run" for no folder, a bad
    folder or a refused one."""
    runs = [r.strip() for r in (text or "").split(",") if r.strip()]
    if not runs:
        raise ValueError(f"--run = {text!r}: give at least one results folder (comma-separated)")
    for r in runs:
        try:
            why = refusal(check_run(r), r)
        except ValueError as e:
            raise ValueError(f"--run: {e}") from None
        if why:
            raise ValueError(f"--run: {why}")
    return runs


def model_groups(run: LoadedRun) -> list[tuple[str, np.ndarray]]:
    """[(name, positions of the models in the run)]: "generalising" (unseen_min_acc >=
    `GENERALISING`) first, then "others", so a mean never mixes the two kinds; empty
    groups left out. A run whose results have no unseen_min_acc: [("all", every)]. A
    run with a selection (`LoadedRun.selection`): "passing" (its rule, fixed before
    training) first, then "failing"."""
    if run.selection is not None:
        passing = np.isin(np.asarray(run.models), run.selection.passing)
        groups = [("passing", np.flatnonzero(passing)), ("failing", np.flatnonzero(~passing))]
        return [(g, i) for g, i in groups if len(i)]
    u = run.unseen_min()
    if np.isnan(u).all():
        return [("all", np.arange(run.k))]
    gen = u >= GENERALISING
    groups = [("generalising", np.flatnonzero(gen)), ("others", np.flatnonzero(~gen))]
    return [(g, i) for g, i in groups if len(i)]


def open_run(path: str, *, with_data: bool = True, log=print) -> LoadedRun:
    """Loads results folder `path` (strict: see `results.load_config`) for a report: one
    call below the reports (`results.load_run`) gives the config, params, settings, the
    family, the task and (with `with_data`) the task's data.

    Only the finite models are kept: a diverged model's params are the last finite ones,
    not a trained model, and its numbers would be averaged into every statistic. Each
    left-out model is logged (`excluded_lines`) and listed in `LoadedRun.excluded`;
    `LoadedRun.models` keeps the kept models' indices in the run, for per-model rows.
    Raises ValueError naming `path` when results.csv does not match params/ or every
    model diverged.
    """
    run = load_run(path, with_data=with_data)
    k = len(np.asarray(run.settings.seed))
    # the rows load_run read have the columns used below (else a clear error)
    _checked_rows(os.path.join(path, "results.csv"), run.results)
    if len(run.results) != k:
        raise ValueError(
            f"{os.path.join(path, 'results.csv')} has {len(run.results)} row(s) but params/ "
            f"holds {k} model(s); the folder is damaged: train the run again"
        )
    _refuse_all_diverged(path, run.results)
    excluded = excluded_lines(run.results)
    for line in excluded:
        log(line)
    keep = np.asarray([i for i, r in enumerate(run.results) if not is_diverged(r)])
    every = LoadedRun(
        path,
        run.config,
        run.params,
        run.settings,
        run.data,
        run.results,
        tuple(int(r["model"]) for r in run.results),
        tuple(excluded),
        run.curves,
        run.family,
        run.task,
        subject=TrainedSubject(),
        selection=run_selection(path, run.results),
    )
    return subset(every, keep)
