"""Chunked resumable runs: `run_grid` trains a grid's models in chunks of one compiled
program, saving each segment (`saves`), resuming after a kill, and writes the results
folder.

A plan (`_Plan`, `_make_plan`) cuts the models into chunks; each chunk trains or resumes
(`_train_chunk`, `_restore_chunk` / `_read_chunk`), with progress lines (`_Progress`);
the finished chunks are written and published (`_finish`). Models start from a fresh
init or from a finished run's params (`init_from`); with `until` only as many chunks
train as the rule asks (`until`), and a raised cap trains on from the models it has
(`reuse`). Several processes share the work (`processes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time

import jax
import numpy as np

from jaxmech import outdir, results, saves
from jaxmech.config import Settings
from jaxmech.families import family_for
from jaxmech.sweep import folder as opened_folder
from jaxmech.sweep import reuse
from jaxmech.sweep.init_from import InitFrom, _Start, _start
from jaxmech.sweep.processes import _on_writer, _quiet, is_writer
from jaxmech.sweep.record import default_chunk_size, identity, program_record
from jaxmech.sweep.spec import Grid
from jaxmech.sweep.until import (
    PASS_AT_LEAST,
    PassRule,
    Until,
    _selection_outcome,
    _write_selection,
    passing_mask,
    read_selection,
)
from jaxmech.train import (
    TrainState,
    build_data,
    curve_fields,
    diverged_models,
    init_program,
    pad_models,
    restart_state,
    stack_settings,
    step_budget,
    train_models,
)

# The subfolder of a run in progress that holds each chunk's saves. It keeps the word
# saves were called by before (on disk): runs interrupted then still resume.
SAVES = "checkpoints"


def _plan_segments(n_evals: int, evals_per_save: int) -> list[int]:
    """Evaluations per segment: equal segments of evals_per_save, then the remainder."""
    full, rest = divmod(n_evals, evals_per_save)
    return [evals_per_save] * full + ([rest] if rest else [])


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a sweep's models are cut into chunks of one compiled program."""

    grid: Grid
    chunk: int  # models per chunk (the last chunk is padded)
    n_chunks: int  # chunks of `chunk` models (`ranges`: the chunks trained, cuts included)
    every: int  # steps between saves
    settings: Settings  # arrays [n_chunks * chunk], padded by repeating the last model
    budget: np.ndarray  # [n_chunks * chunk] steps each model trains
    fields: tuple[str, ...]  # curve fields (the family's metrics and training signals)
    progress_metric: str | None
    start: _Start | None = None  # trained params the models start from (None: fresh init)
    cuts: tuple[int, ...] = ()  # caps a --seeds_until run was raised from: chunk ends too
    reused: int = 0  # models [0, reused) finished before a raised cap (`REUSED`)

    @property
    def k(self) -> int:
        return len(self.grid.settings)

    @property
    def program(self) -> dict:
        return program_record(self.chunk)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """(first, end) models of each chunk: `chunk` models each, cut also at the caps
        the run was raised from, so that the chunks trained before keep their models
        (a padded chunk's models have the numbers they have in a full one)."""
        ends = {*range(self.chunk, self.k, self.chunk), self.k}
        ends = sorted(ends | {c for c in self.cuts if 0 < c < self.k})
        return list(zip([0, *ends[:-1]], ends))

    def take(self, tree, c: int):
        """Chunk c's models of `tree` (leading axis: the models), padded to `chunk`."""
        lo, hi = self.ranges[c]
        return pad_models(jax.tree_util.tree_map(lambda x: np.asarray(x)[lo:hi], tree), self.chunk)

    def n_real(self, c: int) -> int:
        lo, hi = self.ranges[c]
        return hi - lo


def _make_plan(
    grid: Grid,
    chunk_size: int | None,
    save_every: int | None,
    init_from: InitFrom | None = None,
    out: str | None = None,
) -> _Plan:
    cfg = grid.config
    every = cfg.train.eval_every if save_every is None else save_every
    if every < 1 or every % cfg.train.eval_every:
        raise ValueError(
            f"save_every = {every} is invalid: allowed a positive multiple of "
            f"eval_every = {cfg.train.eval_every}"
        )
    k = len(grid.settings)
    chunk = default_chunk_size(grid.config) if chunk_size is None else chunk_size
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk_size = {chunk_size!r} is invalid: allowed an integer >= 1")
    n_chunks = -(-k // chunk)
    padded = pad_models(stack_settings(list(grid.settings)), n_chunks * chunk)
    # steps each model trains (finite-set budgets; `steps` when streaming)
    budget = np.minimum(np.asarray(step_budget(padded, cfg)), cfg.train.steps)
    family = family_for(cfg)
    start = None if init_from is None else _start(grid, init_from, n_chunks * chunk, out)
    return _Plan(
        grid,
        chunk,
        n_chunks,
        every,
        padded,
        budget,
        curve_fields(cfg),
        family.progress_metric,
        start,
    )


def _finished(out: str) -> dict:
    """What `run_grid` returns for a sweep that is already finished in `out`."""
    run = results.load_run(out)
    with open(os.path.join(out, "sweep.json")) as f:
        program = json.load(f).get("program")  # None: written before programs were recorded
    return {
        "rows": run.results,
        "curves": run.curves,
        "wall_s": 0.0,
        "diverged": diverged_models([r["diverged_step"] for r in run.results], run.settings),
        "trained_steps": 0,
        "program": program,
        "selection": read_selection(out, run.results),
        "writer": True,
    }


class _Progress:
    """Model-steps trained, rate, ETA and models passing, for the progress lines. The
    models passing: the family's progress metric >= 0.9, or with `until` its rule (the
    ETA is then to the cap: how many seeds will train is not known)."""

    def __init__(self, plan: _Plan, until: Until | None = None):
        self.t0 = time.perf_counter()
        self.total = int(plan.budget[: plan.k].sum())
        self.trained = 0  # model-steps trained by this process
        self.done = 0  # model-steps done, resumed ones included
        self.passed_before = 0  # models of finished chunks that pass `rule`
        metric = plan.progress_metric
        self.rule = until.rule if until else metric and PassRule(metric, PASS_AT_LEAST)
        self.until = "" if until is None else f" (until {until.passing})"

    def line(self, plan: _Plan, c: int, step: int, curves: dict, col: int, seg_s: float) -> str:
        elapsed = time.perf_counter() - self.t0
        rate = self.trained / max(elapsed, 1e-9)
        eta = (self.total - self.done) / max(rate, 1e-9)
        text = (
            f"  chunk {c + 1}/{len(plan.ranges)} step {step}/{plan.grid.config.train.steps}  "
            f"{rate:.0f} model-steps/s  ETA {eta:.0f} s  "
        )
        if self.rule:
            r = self.rule
            now = int(r.passes(curves[r.metric][: plan.n_real(c), col]).sum())
            seen = plan.ranges[c][1]
            text += f"{r.metric}>={r.at_least:g}: {self.passed_before + now}/{seen}{self.until}  "
        return text + f"({seg_s:.1f} s this segment)"

    def chunk_done(self, plan: _Plan, c: int, curves: dict) -> None:
        if self.rule:
            last = curves[self.rule.metric][: plan.n_real(c), -1]
            self.passed_before += int(self.rule.passes(last).sum())

    def reused(self, plan: _Plan, curves: dict) -> None:
        """The models a raised cap reuses count as done (and passing, if they pass)."""
        self.done += int(plan.budget[: plan.reused].sum())
        if self.rule:
            self.passed_before += int(self.rule.passes(curves[self.rule.metric][:, -1]).sum())


def _not_written(plan: _Plan, wall: float, trained: int, selection) -> dict:
    """What `run_grid` returns on a process that does not write the folder."""
    return {"rows": None, "curves": None, "wall_s": wall, "diverged": None,
            "trained_steps": trained, "program": plan.program, "selection": selection,
            "writer": False}  # fmt: skip


def _restore_chunk(plan: _Plan, c: int, save_dir: str, log):
    """(state or None, curves [chunk, n_evals] per field) of chunk c: its save if there
    is one, else nothing trained (NaN curves). Process 0 reads it, every process
    gets it (`_on_writer`)."""
    cfg = plan.grid.config
    curves = {
        n: np.full((plan.chunk, cfg.train.n_evals), np.nan, np.float32)
        for n in plan.fields + ("step",)
    }
    chunk_settings = jax.tree_util.tree_map(lambda x: x[: plan.chunk], plan.settings)
    like = {"state": jax.eval_shape(lambda s: init_program(s, cfg), chunk_settings),
            "curves": curves}  # fmt: skip
    tree = _on_writer(lambda: _read_chunk(plan, c, save_dir, like, log), like)
    if tree is None:
        return None, curves
    # in the order of a fresh run (a shared dict comes back sorted), so that curves.csv's
    # columns do not depend on a resume
    return tree["state"], {n: tree["curves"][n] for n in curves}


def _read_chunk(plan: _Plan, c: int, save_dir: str, like: dict, log) -> dict | None:
    """Chunk c's newest intact save as a tree like `like` (None: there is none);
    SaveError when it belongs to another chunk or sweep."""
    if saves.latest_step(save_dir) is None:
        return None
    # the newest intact step; damaged ones are reported through `log` and dropped
    found = saves.restore_latest(save_dir, like, log)
    if found is None:
        log(f"  chunk {c + 1}/{len(plan.ranges)}: no intact save; training it from step 0")
        return None
    tree, meta, _ = found
    if meta.get("chunk") != c or meta.get("settings") != _settings_meta(plan, c):
        raise saves.SaveError(
            f"save in {save_dir!r} belongs to another chunk or sweep; remove the "
            "folder or pass --overwrite"
        )
    return {"state": TrainState(*tree["state"]), "curves": tree["curves"]}


def _settings_meta(plan: _Plan, c: int) -> list[dict]:
    return [s._asdict() for s in plan.grid.settings[slice(*plan.ranges[c])]]


def _copy_last_evaluation(curves: dict, evals_done: int, eval_every: int) -> None:
    """Fills the evaluations after `evals_done` with the last one (models all frozen)."""
    for n in curves:
        curves[n][:, evals_done:] = curves[n][:, evals_done - 1 : evals_done]
    n_evals = curves["step"].shape[1]
    curves["step"][:, evals_done:] = eval_every * np.arange(evals_done + 1, n_evals + 1)


def _train_chunk(plan: _Plan, c: int, work: str, data, progress: _Progress, log):
    """Trains (or resumes) chunk c to the end, saving each segment; returns its
    real models' (state, curves) as host arrays."""
    cfg = plan.grid.config
    eval_every = cfg.train.eval_every
    save_dir = os.path.join(work, SAVES, f"chunk_{c:04d}")
    settings_c = plan.take(plan.settings, c)
    budget_c = plan.budget[slice(*plan.ranges[c])]
    state, curves = _restore_chunk(plan, c, save_dir, log)
    if state is None and plan.start is not None:  # step 0 from the trained params
        params_c = plan.take(plan.start.params, c)
        state = restart_state(cfg, settings_c, params_c)
    step = 0 if state is None else int(np.asarray(state.step).max())
    progress.done += int(np.minimum(budget_c, step).sum())
    evals_done = step // eval_every
    for seg in _plan_segments(cfg.train.n_evals - evals_done, plan.every // eval_every):
        if (budget_c <= step).all():
            # every model of the chunk is done (finite-set budgets): their params are
            # frozen, so later evaluations would repeat the last one; copy it instead
            _copy_last_evaluation(curves, evals_done, eval_every)
            log(f"  chunk {c + 1}/{len(plan.ranges)}: every model's budget done at step {step}")
            break
        ts = time.perf_counter()
        state, seg_curves = train_models(cfg, settings_c, data=data, state=state, n_chunks=seg)
        for n in curves:
            curves[n][:, evals_done : evals_done + seg] = seg_curves[n]
        evals_done += seg
        before, step = step, evals_done * eval_every
        saved = ({"state": state, "curves": curves},
                 {"chunk": c, "step": step, "settings": _settings_meta(plan, c)})  # fmt: skip
        # process 0 writes; a failed write stops the others now, not at a later collective
        _on_writer(lambda: saves.save(save_dir, step, *saved), None)
        seg_steps = int((np.minimum(budget_c, step) - np.minimum(budget_c, before)).sum())
        progress.trained += seg_steps
        progress.done += seg_steps
        log(progress.line(plan, c, step, curves, evals_done - 1, time.perf_counter() - ts))
    progress.chunk_done(plan, c, curves)
    n_real = plan.n_real(c)
    # no optimiser state: a finished model needs none, and a reused one has none
    state = jax.tree_util.tree_map(lambda x: np.asarray(x)[:n_real], state._replace(opt_state=None))
    return state, {n: v[:n_real] for n, v in curves.items()}


def _finish(plan: _Plan, work: str, out: str, state: TrainState, curves: dict, wall: float, log):
    """Writes the results folder (in `work`, then swapped into `out`) and the summary."""
    cfg, k = plan.grid.config, plan.k
    # optimiser steps each model took: its budget, cut short by the program or divergence
    steps_trained = np.minimum(plan.budget[:k], np.asarray(state.step))
    div = np.asarray(state.diverged_step)
    steps_trained = np.where(div >= 0, np.minimum(steps_trained, div), steps_trained)
    all_settings = jax.tree_util.tree_map(lambda x: x[:k], plan.settings)
    diverged = diverged_models(state.diverged_step, all_settings)
    for line in diverged:
        log("WARNING: " + line)
    extra = {"swept": list(plan.grid.swept), "wall_s": wall, "program": plan.program}
    if plan.start is not None:  # "base": the run the models started from
        extra |= {"base": plan.start.record["run"], "init_from": plan.start.record}
    rows = results.write_files(
        work,
        cfg,
        all_settings,
        state.params,
        curves,
        state.diverged_step,
        extra=extra,
        steps_trained=steps_trained,
    )
    for name in (SAVES, reuse.REUSED):  # none when a raised cap trained nothing new
        if os.path.isdir(os.path.join(work, name)):
            shutil.rmtree(os.path.join(work, name))
    outdir.publish(work, out)  # --overwrite: the old folder is replaced only now
    return rows, diverged


def run_grid(
    grid: Grid,
    out: str,
    *,
    overwrite: bool = False,
    chunk_size: int | None = None,
    save_every: int | None = None,
    init_from: InitFrom | None = None,
    until: Until | None = None,
    log=print,
) -> dict:
    """Trains every model of `grid` and writes the results folder `out`, resumably.

    Models train in chunks of `chunk_size` (default `default_chunk_size`: fixed per
    backend), all chunks through one compiled program (the last chunk is padded), so a
    model's numbers depend on its settings, its seed and that program, not on the other
    models of the sweep. Every `save_every` steps (default: every evaluation) each
    chunk's stacked TrainState and curves are saved (`saves`, checksummed) under
    `out/checkpoints/`. Re-running the same grid resumes from the newest intact
    save (also after kill -9) and gives the same final results; re-running a
    finished grid trains nothing. One process writes `out` at a time
    (`outdir.locked`). A folder holding anything else is refused unless `overwrite`;
    then the new sweep is built in a staging sibling (resumed if interrupted) that
    replaces `out` only when finished (`outdir`).

    `init_from` (`InitFrom`): the models start from trained params of a finished run
    (each from its base model's, with optional `static` constants replaced) at step 0
    with a fresh optimiser state, instead of a fresh init; everything else is as above.
    It is checked before any compute (`check_init_from`; a ValueError naming the
    argument), and recorded in `sweep.json` with fingerprints of the starting params,
    so that a resume against a changed base run is refused (SweepMismatchError).

    `until` (`Until`, from `seeds_until`): the grid's seeds train chunk by chunk until
    enough models pass its rule (or every seed was tried); only the chunks trained are
    written. The rule is written to `out/selection.json` and recorded in `sweep.json`
    before any model trains (a resume with another rule is refused); after training
    selection.json lists every trained model and whether it passed (`read_selection`).
    A resume may raise the cap (`until.max_seeds`, never lower it): the caps before
    are recorded ("raised_from") and cut the chunks, so that those trained are kept;
    a finished run that stopped at its cap short of the rule trains on from its
    models (`reuse`), to the models an uninterrupted run with the new cap trains.

    Several processes (`jax.distributed`, `--distributed`): every process calls
    `run_grid` with the same arguments and trains its devices' share of each chunk (the
    mesh spans every process's devices). Process 0 alone holds the lock and reads and
    writes `out` (saves included), and hands each save it reads to the
    others, so `out` need not be on a filesystem the hosts share; an error there stops
    the others with `OtherProcessError`. The same sweep on the same number of devices
    gives the same results with one process or several.

    Returns {"rows", "curves", "wall_s", "diverged" (one line per diverged model),
    "trained_steps", "program" (`program_record`), "selection" (selection.json's
    record; None without `until`), "writer" (whether this process wrote `out`; on the
    others "rows", "curves" and "diverged" are None)}.
    """
    if until is not None and len(grid.settings) != until.max_seeds:
        raise ValueError(f"until.max_seeds = {until.max_seeds} but the grid holds "
                         f"{len(grid.settings)} model(s): build `until` with seeds_until")  # fmt: skip
    plan = _make_plan(grid, chunk_size, save_every, init_from, out)
    outdir.check_usable(out)
    log = log if is_writer() else _quiet  # one process speaks for a multi-process sweep
    start = None if plan.start is None else plan.start.record
    return _open_and_train(plan, out, identity(grid, plan.chunk, start, until), overwrite,
                           until, log)  # fmt: skip


def _open_and_train(plan: _Plan, out: str, ident: dict, overwrite: bool, until, log) -> dict:
    """`run_grid`'s folder step and training: process 0 takes the lock and opens `out`
    (or its staging sibling), every process learns whether it is finished, raised or
    fresh, and the chunks not yet trained train."""
    with contextlib.ExitStack() as held:
        folder = {"work": out}  # where process 0 trains; the others never touch it

        def open_folder():  # process 0: the lock (held to the end), then the folder
            held.enter_context(outdir.locked(out, log))
            folder["work"], *found = opened_folder.open_folder(out, ident, overwrite, until, log)
            return opened_folder.opened_code(plan.k, *found)

        code = _on_writer(open_folder, opened_folder.opened_code(plan.k))
        finished, raised_from, reused = opened_folder.opened(code)
        if finished:
            if not is_writer():
                return _not_written(plan, 0.0, 0, None)
            outdir.publish(folder["work"], out)  # a finished --overwrite whose swap was cut
            log(f"{out}: this sweep is already finished; nothing to train")
            return _finished(out)
        if until is not None:  # the caps it was raised from cut its chunks (`_Plan.ranges`)
            until = until._replace(raised_from=raised_from)
            plan = dataclasses.replace(plan, cuts=raised_from, reused=reused)
        return _train_all(plan, folder["work"], out, log, until)


def _reused_part(plan: _Plan, work: str) -> tuple:
    """(state, curves) of the models [0, plan.reused) a raised cap keeps, as a trained
    chunk's; process 0 reads them, every process gets them (`_on_writer`)."""
    cfg, n = plan.grid.config, plan.reused
    first = jax.tree_util.tree_map(lambda x: x[:n], plan.settings)
    params = jax.eval_shape(lambda s: init_program(s, cfg).params, first)
    ints = np.zeros(n, np.int32)
    curves = {f: np.zeros((n, cfg.train.n_evals), np.float32) for f in plan.fields + ("step",)}
    like = {"state": TrainState(params, None, ints, ints), "curves": curves}
    tree = _on_writer(lambda: reuse.read_reused(work, like), like)
    # in a fresh run's order (a shared dict comes back sorted): curves.csv's columns
    return TrainState(*tree["state"]), {n: tree["curves"][n] for n in curves}


def _train_chunks(plan: _Plan, work: str, data, progress: _Progress, log, until) -> list:
    """Every chunk's (state, curves), reused, trained or resumed in order; with
    `until`, only up to the chunk in which the passing models reach `until.passing`,
    checked at the chunk ends of a run never raised, so that a raised cap trains the
    models an uninterrupted run with that cap trains."""
    parts, passed = [], 0
    count = lambda part: int(passing_mask(until.rule, part[1], part[0].diverged_step).sum())  # noqa: E731
    if plan.reused:
        parts.append(_reused_part(plan, work))
        progress.reused(plan, parts[0][1])
        passed = 0 if until is None else count(parts[0])
        log(f"  models 0..{plan.reused - 1}: trained before the cap was raised; kept")
    for c, (_, end) in enumerate(plan.ranges):
        if end <= plan.reused:
            continue
        parts.append(_train_chunk(plan, c, work, data, progress, log))
        if until is None:
            continue
        passed += count(parts[-1])
        if passed >= until.passing and (end % plan.chunk == 0 or end == plan.k):
            break
    return parts


def _train_all(plan: _Plan, work: str, out: str, log, until: Until | None = None) -> dict:
    """Trains (or resumes) every chunk in `work` (with `until`: as far as it asks), then
    writes and publishes the results."""
    cfg = plan.grid.config
    start = "" if plan.start is None else f" from the params of {plan.start.record['run']}"
    log(
        f"sweep: {plan.k} model(s) in {len(plan.ranges)} chunk(s) of {plan.chunk} x "
        f"{cfg.train.steps} steps{start} on {jax.device_count()} {jax.default_backend()} "
        f"device(s); saves every {plan.every} steps"
    )
    data = build_data(cfg)
    progress = _Progress(plan, until)
    parts = _train_chunks(plan, work, data, progress, log, until)
    wall = time.perf_counter() - progress.t0
    state = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *(p[0] for p in parts))
    curves = {n: np.concatenate([p[1][n] for p in parts]) for n in parts[0][1]}
    selection = None
    if until is not None:  # the results hold the models trained, not the cap's
        k = len(curves["step"])
        plan = dataclasses.replace(
            plan, grid=dataclasses.replace(plan.grid, settings=plan.grid.settings[:k])
        )
        passed = passing_mask(until.rule, curves, state.diverged_step)
        selection = _selection_outcome(until, stack_settings(list(plan.grid.settings)), passed, log)
        if is_writer():
            _write_selection(work, selection)  # before results.csv, which marks completion
    if not is_writer():
        return _not_written(plan, wall, progress.trained, selection)
    rows, diverged = _finish(plan, work, out, state, curves, wall, log)
    return {
        "writer": True,
        "rows": rows,
        "curves": results.curve_rows(curves),
        "wall_s": wall,
        "diverged": diverged,
        "trained_steps": progress.trained,
        "program": plan.program,
        "selection": selection,
    }
