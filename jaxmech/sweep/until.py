"""Seeds until enough models pass a rule stated before training (`--seeds_until`).

`seeds_until` builds the `Until` (the count, the cap of seeds `until_cap`, the
`PassRule` `parse_rule` reads from `--pass_rule`); `run_grid(..., until=...)` trains
chunk by chunk until enough pass (`passing_mask`). The rule is written to
`SELECTION_FILE` before any model trains and the outcome after (`_selection_outcome`);
`read_selection` reads it back, checked against the rule the run trained under. A
resume may raise the cap, never change the rule or the count (`_until_difference`);
`raised_until` records the caps raised from (`cap_words` says them).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from jaxmech import results
from jaxmech.config import Config, ConfigError, Settings
from jaxmech.families import family_for
from jaxmech.sweep.spec import Grid

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
    and listed in `SELECTION_FILE` with whether it passed. The cap is a budget: a
    resume may raise it (`raised_until`; the caps before, oldest first, in
    `raised_from`), never lower it, and never change `passing` or `rule`."""

    passing: int
    max_seeds: int
    rule: PassRule
    raised_from: tuple[int, ...] = ()

    def record(self) -> dict:
        rec = {"seeds_until": self.passing, "max_seeds": self.max_seeds,
               "rule": self.rule.record(), "text": self.rule.text()}  # fmt: skip
        if self.raised_from:  # a run never raised keeps the record it always had
            rec["raised_from"] = list(self.raised_from)
        return rec


def cap_words(record: dict) -> str:
    """The cap of an `Until.record` (sweep.json's "until", selection.json) in words."""
    raised = record.get("raised_from")
    before = f", raised from {', '.join(map(str, raised))}" if raised else ""
    return f"cap {record['max_seeds']} seeds{before}"


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


def _until_difference(old: dict | None, new: dict | None) -> str | None:
    """None when `new` (an `Until.record`) is the folder's `old` rule with its cap kept
    or raised (`raised_until`), else what the folder holds instead (None: a plain
    sweep): the count and the rule are fixed at a run's start, the cap only grows."""
    words = lambda u: (  # noqa: E731
        "a plain sweep"
        if u is None
        else f"seeds until {u['seeds_until']} pass {u['text']} (at most {u['max_seeds']})"
    )
    fixed = ("seeds_until", "rule", "text")
    if old is not None and new is not None and all(old.get(k) == new.get(k) for k in fixed):
        if new["max_seeds"] >= old["max_seeds"]:
            return None
        return (f"{words(old)} (folder), not at most {new['max_seeds']}: a cap may be raised, "
                f"never lowered (--max_seeds >= {old['max_seeds']})")  # fmt: skip
    return f"{words(old)} (folder), not {words(new)}: its selection rule is fixed at its start"


def raised_until(stored: dict | None, until: Until) -> Until:
    """`until` with the caps its folder's run was raised from (`stored`: the folder's
    sweep.json "until", None for a new folder), its own cap last when it raises it
    again. Call it after `_until_difference` accepted `until`."""
    if stored is None:
        return until
    earlier = tuple(stored.get("raised_from", ()))
    if until.max_seeds > stored["max_seeds"]:
        earlier += (stored["max_seeds"],)
    return until._replace(raised_from=earlier)


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
        f"{seeds[0]}..{seeds[-1]}; {cap_words(record)}); passing models "
        f"{record['passing_models']}")  # fmt: skip
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
