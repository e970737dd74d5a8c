"""Sweep specs: parse field values from the command line and expand a grid of models.

A spec is `a:b` (inclusive range), `a:b:step`, a comma list `1,3,5`, or one value.
Several swept fields form a grid (every combination), times `seeds` seeds each. Every
value is checked by constructing the Config it implies, so an out-of-range value fails
with the field's own message before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import tempfile
import time
from typing import Any

import jax
import numpy as np

from jaxmech import checkpoint, results
from jaxmech.config import SWEEPABLE, Config, ConfigError, Settings
from jaxmech.families import family_for
from jaxmech.train import (
    TrainState,
    build_data,
    curve_fields,
    diverged_models,
    init_program,
    pad_models,
    stack_settings,
    step_budget,
    train_models,
)

# Short names users know from the papers.
ALIASES = {"n_pair": "n_pair_labels", "n_2": "layouts_per_pair"}


def field_type(name: str) -> type:
    """The Python type of a config field's values (from its default)."""
    for group in (Config().task, Config().model, Config().train):
        for f in dataclasses.fields(group):
            if f.name == name:
                default = getattr(group, name)
                return int if default is None else type(default)
    raise ConfigError(
        f"unknown config field {name!r}; known fields: {', '.join(Config.field_names())}"
    )


def coerce(name: str, text: str) -> Any:
    """A field value from text, by the field's type; errors name the field."""
    t = field_type(name)
    text = text.strip()
    if t is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"{name} = {text!r} is invalid: allowed true or false")
    if name == "text_n_layers" and text.lower() == "none":
        return None
    try:
        return t(text)
    except ValueError:
        raise ConfigError(f"{name} = {text!r} is invalid: allowed a {t.__name__}") from None


def parse_spec(name: str, text: str) -> list:
    """Values of one swept field: `a:b`, `a:b:step` (inclusive), `x,y,z` or `x`."""
    text = text.strip()
    if not text:
        raise ConfigError(f"--{name}: empty spec; use a:b, a:b:step, a comma list or a value")
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"--{name}={text!r}: a range is a:b or a:b:step")
        if field_type(name) is not int:
            raise ConfigError(f"--{name}={text!r}: ranges need an integer field; use a comma list")
        a, b = coerce(name, parts[0]), coerce(name, parts[1])
        step = coerce(name, parts[2]) if len(parts) == 3 else 1
        if step <= 0:
            raise ConfigError(f"--{name}={text!r}: the step must be positive")
        values = list(range(a, b + 1, step))
        if not values:
            raise ConfigError(f"--{name}={text!r}: empty range (start {a} > end {b})")
        return values
    values = [coerce(name, v) for v in text.split(",") if v.strip()]
    if not values:
        raise ConfigError(f"--{name}={text!r}: no values")
    return values


@dataclasses.dataclass(frozen=True)
class Grid:
    """The models of a sweep: the shared config and one Settings per model."""

    config: Config
    swept: tuple[str, ...]  # names of the swept fields (not counting seed)
    settings: tuple[Settings, ...]


def expand(
    config: Config, specs: dict[str, str], seeds: int, first_seed: int | None = None
) -> Grid:
    """Grid of models: every combination of the swept values x `seeds` seeds.

    `specs` maps field names (or ALIASES) to spec strings. Non-sweepable fields may
    take a single value only (they are static: one compiled program per value).
    Seeds are `first_seed .. first_seed + seeds - 1` (default: config's seed).
    """
    if seeds < 1:
        raise ConfigError(f"seeds = {seeds} is invalid: allowed an integer >= 1")
    values: dict[str, list] = {}
    overrides: dict[str, Any] = {}
    for raw, text in specs.items():
        name = ALIASES.get(raw, raw)
        field_type(name)  # unknown names fail here
        vals = parse_spec(name, text)
        if name == "seed":
            raise ConfigError("--seed is not swept by spec; use --seeds=N (and --first_seed)")
        if name in SWEEPABLE and len(vals) > 1:
            values[name] = vals
        elif len(vals) > 1:
            raise ConfigError(
                f"--{raw}: {name} is not sweepable inside one program (sweepable: "
                f"{', '.join(SWEEPABLE[1:])}); run one sweep per value"
            )
        else:
            overrides[name] = vals[0]
    # The shared config takes each swept field's first value, so that it is valid when
    # the swept field's default would not be (e.g. --n_labels=8 --n_pair=3,5).
    base = config.replace(**overrides, **{n: v[0] for n, v in values.items()})
    family_for(base)  # the model family and its task pairing fail here, before any compute
    s0 = base.train.seed if first_seed is None else first_seed
    swept = tuple(values)
    settings = []
    for combo in itertools.product(*(values[n] for n in swept)):
        for seed in range(s0, s0 + seeds):
            # constructing the config validates every value against its field's range
            settings.append(base.replace(seed=seed, **dict(zip(swept, combo))).settings())
    return Grid(finite_steps(base, settings, "steps" in specs), swept, tuple(settings))


def finite_steps(base: Config, settings: list[Settings], steps_given: bool) -> Config:
    """With finite-set training (epochs > 0) the program length follows the budgets.

    `steps` becomes the largest model's `step_budget`, rounded up to a multiple of
    `eval_every`; models with smaller budgets are frozen when done (and their chunks stop
    early). Streaming and finite models are not mixed in one sweep: a streaming model
    would train for the finite models' length.
    """
    epochs = np.asarray([s.epochs for s in settings])
    if not (epochs > 0).any():
        return base
    if (epochs == 0).any():
        raise ConfigError(
            "--epochs: mixes 0 (streaming) and > 0 (finite set) in one sweep; "
            "run one sweep for each"
        )
    if steps_given:
        raise ConfigError(
            "--steps and --epochs both given: with epochs > 0 each model's steps follow "
            "from its epochs and training-set size; give one of them"
        )
    longest = int(np.asarray(step_budget(stack_settings(settings), base)).max())
    every = base.train.eval_every
    return base.replace(steps=max(every, -(-longest // every) * every))


def default_chunk_size(k: int) -> int:
    """Models per compiled call: small on CPU, large on accelerators; a device multiple.

    On a 2-core CPU one model already keeps both cores busy and vmapping 4 models gains
    ~1.5x per model over 1 while larger K gain little more (BUILD_NOTES.md, bench);
    on GPU/TPU throughput grows with the batch of models until memory runs out.
    """
    n_dev = jax.device_count()
    max_per_dev = 4 if jax.default_backend() == "cpu" else 512
    n_chunks = -(-k // (max_per_dev * n_dev))
    # balance the chunks, so the last one is not mostly padding (6 models: 3 + 3, not 4 + 4)
    per_dev = -(-k // (n_chunks * n_dev))
    return per_dev * n_dev


def identity(grid: Grid) -> dict:
    """What a sweep folder must match to be resumed: the config and every model's settings."""
    return {
        "format": 1,
        "config": json.loads(grid.config.to_json()),
        "swept": list(grid.swept),
        "settings": [s._asdict() for s in grid.settings],
    }


def same_sweep(stored: dict, ident: dict) -> bool:
    """Whether a folder's `sweep.json` describes the sweep `ident` (see `identity`).

    Compared as configs and settings, not as text: a field added to the code since the
    folder was written takes its default, so an old sweep still resumes (or is found
    finished) when its values are the defaults.
    """
    if stored == ident:
        return True
    try:
        if stored.get("format") != ident["format"] or stored.get("swept") != ident["swept"]:
            return False
        as_config = lambda raw: Config.from_json(json.dumps(raw))  # noqa: E731
        if as_config(stored["config"]) != as_config(ident["config"]):
            return False
        defaults = Config().flat()
        fill = lambda s: {n: s.get(n, defaults[n]) for n in SWEEPABLE}  # noqa: E731
        return [fill(s) for s in stored["settings"]] == [fill(s) for s in ident["settings"]]
    except (ConfigError, KeyError, TypeError, AttributeError):
        return False


class SweepMismatchError(RuntimeError):
    """The output folder holds a different sweep (and --overwrite was not given)."""


def _plan_segments(n_evals: int, evals_per_ckpt: int) -> list[int]:
    """Evaluations per segment: equal segments of evals_per_ckpt, then the remainder."""
    full, rest = divmod(n_evals, evals_per_ckpt)
    return [evals_per_ckpt] * full + ([rest] if rest else [])


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a sweep's models are cut into chunks of one compiled program."""

    grid: Grid
    chunk: int  # models per chunk (the last chunk is padded)
    n_chunks: int
    every: int  # steps between checkpoints
    settings: Settings  # arrays [n_chunks * chunk], padded by repeating the last model
    budget: np.ndarray  # [n_chunks * chunk] steps each model trains
    fields: tuple[str, ...]  # curve fields (the family's metrics and training signals)
    progress_metric: str | None

    @property
    def k(self) -> int:
        return len(self.grid.settings)

    def chunk_slice(self, c: int) -> slice:
        return slice(c * self.chunk, (c + 1) * self.chunk)

    def n_real(self, c: int) -> int:
        return min(self.chunk, self.k - c * self.chunk)


def _make_plan(grid: Grid, chunk_size: int | None, checkpoint_every: int | None) -> _Plan:
    cfg = grid.config
    every = checkpoint_every or cfg.train.eval_every
    if every % cfg.train.eval_every:
        raise ValueError(
            f"checkpoint_every = {every} must be a multiple of eval_every = {cfg.train.eval_every}"
        )
    k = len(grid.settings)
    chunk = chunk_size or default_chunk_size(k)
    if chunk < 1:
        raise ValueError(f"chunk_size = {chunk}: must be >= 1")
    n_chunks = -(-k // chunk)
    padded = pad_models(stack_settings(list(grid.settings)), n_chunks * chunk)
    # steps each model trains (finite-set budgets; `steps` when streaming)
    budget = np.minimum(np.asarray(step_budget(padded, cfg)), cfg.train.steps)
    family = family_for(cfg)
    return _Plan(
        grid, chunk, n_chunks, every, padded, budget, curve_fields(cfg), family.progress_metric
    )


def _finished(out: str) -> dict:
    """What `run_grid` returns for a sweep that is already finished in `out`."""
    run = results.load_run(out)
    return {
        "rows": run.results,
        "curves": run.curves,
        "wall_s": 0.0,
        "diverged": [r for r in run.results if r["diverged_step"] >= 0],
        "trained_steps": 0,
    }


def _prepare_folder(out: str, ident: dict, overwrite: bool) -> tuple[str, bool]:
    """(folder to work in, whether `out` already holds this finished sweep).

    Decided before any compute: `out` itself when empty or holding this sweep (resume);
    a temporary sibling with `overwrite` when it holds anything else (it replaces `out`
    only at the end); otherwise `SweepMismatchError`.
    """
    ident_path = os.path.join(out, "sweep.json")
    if not os.path.exists(out) or (os.path.isdir(out) and not os.listdir(out)):
        return out, False
    same = False
    if os.path.isfile(ident_path):
        with open(ident_path) as f:
            same = same_sweep(json.load(f), ident)
    if same:
        return out, os.path.isfile(os.path.join(out, "results.csv"))
    if not overwrite:
        what = "a different sweep" if os.path.isfile(ident_path) else "other files"
        raise SweepMismatchError(
            f"output folder {out!r} holds {what}; pass --overwrite to replace it or "
            "choose another --out (nothing was changed)"
        )
    parent = os.path.dirname(os.path.abspath(out))
    return tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out) + "-", dir=parent), False


class _Progress:
    """Model-steps trained, rate, ETA and models passing, for the progress lines."""

    def __init__(self, plan: _Plan):
        self.t0 = time.perf_counter()
        self.total = int(plan.budget[: plan.k].sum())
        self.trained = 0  # model-steps trained by this process
        self.done = 0  # model-steps done, resumed ones included
        self.passed_before = 0  # models of finished chunks with the progress metric >= 0.9

    def line(self, plan: _Plan, c: int, step: int, curves: dict, col: int, seg_s: float) -> str:
        elapsed = time.perf_counter() - self.t0
        rate = self.trained / max(elapsed, 1e-9)
        eta = (self.total - self.done) / max(rate, 1e-9)
        text = (
            f"  chunk {c + 1}/{plan.n_chunks} step {step}/{plan.grid.config.train.steps}  "
            f"{rate:.0f} model-steps/s  ETA {eta:.0f} s  "
        )
        if plan.progress_metric is not None:
            now = int((curves[plan.progress_metric][: plan.n_real(c), col] >= 0.9).sum())
            seen = c * plan.chunk + plan.n_real(c)
            text += f"{plan.progress_metric}>=0.9: {self.passed_before + now}/{seen}  "
        return text + f"({seg_s:.1f} s this segment)"

    def chunk_done(self, plan: _Plan, c: int, curves: dict) -> None:
        if plan.progress_metric is not None:
            last = curves[plan.progress_metric][: plan.n_real(c), -1]
            self.passed_before += int((last >= 0.9).sum())


def _restore_chunk(plan: _Plan, c: int, ckpt_dir: str):
    """(state or None, curves [chunk, n_evals] per field) of chunk c: its checkpoint if
    there is one, else nothing trained (NaN curves)."""
    cfg = plan.grid.config
    curves = {
        n: np.full((plan.chunk, cfg.train.n_evals), np.nan, np.float32)
        for n in plan.fields + ("step",)
    }
    if checkpoint.latest_step(ckpt_dir) is None:
        return None, curves
    chunk_settings = jax.tree_util.tree_map(lambda x: x[: plan.chunk], plan.settings)
    like_state = jax.eval_shape(lambda s: init_program(s, cfg), chunk_settings)
    tree, meta = checkpoint.restore(ckpt_dir, like={"state": like_state, "curves": curves})
    if meta.get("chunk") != c or meta.get("settings") != _settings_meta(plan, c):
        raise checkpoint.CheckpointError(
            f"checkpoint in {ckpt_dir!r} belongs to another chunk or sweep; remove the "
            "folder or pass --overwrite"
        )
    return TrainState(*tree["state"]), tree["curves"]


def _settings_meta(plan: _Plan, c: int) -> list[dict]:
    return [s._asdict() for s in plan.grid.settings[plan.chunk_slice(c)]]


def _copy_last_evaluation(curves: dict, evals_done: int, eval_every: int) -> None:
    """Fills the evaluations after `evals_done` with the last one (models all frozen)."""
    for n in curves:
        curves[n][:, evals_done:] = curves[n][:, evals_done - 1 : evals_done]
    n_evals = curves["step"].shape[1]
    curves["step"][:, evals_done:] = eval_every * np.arange(evals_done + 1, n_evals + 1)


def _train_chunk(plan: _Plan, c: int, work: str, data, progress: _Progress, log):
    """Trains (or resumes) chunk c to the end, checkpointing each segment; returns its
    real models' (state, curves) as host arrays."""
    cfg = plan.grid.config
    eval_every = cfg.train.eval_every
    ckpt_dir = os.path.join(work, "checkpoints", f"chunk_{c:04d}")
    settings_c = jax.tree_util.tree_map(lambda x: x[plan.chunk_slice(c)], plan.settings)
    budget_c = plan.budget[plan.chunk_slice(c)][: plan.n_real(c)]
    state, curves = _restore_chunk(plan, c, ckpt_dir)
    step = 0 if state is None else int(np.asarray(state.step).max())
    progress.done += int(np.minimum(budget_c, step).sum())
    evals_done = step // eval_every
    for seg in _plan_segments(cfg.train.n_evals - evals_done, plan.every // eval_every):
        if (budget_c <= step).all():
            # every model of the chunk is done (finite-set budgets): their params are
            # frozen, so later evaluations would repeat the last one; copy it instead
            _copy_last_evaluation(curves, evals_done, eval_every)
            log(f"  chunk {c + 1}/{plan.n_chunks}: every model's budget done at step {step}")
            break
        ts = time.perf_counter()
        state, seg_curves = train_models(cfg, settings_c, data=data, state=state, n_chunks=seg)
        for n in curves:
            curves[n][:, evals_done : evals_done + seg] = seg_curves[n]
        evals_done += seg
        before, step = step, evals_done * eval_every
        checkpoint.save(
            ckpt_dir,
            step,
            {"state": state, "curves": curves},
            {"chunk": c, "step": step, "settings": _settings_meta(plan, c)},
        )
        seg_steps = int((np.minimum(budget_c, step) - np.minimum(budget_c, before)).sum())
        progress.trained += seg_steps
        progress.done += seg_steps
        log(progress.line(plan, c, step, curves, evals_done - 1, time.perf_counter() - ts))
    progress.chunk_done(plan, c, curves)
    n_real = plan.n_real(c)
    state = jax.tree_util.tree_map(lambda x: np.asarray(x)[:n_real], state)
    return state, {n: v[:n_real] for n, v in curves.items()}


def _finish(plan: _Plan, work: str, out: str, state: TrainState, curves: dict, wall: float, log):
    """Writes the results folder (in `work`, then swapped into `out`) and the summary."""
    cfg, k = plan.grid.config, plan.k
    # optimiser steps each model took: its budget, cut short by the program or divergence
    steps_trained = np.minimum(plan.budget[:k], np.asarray(state.step))
    div = np.asarray(state.diverged_step)
    steps_trained = np.where(div >= 0, np.minimum(steps_trained, div), steps_trained)
    all_settings = jax.tree_util.tree_map(lambda x: x[:k], plan.settings)
    diverged = diverged_models(state, all_settings)
    for line in diverged:
        log("WARNING: " + line)
    rows = results.write_files(
        work,
        cfg,
        all_settings,
        state.params,
        curves,
        state.diverged_step,
        extra={"swept": list(plan.grid.swept), "wall_s": wall},
        steps_trained=steps_trained,
    )
    shutil.rmtree(os.path.join(work, "checkpoints"), ignore_errors=True)
    if work != out:  # --overwrite: replace the old folder only now that the new one is whole
        old = tempfile.mkdtemp(
            prefix=".old-" + os.path.basename(out) + "-", dir=os.path.dirname(os.path.abspath(out))
        )
        os.rename(out, os.path.join(old, "x"))
        os.rename(work, out)
        shutil.rmtree(old)
    return rows, diverged


def run_grid(
    grid: Grid,
    out: str,
    *,
    overwrite: bool = False,
    chunk_size: int | None = None,
    checkpoint_every: int | None = None,
    log=print,
) -> dict:
    """Trains every model of `grid` and writes the results folder `out`, resumably.

    Models train in chunks of `chunk_size` (default `default_chunk_size`), all chunks
    through one compiled program (the last chunk is padded). Every `checkpoint_every`
    steps (default: every evaluation) each chunk's stacked TrainState and curves are
    saved under `out/checkpoints/`. Re-running the same grid resumes from there (also
    after kill -9) and gives the same final results; re-running a finished grid trains
    nothing. A folder holding anything else is refused unless `overwrite`; then the new
    sweep is built in a temporary sibling and replaces the old folder only at the end.

    Returns {"rows", "curves", "wall_s", "diverged", "trained_steps"}.
    """
    plan = _make_plan(grid, chunk_size, checkpoint_every)
    ident = identity(grid)
    work, finished = _prepare_folder(out, ident, overwrite)
    if finished:
        log(f"{out}: this sweep is already finished; nothing to train")
        return _finished(out)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "sweep.json"), "w") as f:
        json.dump(ident, f, indent=1)
    cfg = grid.config
    log(
        f"sweep: {plan.k} model(s) in {plan.n_chunks} chunk(s) of {plan.chunk} x "
        f"{cfg.train.steps} steps on {jax.device_count()} {jax.default_backend()} device(s); "
        f"checkpoints every {plan.every} steps"
    )
    data = build_data(cfg)
    progress = _Progress(plan)
    parts = [_train_chunk(plan, c, work, data, progress, log) for c in range(plan.n_chunks)]
    wall = time.perf_counter() - progress.t0
    state = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *(p[0] for p in parts))
    curves = {n: np.concatenate([p[1][n] for p in parts]) for n in parts[0][1]}
    rows, diverged = _finish(plan, work, out, state, curves, wall, log)
    return {
        "rows": rows,
        "curves": results.curve_rows(curves),
        "wall_s": wall,
        "diverged": diverged,
        "trained_steps": progress.trained,
    }
