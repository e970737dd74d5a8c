"""Sweep specs: parse field values from the command line and expand a grid of models.

A spec is `a:b` (inclusive range), `a:b:step`, a comma list `1,3,5`, or one value.
Several swept fields form a grid (every combination), times `seeds` seeds each. Every
value is checked by constructing the Config it implies, so an out-of-range value fails
with the field's own message before anything is compiled. With finite-set training the
grid's program length follows the models' budgets (`finite_steps`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from jaxmech.config import SWEEPABLE, Config, ConfigError, Settings, field_default
from jaxmech.families import family_for
from jaxmech.train import (
    check_train_only,
    stack_settings,
    step_budget,
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
