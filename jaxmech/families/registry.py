"""The one list of model families, and how a config or a folder finds its own.

The two contracts (a trained family, a checkpoint family) are `families.contract`'s.
A family is one package under `families/` whose `family.py` holds its `FAMILY`;
listing it here (`LISTED`: its name, the module of its `FAMILY`, the config.json
`model_type`s it reads) or registering it from a test (`register`) is the only place that
names it. A listed family's package is imported when it is first asked for (by kind, by a
folder's `model_type`, by name), so a command imports only the families it uses.
`train` and `sweep` know a trained family only through its contract; reports and the
paper 003 / 004 methods know a VLM only through its view (`families.vlm_view`).

Everything that goes into the jitted functions besides params (the caption table, eval
sets) comes from the task's `tables` and `evals`; settings are the model's sweepable
scalars. Behaviour switches without a trained parameter (the text tower's causal mask,
the logit-scale cap) live in `params["static"]`, a subtree of constants that the
forward reads with a stopped gradient: they travel with the params into checkpoints,
analyses and vmaps, and training norms leave them out (`trainable`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import MutableMapping

from jaxmech.config import Config, ConfigError, register_model_config
from jaxmech.data.tasks import get_task
from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily, StandIn, TrainedFamily

__all__ = ["VLM_REPORTS", "CheckpointFamily", "StandIn", "TrainedFamily"]


@dataclasses.dataclass(frozen=True)
class Listed:
    """A family listed by where it lives, its package not imported yet: `module` holds
    its `FAMILY`; a checkpoint family's `checkpoint_types` (the config.json
    `model_type`s it reads) are listed here too, so a folder finds its family without
    importing the others; `trained`: it has a model config (`model_kind = name`);
    `formerly`: a trained family's old kinds, which saved configs still hold
    (`config.RENAMED_MODEL_KINDS`)."""

    name: str
    module: str
    checkpoint_types: tuple[str, ...] = ()
    trained: bool = False
    formerly: tuple[str, ...] = ()


class Families(MutableMapping):
    """name -> family, in registration order. A family listed by module (`Listed`) is
    imported when it is first asked for (`families[name]`, `.values()`), so a command
    imports only the families it uses; `held()` reads the entries without importing."""

    def __init__(self):
        self._held: dict = {}

    def __getitem__(self, name):
        entry = self._held[name]
        if isinstance(entry, Listed):
            entry = self._held[name] = _imported(entry)
        return entry

    def __setitem__(self, name, family):
        self._held[name] = family

    def __delitem__(self, name):
        del self._held[name]

    def __iter__(self):
        return iter(self._held)

    def __len__(self):
        return len(self._held)

    def pop(self, name, *default):
        """Removes `name`: what it held (a `Listed` entry stays unimported)."""
        return self._held.pop(name, *default)

    def held(self) -> dict:
        """{name: the family, or its `Listed` entry if not imported yet}."""
        return dict(self._held)


def _imported(entry: Listed):
    """The `FAMILY` of a listed family's module, checked against its listing."""
    family = importlib.import_module(entry.module).FAMILY
    types = tuple(getattr(family, "checkpoint_types", ()))
    trained = getattr(family, "config", None) is not None
    if (family.name, types, trained) != (entry.name, entry.checkpoint_types, entry.trained):
        raise RuntimeError(
            f"{entry.module}.FAMILY is {family.name!r} reading {types} (trained: {trained}); "
            f"the registry lists {entry.name!r} reading {entry.checkpoint_types} (trained: "
            f"{entry.trained}): update `registry.LISTED`"
        )
    return family


FAMILIES: Families = Families()


def register(family):
    """Adds (or replaces) a family (`TrainedFamily` or `CheckpointFamily`, or a `Listed`
    one, imported when first asked for) under its name, and a trained family's config
    class (a listed one's: a loader, so the config reads it when its kind is used)."""
    FAMILIES[family.name] = family
    if isinstance(family, Listed):
        if family.trained:
            loader = lambda: FAMILIES[family.name].config
            register_model_config(family.name, loader, family.formerly)
    elif family.config is not None:
        register_model_config(family.name, family.config)
    return family


def get_family(kind: str):
    """The registered family of `model_kind`; a clear error for an unknown kind."""
    if kind not in FAMILIES:
        raise ConfigError(f"model_kind = {kind!r} is invalid: allowed one of {', '.join(FAMILIES)}")
    return FAMILIES[kind]


def family_for(config: Config) -> TrainedFamily:
    """The config's family, checked against its task kind (before any compute)."""
    family = get_family(config.model.model_kind)
    kind = get_task(config.task.task_kind).name
    if kind not in getattr(family, "task_kinds", ()):
        raise ConfigError(
            f"task_kind = {kind!r} is invalid with model_kind = {family.name!r}: allowed "
            + (", ".join(repr(k) for k in getattr(family, "task_kinds", ())) or "none")
        )
    return family


def view_for(config: Config):
    """The VLM view (`families.vlm_view.VLMView`) of the config's family, for the paper
    003 / 004 methods; a ConfigError naming `model_kind` for a family that has none."""
    family = family_for(config)
    if family.vlm_view is None:
        raise ConfigError(f"model_kind = {family.name!r} is not a VLM family (it has no VLM view)")
    return family.vlm_view(config)


def trainable(params):
    """The params without the `static` constants (what norms are taken over)."""
    if isinstance(params, dict) and "static" in params:
        return {k: v for k, v in params.items() if k != "static"}
    return params


_PACKAGE = "jaxmech.families"
# The one list of the project's families (a family is added here and nowhere else).
LISTED = (
    Listed("dual_encoder", f"{_PACKAGE}.dual_encoder.family", trained=True),
    # results folders written before the toy VLM's kind took its package's name say "ar_vlm"
    Listed("toy_vlm", f"{_PACKAGE}.toy_vlm.family", trained=True, formerly=("ar_vlm",)),
    Listed("qwen2_vl", f"{_PACKAGE}.qwen2_vl.family", ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")),
    Listed("llava", f"{_PACKAGE}.llava.family", ("llava",)),
    Listed("internvl", f"{_PACKAGE}.internvl.family", ("internvl",)),
    Listed("mllama", f"{_PACKAGE}.mllama.family", ("mllama",)),
    Listed("gemma3", f"{_PACKAGE}.gemma3.family", ("gemma3",)),
)
for _listed in LISTED:
    register(_listed)


def checkpoint_family(folder: str) -> CheckpointFamily:
    """The checkpoint family whose `checkpoint_types` has the folder's config.json
    `model_type`."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint = {folder!r}: no config.json (not a checkpoint folder)")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    held = FAMILIES.held()  # by the listed types: no other family is imported
    for name, family in held.items():
        if model_type in getattr(family, "checkpoint_types", ()):
            return FAMILIES[name]
    known = [t for f in held.values() for t in getattr(f, "checkpoint_types", ())]
    raise ValueError(
        f"{path}: model_type = {model_type!r} is not supported: allowed one of "
        + ", ".join(map(repr, known))
    )


def stand_in_family(name: str | None = None) -> CheckpointFamily:
    """The checkpoint family `name` for the benches' random stand-ins (None: the first
    registered one that has them); a clear error if it has none."""
    held = FAMILIES.held()
    checkpoint = [n for n, f in held.items() if getattr(f, "checkpoint_types", ())]
    having = [n for n in checkpoint if getattr(FAMILIES[n], "stand_in", None) is not None]
    if name is None and having:
        name = having[0]
    if name not in having:
        raise ValueError(
            f"family = {name!r} is invalid: allowed one of {', '.join(map(repr, having)) or 'none'}"
            " (the checkpoint families with random stand-ins)"
        )
    return FAMILIES[name]


def read_checkpoint_config(folder: str):
    """(family, config) of a checkpoint folder, its weights not read (a cheap check)."""
    family = checkpoint_family(folder)
    return family, family.read_config(folder)


def load_checkpoint(folder: str, **kwargs):
    """(family, config, params) of a real checkpoint folder (`checkpoint_family`);
    kwargs go to that family's `load` (`dtype`, `place`)."""
    family = checkpoint_family(folder)
    return (family, *family.load(folder, **kwargs))
