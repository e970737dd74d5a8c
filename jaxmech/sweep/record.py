"""The sweep's identity: what a sweep folder's `sweep.json` records so that a rerun
resumes it only if it is the same sweep (`identity`), and what differs if not
(`sweep_difference`, the check `outdir.prepare` runs: `_folder_difference`).

Besides the config and every model's settings, the identity holds the compiled
program's shape and where it ran (`program_record`; models per chunk:
`default_chunk_size`), a fine-tune start's record (`init_from`) and the `--seeds_until`
rule (`until`). The module is not named `identity` so as not to hide that function.
"""

from __future__ import annotations

import json
import os

import jax

from jaxmech import sizing
from jaxmech.config import SWEEPABLE, Config, ConfigError
from jaxmech.sweep.init_from import _start_difference
from jaxmech.sweep.spec import Grid
from jaxmech.sweep.until import Until, _until_difference


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
    start (`identity`'s "init_from": base run, models, fingerprints). A `--seeds_until`
    folder matches its run with the cap raised (`_until_difference`): the seeds it
    holds are then the first of the new grid's.
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
        models = ident["settings"]
        if stored.get("until") != ident.get("until"):
            until = _until_difference(stored.get("until"), ident.get("until"))
            if until:
                return until
            models = models[: len(stored["settings"])]  # a raised cap adds seeds after them
        defaults = Config().flat()
        fill = lambda s: {n: s.get(n, defaults[n]) for n in SWEEPABLE}  # noqa: E731
        if [fill(s) for s in stored["settings"]] != [fill(s) for s in models]:
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
