"""The one list of model families, and how a config or a folder finds its own.

The two contracts (a trained family, a checkpoint family) are `families.contract`'s.
A family is one package under `families/` whose `family.py` holds its `FAMILY`;
registering it here (or from a test, with `register`) is the only place that names it.
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

import json
import os

from jaxmech.config import Config, ConfigError, register_model_config
from jaxmech.data.tasks import get_task
from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily, StandIn, TrainedFamily
from jaxmech.families.dual_encoder.family import FAMILY as DUAL_ENCODER
from jaxmech.families.gemma3.family import FAMILY as GEMMA3
from jaxmech.families.internvl.family import FAMILY as INTERNVL
from jaxmech.families.llava.family import FAMILY as LLAVA
from jaxmech.families.mllama.family import FAMILY as MLLAMA
from jaxmech.families.qwen2_vl.family import FAMILY as QWEN2_VL
from jaxmech.families.toy_vlm.family import FAMILY as TOY_VLM

Family = TrainedFamily  # the older name of a trained family's contract

__all__ = ["VLM_REPORTS", "CheckpointFamily", "Family", "StandIn", "TrainedFamily"]

FAMILIES: dict = {}


def register(family):
    """Adds (or replaces) a family (`TrainedFamily` or `CheckpointFamily`) under its
    name, and a trained family's config class."""
    FAMILIES[family.name] = family
    if family.config is not None:
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


for _family in (DUAL_ENCODER, TOY_VLM, QWEN2_VL, LLAVA, INTERNVL, MLLAMA, GEMMA3):
    register(_family)


def checkpoint_family(folder: str) -> CheckpointFamily:
    """The checkpoint family whose `checkpoint_types` has the folder's config.json
    `model_type`."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint = {folder!r}: no config.json (not a checkpoint folder)")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    for family in FAMILIES.values():
        if model_type in getattr(family, "checkpoint_types", ()):
            return family
    known = [t for f in FAMILIES.values() for t in getattr(f, "checkpoint_types", ())]
    raise ValueError(
        f"{path}: model_type = {model_type!r} is not supported: allowed one of "
        + ", ".join(map(repr, known))
    )


def stand_in_family(name: str | None = None) -> CheckpointFamily:
    """The checkpoint family `name` for the benches' random stand-ins (None: the first
    registered one that has them); a clear error if it has none."""
    having = [f.name for f in FAMILIES.values() if getattr(f, "stand_in", None) is not None]
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
