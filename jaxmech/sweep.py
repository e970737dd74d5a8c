"""Sweep specs: parse field values from the command line and expand a grid of models.

A spec is `a:b` (inclusive range), `a:b:step`, a comma list `1,3,5`, or one value.
Several swept fields form a grid (every combination), times `seeds` seeds each. Every
value is checked by constructing the Config it implies, so an out-of-range value fails
with the field's own message before anything is compiled.

`run_grid` trains a grid resumably (chunks, checkpoints, lock). Its models start from a
fresh init, or with `init_from=InitFrom(run, models, static)` from the trained params
of a finished results folder (fine-tuning: `reports.id_loss.finetune`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import operator
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmech import checkpoint, outdir, results, sizing
from jaxmech.config import SWEEPABLE, Config, ConfigError, Settings, field_default
from jaxmech.families import family_for
from jaxmech.outdir import SweepMismatchError  # noqa: F401  (re-exported: callers catch it here)
from jaxmech.train import (
    TrainState,
    build_data,
    check_train_only,
    curve_fields,
    diverged_models,
    init_program,
    pad_models,
    restart_state,
    stack_settings,
    step_budget,
    train_models,
)

# Short names users know from the papers.
ALIASES = {"n_pair": "n_pair_labels", "n_2": "layouts_per_pair"}


def field_type(name: str) -> type:
    """The Python type of a config field's values (from its default, in whichever
    family's or task's config has it)."""
    try:
        default = field_default(name)
    except KeyError:
        raise ConfigError(
            f"unknown config field {name!r}; known fields: {', '.join(Config.field_names())}"
        ) from None
    return int if default is None else type(default)


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
    twice = sorted({v for v in values if values.count(v) > 1}, key=values.index)
    if twice:
        # two equal grid points would be the same models, and an interval over them a lie
        raise ConfigError(f"--{name}={text!r}: {twice[0]!r} is given twice; give each value once")
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
    check_train_only(base)
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


def default_chunk_size(config: Config | None = None) -> int:
    """Models per compiled call on this machine: a fixed number per device.

    On CPU a constant (`sizing.CPU_CHUNK_PER_DEVICE`: on a 2-core CPU one model
    already keeps both cores busy and vmapping 4 gains ~1.5x per model over 1, larger K
    little more; BUILD_NOTES.md, Speed). On GPU/TPU throughput grows with the batch of
    models until memory runs out, so the chunk is sized by `config`'s measured memory
    per model against the device's memory (`sizing.chunk_per_device`; config default:
    SPEC). Fixed for a config and a machine, never fitted to a sweep's size, so that a
    model's numbers do not depend on how many models share its sweep (XLA may round
    differently for another number of vmapped models). A sweep with fewer models pads
    its chunk (padding repeats the last model).
    """
    per_dev, _ = sizing.chunk_per_device(config or Config())
    return per_dev * jax.device_count()


def program_record(chunk: int) -> dict:
    """What, besides a model's settings and seed, its numbers depend on: the compiled
    program's shape (models per chunk) and where it ran (BUILD_NOTES.md, guarantees)."""
    return {"chunk_size": chunk, "backend": jax.default_backend(), "devices": jax.device_count()}


def _program_text(p: dict) -> str:
    return f"chunks of {p['chunk_size']} model(s) on {p['devices']} {p['backend']} device(s)"


class InitFrom(NamedTuple):
    """Where a sweep's models start: the trained params of a finished results folder
    instead of a fresh init (`run_grid(..., init_from=...)`).

    run: the base run, a finished results folder (`results.load_run`) of the grid's
      model family (`model_kind`) whose params fit the grid config's models.
    models: one entry per model of the grid, in the grid's order: the index of the base
      model (results.csv `model`, the params' row) it starts from. A base model may
      start several grid models; a diverged one starts none.
    static: optional per-model constants of `params["static"]` that replace or add to
      the base's: {name: array [K, ...]} for the grid's K models, each a constant the
      grid config's models have (e.g. `id_target` when `id_site > 0`). Values are cast
      to the constant's dtype. For `check_init_from` alone a value may be a
      `jax.ShapeDtypeStruct` (checked by shape, before the values are computed).

    Each model starts at step 0 from its params with a fresh optimiser state
    (`train.restart_state`); its seed still draws its batches.
    """

    run: str
    models: tuple[int, ...]
    static: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class _Start:
    """A resolved `InitFrom`: the starting params and what `sweep.json` records."""

    params: Any  # host NumPy [n_chunks * chunk, ...] (padded by repeating the last model)
    record: dict  # `identity`'s "init_from" (see `_start`)


def params_fingerprint(tree) -> str:
    """sha256 over a params tree: each leaf's path, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.ascontiguousarray(np.asarray(x))
        h.update(f"{jax.tree_util.keystr(path)} {x.dtype.str} {x.shape}\n".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _check_base(grid: Grid, init_from, out: str | None) -> None:
    """Checks `init_from`'s type and its base run's folder (not `out`; a finished
    results folder, from config.json alone) and family."""
    if not isinstance(init_from, InitFrom):
        raise TypeError(
            f"init_from = {init_from!r}: expected a sweep.InitFrom(run, models, static)"
        )
    run = init_from.run
    if not isinstance(run, (str, os.PathLike)):
        raise ValueError(f"init_from.run = {run!r}: expected the path of a results folder")
    mine = {os.path.abspath(out), os.path.abspath(outdir.staging_path(out))} if out else set()
    if os.path.abspath(run) in mine:
        raise ValueError(
            f"init_from.run = {run!r} is the sweep's own output folder: a sweep cannot start "
            "from the folder it writes; choose another --out"
        )
    try:
        kind = results.load_config(run).model.model_kind
    except ValueError as e:
        raise ValueError(f"init_from.run: {e}") from None
    if kind != grid.config.model.model_kind:
        raise ValueError(
            f"init_from.run = {run!r} holds model_kind = {kind!r} models, this grid trains "
            f"{grid.config.model.model_kind!r}: a model starts only from params of its own "
            "family"
        )


def _check_models(models, k: int) -> list[int]:
    """`init_from.models` as K ints (their range is checked against the base run)."""
    try:
        if isinstance(models, (str, bytes)) or any(isinstance(m, bool) for m in models):
            raise TypeError
        models = [operator.index(m) for m in models]
    except TypeError:
        raise ValueError(
            f"init_from.models = {models!r}: expected one base model index (an integer) per "
            "model of the grid"
        ) from None
    if len(models) != k:
        raise ValueError(
            f"init_from.models has {len(models)} entries for the grid's {k} model(s): give "
            "one base model index per model of the grid"
        )
    return models


def _check_in_base(models: list[int], base: results.Run, run: str) -> None:
    """Every base model index names a model of the base run that did not diverge."""
    n_base = len(np.asarray(base.settings.seed))
    rows = {int(r["model"]): r for r in base.results if "model" in r}
    for i, m in enumerate(models):
        if not 0 <= m < n_base:
            raise ValueError(
                f"init_from.models[{i}] = {m} is out of range: {run!r} has {n_base} "
                f"model(s), 0..{n_base - 1}"
            )
        div = int(rows.get(m, {}).get("diverged_step", -1))
        if div >= 0:
            raise ValueError(
                f"init_from.models[{i}] = {m}: base model {m} of {run!r} diverged at step "
                f"{div}; its params are the last finite ones, not a trained model"
            )


def _check_static(static: dict, like_static: dict, k: int) -> None:
    """Each override names one of the grid's constants, with one row per model."""
    for name, v in static.items():
        if name not in like_static:
            raise ValueError(
                f"init_from.static[{name!r}]: not a constant of this grid's models "
                f"(params['static'] holds {', '.join(sorted(like_static)) or 'nothing'})"
            )
        want = (k, *like_static[name].shape[1:])
        if _shape(v) != want:
            raise ValueError(
                f"init_from.static[{name!r}] has shape {_shape(v)}: expected {want} (one "
                "row per model of the grid, then the constant's shape)"
            )


def _fit_problems(start, like, static: dict) -> list[str]:
    """How params `start` [K, ...] (static overrides merged in) differ from the grid's
    init `like` [1, ...]: missing or extra leaves, per-model shapes, dtypes."""
    flat = lambda t: {  # noqa: E731
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(t)[0]
    }
    got, want = flat(start), flat(like)
    overridden = {f"['static']['{n}']" for n in static}  # cast to the init's dtype later
    problems = [f"{n} missing" for n in want if n not in got]
    problems += [f"{n} is not in this grid's models" for n in got if n not in want]
    for n in (n for n in want if n in got):
        if _shape(got[n])[1:] != want[n].shape[1:]:
            problems.append(f"{n} has shape {_shape(got[n])[1:]}, expected {want[n].shape[1:]}")
        elif n not in overridden and got[n].dtype != want[n].dtype:
            problems.append(f"{n} is {got[n].dtype}, expected {want[n].dtype}")
    return problems


def _check_start(grid: Grid, init_from, out: str | None = None):
    """(base run's absolute path, the grid's models' base params [K, ...] as host
    NumPy, the static overrides, the grid's init params' shapes [1, ...]) after every
    check of `init_from`; a ValueError naming the argument (`init_from.run`, `.models`,
    `.static`) for anything wrong. No compute: it reads the base folder and traces the
    init's shapes."""
    _check_base(grid, init_from, out)
    run, k = init_from.run, len(grid.settings)
    models = _check_models(init_from.models, k)
    try:
        base = results.load_run(run)
    except ValueError as e:
        raise ValueError(f"init_from.run: {e}") from None
    _check_in_base(models, base, run)
    one = stack_settings(list(grid.settings[:1]))
    like = jax.eval_shape(lambda s: init_program(s, grid.config), one).params
    static = dict(init_from.static or {})
    _check_static(static, like.get("static", {}) if isinstance(like, dict) else {}, k)
    params = jax.tree_util.tree_map(lambda x: np.asarray(x)[np.asarray(models, int)], base.params)
    merged = {**params, "static": {**params.get("static", {}), **static}} if static else params
    problems = _fit_problems(merged, like, static)
    if problems:
        hint = " (a missing constant can be given in init_from.static)"
        raise ValueError(
            f"init_from.run = {run!r}: its params do not fit the models of this grid's "
            f"config: {'; '.join(problems[:4])}"
            + (hint if any("missing" in p and "static" in p for p in problems) else "")
        )
    return os.path.abspath(run), params, static, like


def check_init_from(grid: Grid, init_from: InitFrom) -> None:
    """Checks `init_from` against `grid` as `run_grid` does, without computing: raises
    ValueError naming the argument (`init_from.run`, `.models`, `.static`)."""
    _check_start(grid, init_from)


def _start(grid: Grid, init_from: InitFrom, n_padded: int, out: str | None) -> _Start:
    """The starting params of every model (padded to `n_padded`) and their record."""
    path, params, static, like = _check_start(grid, init_from, out)
    cast = {}
    for name, v in static.items():
        if isinstance(v, jax.ShapeDtypeStruct):
            raise ValueError(
                f"init_from.static[{name!r}] is a shape ({v}), not values: give the arrays "
                "to train (shapes are for check_init_from)"
            )
        cast[name] = np.asarray(v, like["static"][name].dtype)
    start = {**params, "static": {**params["static"], **cast}} if cast else params
    record = {
        "run": path,
        "models": [operator.index(m) for m in init_from.models],
        "static": sorted(cast),
        "base_sha256": params_fingerprint(params),  # the base models' params, as stored
        "sha256": params_fingerprint(start),  # what training starts from
    }
    return _Start(pad_models(start, n_padded), record)


def _start_difference(old: dict | None, new: dict | None) -> str | None:
    """What a folder's `init_from` record (None: a fresh init) holds instead of `new`."""
    if old == new:
        return None
    if new is None:
        return f"a sweep started from the params of {old['run']!r} (init_from), not a fresh init"
    if old is None:
        return f"a sweep from a fresh init, not one started from {new['run']!r} (init_from)"
    if old["run"] != new["run"]:
        return (
            f"a sweep started from {old['run']!r} (folder), not from {new['run']!r} (init_from.run)"
        )
    if old["models"] != new["models"]:
        return f"a sweep started from other models of {new['run']!r} (init_from.models)"
    if old["static"] != new["static"]:
        return (
            f"a sweep with other static overrides ({', '.join(old['static']) or 'none'} "
            f"(folder) vs {', '.join(new['static']) or 'none'}; init_from.static)"
        )
    if old["base_sha256"] != new["base_sha256"]:
        return (
            f"a sweep started from other params: the base run {new['run']!r} changed since "
            f"this sweep began (its models' params: sha256 {old['base_sha256'][:12]}... "
            f"(folder) vs {new['base_sha256'][:12]}... now; was it trained again?)"
        )
    return (
        f"a sweep started from other static constants (init_from.static values: sha256 "
        f"{old['sha256'][:12]}... (folder) vs {new['sha256'][:12]}... now)"
    )


# ---------------------------------------------------------------------------
# Seeds until enough models pass a rule stated before training (`Until`)

SELECTION_FILE = "selection.json"  # the rule (before training) and who passed (after)
PASS_AT_LEAST = 0.9  # the default rule's threshold (BUILD_NOTES: "generalising")


class PassRule(NamedTuple):
    """A model passes when its final `metric` (a results.csv column: the family's
    metrics) is >= `at_least`. A diverged model's metrics are NaN: it never passes."""

    metric: str
    at_least: float

    def text(self) -> str:
        return f"{self.metric} >= {self.at_least:g}"

    def passes(self, values) -> np.ndarray:
        v = np.asarray(values, float)
        return np.isfinite(v) & (v >= self.at_least)

    def record(self) -> dict:
        return {"metric": self.metric, "at_least": float(self.at_least)}


class Until(NamedTuple):
    """`run_grid(..., until=...)`: the grid's seeds (one grid point, `max_seeds` of
    them) train chunk by chunk, in seed order, until at least `passing` models pass
    `rule`; the chunks after that one are never trained. Every trained model is kept
    and listed in `SELECTION_FILE` with whether it passed."""

    passing: int
    max_seeds: int
    rule: PassRule

    def record(self) -> dict:
        return {"seeds_until": self.passing, "max_seeds": self.max_seeds,
                "rule": self.rule.record(), "text": self.rule.text()}  # fmt: skip


def until_cap(passing: int, max_seeds: int | None) -> int:
    """The seeds a `--seeds_until=passing` run may try (`--max_seeds`, default 4 x N),
    checked before any compute: ConfigError naming the flag."""
    if passing < 1:
        raise ConfigError(
            f"--seeds_until={passing}: allowed an integer >= 1 (models that must pass)"
        )
    cap = 4 * passing if max_seeds is None else max_seeds
    if cap < passing:
        raise ConfigError(
            f"--max_seeds={cap} is below --seeds_until={passing}: the cap on seeds tried "
            f"must allow {passing} passing models"
        )
    return cap


def parse_rule(config: Config, text: str | None) -> PassRule:
    """`--pass_rule` as a PassRule: `METRIC>=VALUE`, METRIC one of the family's metrics;
    None: the family's progress metric >= PASS_AT_LEAST (the toy VLM: unseen_min_acc,
    unseen-pair accuracy on every relation). ConfigError naming the flag."""
    family = family_for(config)
    if text is None:
        if family.progress_metric is None:
            raise ConfigError(f"--seeds_until: model_kind = {family.name!r} has no default "
                              "rule; give --pass_rule=METRIC>=VALUE")  # fmt: skip
        return PassRule(family.progress_metric, PASS_AT_LEAST)
    metric, sep, value = (x.strip() for x in text.partition(">="))
    metrics = family.metrics(config)
    if not sep or metric not in metrics:
        raise ConfigError(f"--pass_rule={text!r}: expected METRIC>=VALUE with METRIC one of "
                          f"{', '.join(metrics)}")  # fmt: skip
    try:
        return PassRule(metric, float(value))
    except ValueError:
        raise ConfigError(f"--pass_rule={text!r}: {value!r} is not a number") from None


def seeds_until(grid: Grid, passing: int, max_seeds: int | None = None, rule=None) -> Until:
    """The `Until` of `--seeds_until=passing` (`--max_seeds`, `--pass_rule`) for
    `grid`, which holds the cap's seeds of one grid point; ConfigError naming the flag,
    before any compute."""
    cap = until_cap(passing, max_seeds)
    if grid.swept:
        raise ConfigError(f"--seeds_until: trains the seeds of one config; {', '.join(grid.swept)} "
                          "is swept: run one --seeds_until per value")  # fmt: skip
    if len(grid.settings) != cap:
        raise ConfigError(f"--seeds_until: the grid holds {len(grid.settings)} seed(s), the cap "
                          f"(--max_seeds) is {cap}: expand it with seeds = the cap")  # fmt: skip
    return Until(passing, cap, parse_rule(grid.config, rule))


def _until_difference(old: dict | None, new: dict | None) -> str:
    """What a folder's "until" record (None: a plain sweep) holds instead of `new`."""
    words = lambda u: (  # noqa: E731
        "a plain sweep"
        if u is None
        else f"seeds until {u['seeds_until']} pass {u['text']} (at most {u['max_seeds']})"
    )
    return f"{words(old)} (folder), not {words(new)}: its selection rule is fixed at its start"


def passing_mask(rule: PassRule, curves: dict, diverged_step) -> np.ndarray:
    """[K] whether each model passes `rule` on its last evaluation (`curves` [K, E])."""
    return rule.passes(np.asarray(curves[rule.metric])[:, -1]) & (np.asarray(diverged_step) < 0)


def _write_selection(folder: str, record: dict) -> None:
    # written beside sweep.json before any model trains, completed after the last
    results.write_json(os.path.join(folder, SELECTION_FILE), record)


def _selection_outcome(until: Until, settings: Settings, passed: np.ndarray, log) -> dict:
    """`SELECTION_FILE`'s record after training: the rule, the models trained (every
    one, by index and seed) and which passed; logged, with a warning at the cap."""
    seeds = np.asarray(settings.seed).tolist()
    record = until.record() | {
        "trained": len(seeds),
        "seeds": seeds,
        "passing_models": np.flatnonzero(passed).tolist(),
        "failing_models": np.flatnonzero(~passed).tolist(),
    }
    n = int(passed.sum())
    log(f"selection: n = {n} of {len(seeds)} trained pass {until.rule.text()} (seeds "
        f"{seeds[0]}..{seeds[-1]}); passing models {record['passing_models']}")  # fmt: skip
    if n < until.passing:
        log(f"WARNING: --max_seeds={until.max_seeds} seeds tried and only {n} pass "
            f"(--seeds_until={until.passing} asked); every one is kept")  # fmt: skip
    return record


def read_selection(path: str, rows: list[dict]) -> dict | None:
    """The selection of results folder `path` (None: it has no `SELECTION_FILE`), after
    checking that its rule is the one the run trained under (sweep.json's "until") and
    that its passing models are the ones the rule gives on results.csv `rows`: a report
    cannot move the rule or the models after training. ValueError naming the file."""
    file = os.path.join(path, SELECTION_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            sel = json.load(f)
        with open(os.path.join(path, "sweep.json")) as f:
            until = json.load(f).get("until")
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable selection or sweep.json ({e})") from None
    fixed = None if until is None else (until.get("rule"), until.get("text"))
    if not isinstance(sel, dict) or fixed != (sel.get("rule"), sel.get("text")):
        raise ValueError(
            f"{file}: its rule is not the one this run trained under (sweep.json: "
            f"{None if until is None else until.get('text')!r}); a selection is fixed before "
            "training: train again (--overwrite) to select by another rule"
        )
    if sel.get("trained") != len(rows):
        raise ValueError(f"{file}: lists {sel.get('trained')} model(s) trained, results.csv "
                         f"{len(rows)}; the folder was changed after training")  # fmt: skip
    rule = PassRule(sel["rule"]["metric"], sel["rule"]["at_least"])
    ok = rule.passes([r.get(rule.metric, np.nan) for r in rows])
    ok &= np.asarray([r["diverged_step"] < 0 for r in rows], bool)
    if sel.get("passing_models") != [int(r["model"]) for r, p in zip(rows, ok) if p]:
        raise ValueError(
            f"{file}: its passing models {sel.get('passing_models')} are not the ones "
            f"{rule.text()} gives on results.csv; the folder was changed after training"
        )
    return sel


def identity(
    grid: Grid, chunk: int | None = None, start: dict | None = None, until: Until | None = None
) -> dict:
    """What a sweep folder must match to be resumed: the config, every model's settings
    and the program (`program_record`; chunk default `default_chunk_size`); with
    `start` (a sweep from trained params: `_Start.record`) also "init_from": the base
    run's absolute path, the base model of each model, the overridden static names
    and sha256 fingerprints of the base models' params and of the starting params;
    with `until` (seeds until enough pass) also "until": `Until.record`, so that the
    rule cannot change between a run's start and its resume."""
    ident = {
        "format": 1,
        "config": json.loads(grid.config.to_json()),
        "swept": list(grid.swept),
        "settings": [s._asdict() for s in grid.settings],
        "program": program_record(chunk or default_chunk_size(grid.config)),
    }
    if start is not None:  # a fresh sweep's sweep.json keeps exactly the keys above
        ident["init_from"] = start
    if until is not None:
        ident["until"] = until.record()
    return ident


def sweep_difference(stored: dict, ident: dict) -> str | None:
    """None when a folder's `sweep.json` describes the sweep `ident` (see `identity`),
    else what the folder holds instead, for the error message.

    Compared as configs and settings, not as text: a field added to the code since the
    folder was written takes its default, so an old sweep still resumes (or is found
    finished) when its values are the defaults. A folder written before programs were
    recorded matches any program. A sweep from trained params matches only the same
    start (`identity`'s "init_from": base run, models, fingerprints).
    """
    if stored == ident:
        return None
    try:
        if stored.get("format") != ident["format"] or stored.get("swept") != ident["swept"]:
            return "a different sweep (other swept fields)"
        old = Config.from_json(json.dumps(stored["config"])).flat()
        new = Config.from_json(json.dumps(ident["config"])).flat()
        changed = [f"{n} {old[n]!r} (folder) vs {new[n]!r}" for n in new if old[n] != new[n]]
        if changed:
            return "a different sweep (" + ", ".join(changed[:3]) + ")"
        if stored.get("until") != ident.get("until"):
            return _until_difference(stored.get("until"), ident.get("until"))
        defaults = Config().flat()
        fill = lambda s: {n: s.get(n, defaults[n]) for n in SWEEPABLE}  # noqa: E731
        if [fill(s) for s in stored["settings"]] != [fill(s) for s in ident["settings"]]:
            return "a different sweep (other models: swept values or seeds)"
        start = _start_difference(stored.get("init_from"), ident.get("init_from"))
        if start:
            return start
    except (ConfigError, KeyError, TypeError, AttributeError, ValueError):
        return "a sweep.json this version cannot read"
    program = stored.get("program", ident["program"])
    if program != ident["program"]:
        devices = ""
        if program.get("backend") == "cpu":  # entry points take one CPU device per core
            devices = f", with {sizing.CPU_DEVICES_ENV}={program.get('devices')}"
        return (
            f"this sweep run as {_program_text(program)}, not {_program_text(ident['program'])} "
            "(its models' numbers would differ; give the same --chunk_size on a machine "
            f"like the one it ran on{devices})"
        )
    return None


def _folder_difference(ident: dict):
    """`outdir.prepare`'s check: what a folder holds if not this sweep (None if it does)."""

    def check(folder: str) -> str | None:
        path = os.path.join(folder, "sweep.json")
        if not os.path.isfile(path):
            return "other files"
        try:
            with open(path) as f:
                stored = json.load(f)
        except (ValueError, OSError):
            return f"a sweep.json that does not parse ({path})"
        return sweep_difference(stored, ident) if isinstance(stored, dict) else "other files"

    return check


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
    start: _Start | None = None  # trained params the models start from (None: fresh init)

    @property
    def k(self) -> int:
        return len(self.grid.settings)

    @property
    def program(self) -> dict:
        return program_record(self.chunk)

    def chunk_slice(self, c: int) -> slice:
        return slice(c * self.chunk, (c + 1) * self.chunk)

    def n_real(self, c: int) -> int:
        return min(self.chunk, self.k - c * self.chunk)


def _make_plan(
    grid: Grid,
    chunk_size: int | None,
    checkpoint_every: int | None,
    init_from: InitFrom | None = None,
    out: str | None = None,
) -> _Plan:
    cfg = grid.config
    every = cfg.train.eval_every if checkpoint_every is None else checkpoint_every
    if every < 1 or every % cfg.train.eval_every:
        raise ValueError(
            f"checkpoint_every = {every} is invalid: allowed a positive multiple of "
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
            f"  chunk {c + 1}/{plan.n_chunks} step {step}/{plan.grid.config.train.steps}  "
            f"{rate:.0f} model-steps/s  ETA {eta:.0f} s  "
        )
        if self.rule:
            r = self.rule
            now = int(r.passes(curves[r.metric][: plan.n_real(c), col]).sum())
            seen = c * plan.chunk + plan.n_real(c)
            text += f"{r.metric}>={r.at_least:g}: {self.passed_before + now}/{seen}{self.until}  "
        return text + f"({seg_s:.1f} s this segment)"

    def chunk_done(self, plan: _Plan, c: int, curves: dict) -> None:
        if self.rule:
            last = curves[self.rule.metric][: plan.n_real(c), -1]
            self.passed_before += int(self.rule.passes(last).sum())


# ---------------------------------------------------------------------------
# Several processes: process 0 reads and writes the folder, every process trains


class OtherProcessError(RuntimeError):
    """Process 0 of a multi-process sweep stopped with an error (its output names it)."""


def is_writer() -> bool:
    """Whether this process writes a sweep's folder: process 0 (the only one, usually)."""
    return jax.process_index() == 0


def _quiet(*_) -> None:
    pass


def _share(tree):
    """Process 0's host arrays `tree` on every process, bit for bit (each process passes
    a tree of the same shapes and dtypes)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    # gathered, then process 0's row: broadcast_one_to_all adds zeros, which turns -0.0
    # into 0.0 (a resumed model would then differ from an uninterrupted one)
    stacked = multihost_utils.process_allgather(tree, tiled=False)
    return jax.tree_util.tree_map(lambda x: np.array(x[0]), stacked)  # a writable copy


def _on_writer(read, like):
    """`read()` run by process 0; its result (None, or host arrays shaped as `like`) on
    every process. An error in `read` is raised on process 0 and as OtherProcessError on
    the others, so that no process waits for a peer that stopped."""
    tree, code = None, 0
    if is_writer():
        try:
            tree = read()
        except BaseException:
            _share(np.int32(2))  # tell the others before raising
            raise
        code = 0 if tree is None else 1
    code = int(_share(np.int32(code)))
    if code == 2:
        raise OtherProcessError(
            "process 0 of this multi-process sweep stopped with an error (its output says "
            "which); every process stops"
        )
    if code == 0:
        return None
    zeros = lambda x: np.zeros(np.shape(x), x.dtype)  # noqa: E731
    return _share(tree if is_writer() else jax.tree_util.tree_map(zeros, like))


def _not_written(plan: _Plan, wall: float, trained: int, selection) -> dict:
    """What `run_grid` returns on a process that does not write the folder."""
    return {"rows": None, "curves": None, "wall_s": wall, "diverged": None,
            "trained_steps": trained, "program": plan.program, "selection": selection,
            "writer": False}  # fmt: skip


def _restore_chunk(plan: _Plan, c: int, ckpt_dir: str, log):
    """(state or None, curves [chunk, n_evals] per field) of chunk c: its checkpoint if
    there is one, else nothing trained (NaN curves). Process 0 reads it, every process
    gets it (`_on_writer`)."""
    cfg = plan.grid.config
    curves = {
        n: np.full((plan.chunk, cfg.train.n_evals), np.nan, np.float32)
        for n in plan.fields + ("step",)
    }
    chunk_settings = jax.tree_util.tree_map(lambda x: x[: plan.chunk], plan.settings)
    like = {"state": jax.eval_shape(lambda s: init_program(s, cfg), chunk_settings),
            "curves": curves}  # fmt: skip
    tree = _on_writer(lambda: _read_chunk(plan, c, ckpt_dir, like, log), like)
    if tree is None:
        return None, curves
    # in the order of a fresh run (a shared dict comes back sorted), so that curves.csv's
    # columns do not depend on a resume
    return tree["state"], {n: tree["curves"][n] for n in curves}


def _read_chunk(plan: _Plan, c: int, ckpt_dir: str, like: dict, log) -> dict | None:
    """Chunk c's newest intact checkpoint as a tree like `like` (None: there is none);
    CheckpointError when it belongs to another chunk or sweep."""
    if checkpoint.latest_step(ckpt_dir) is None:
        return None
    # the newest intact step; damaged ones are reported through `log` and dropped
    found = checkpoint.restore_latest(ckpt_dir, like, log)
    if found is None:
        log(f"  chunk {c + 1}/{plan.n_chunks}: no intact checkpoint; training it from step 0")
        return None
    tree, meta, _ = found
    if meta.get("chunk") != c or meta.get("settings") != _settings_meta(plan, c):
        raise checkpoint.CheckpointError(
            f"checkpoint in {ckpt_dir!r} belongs to another chunk or sweep; remove the "
            "folder or pass --overwrite"
        )
    return {"state": TrainState(*tree["state"]), "curves": tree["curves"]}


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
    state, curves = _restore_chunk(plan, c, ckpt_dir, log)
    if state is None and plan.start is not None:  # step 0 from the trained params
        params_c = jax.tree_util.tree_map(lambda x: x[plan.chunk_slice(c)], plan.start.params)
        state = restart_state(cfg, settings_c, params_c)
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
        saved = ({"state": state, "curves": curves},
                 {"chunk": c, "step": step, "settings": _settings_meta(plan, c)})  # fmt: skip
        # process 0 writes; a failed write stops the others now, not at a later collective
        _on_writer(lambda: checkpoint.save(ckpt_dir, step, *saved), None)
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
    shutil.rmtree(os.path.join(work, "checkpoints"))
    outdir.publish(work, out)  # --overwrite: the old folder is replaced only now
    return rows, diverged


def run_grid(
    grid: Grid,
    out: str,
    *,
    overwrite: bool = False,
    chunk_size: int | None = None,
    checkpoint_every: int | None = None,
    init_from: InitFrom | None = None,
    until: Until | None = None,
    log=print,
) -> dict:
    """Trains every model of `grid` and writes the results folder `out`, resumably.

    Models train in chunks of `chunk_size` (default `default_chunk_size`: fixed per
    backend), all chunks through one compiled program (the last chunk is padded), so a
    model's numbers depend on its settings, its seed and that program, not on the other
    models of the sweep. Every `checkpoint_every` steps (default: every evaluation) each
    chunk's stacked TrainState and curves are saved (checksummed) under
    `out/checkpoints/`. Re-running the same grid resumes from the newest intact
    checkpoint (also after kill -9) and gives the same final results; re-running a
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

    Several processes (`jax.distributed`, `--distributed`): every process calls
    `run_grid` with the same arguments and trains its devices' share of each chunk (the
    mesh spans every process's devices). Process 0 alone holds the lock and reads and
    writes `out` (checkpoints included), and hands each checkpoint it reads to the
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
    plan = _make_plan(grid, chunk_size, checkpoint_every, init_from, out)
    outdir.check_usable(out)
    log = log if is_writer() else _quiet  # one process speaks for a multi-process sweep
    start = None if plan.start is None else plan.start.record
    ident = identity(grid, plan.chunk, start, until)
    with contextlib.ExitStack() as held:
        folder = {"work": out}  # where process 0 trains; the others never touch it

        def open_folder():  # process 0: the lock (held to the end), then the folder
            held.enter_context(outdir.locked(out, log))
            folder["work"], finished = _open_folder(out, ident, overwrite, until)
            return np.int32(finished)

        if _on_writer(open_folder, np.int32(0)):
            if not is_writer():
                return _not_written(plan, 0.0, 0, None)
            outdir.publish(folder["work"], out)  # a finished --overwrite whose swap was cut
            log(f"{out}: this sweep is already finished; nothing to train")
            return _finished(out)
        return _train_all(plan, folder["work"], out, log, until)


def _open_folder(out: str, ident: dict, overwrite: bool, until) -> tuple[str, bool]:
    """(folder to train in, whether it holds the finished sweep), `outdir.prepare`d; a
    new or resumed one holds sweep.json (and the `until` rule) before any model trains."""
    work, finished = outdir.prepare(out, _folder_difference(ident), overwrite)
    if not finished:
        os.makedirs(work, exist_ok=True)
        with open(os.path.join(work, "sweep.json"), "w") as f:
            json.dump(ident, f, indent=1)
        if until is not None:  # the rule, before any model trains
            _write_selection(work, until.record())
    return work, finished


def _train_chunks(plan: _Plan, work: str, data, progress: _Progress, log, until) -> list:
    """Every chunk's (state, curves), trained or resumed in order; with `until`, only
    up to the chunk in which the passing models reach `until.passing`."""
    parts, passed = [], 0
    for c in range(plan.n_chunks):
        parts.append(_train_chunk(plan, c, work, data, progress, log))
        if until is not None:
            passed += int(passing_mask(until.rule, parts[-1][1], parts[-1][0].diverged_step).sum())
            if passed >= until.passing:
                break
    return parts


def _train_all(plan: _Plan, work: str, out: str, log, until: Until | None = None) -> dict:
    """Trains (or resumes) every chunk in `work` (with `until`: as far as it asks), then
    writes and publishes the results."""
    cfg = plan.grid.config
    start = "" if plan.start is None else f" from the params of {plan.start.record['run']}"
    log(
        f"sweep: {plan.k} model(s) in {plan.n_chunks} chunk(s) of {plan.chunk} x "
        f"{cfg.train.steps} steps{start} on {jax.device_count()} {jax.default_backend()} "
        f"device(s); checkpoints every {plan.every} steps"
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
