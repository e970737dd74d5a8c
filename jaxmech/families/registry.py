"""The model-family interface: what training, sweeps, checkpoints and results need.

A model family (`ModelConfig.model_kind`) is one `Family`, found with
`get_family(kind)`. Training knows a model only through it:

  init_params(config, key) -> params         a plain pytree of arrays (one model)
  loss(params, batch, tables, settings, config) -> []
                                             the training loss on one task batch
                                               (differentiated w.r.t. params; settings
                                               are the model's sweepable scalars)
  evaluate(params, evals, tables, settings, config) -> {metric: []}
                                             one model's metrics on the fixed eval sets
                                               (may return more keys than `metrics`)
  metrics(config) -> names                   the metrics that curves.csv and
                                               results.csv keep, in column order
  task_kinds                                 the task kinds whose batches `loss` reads
  progress_metric                            a metric the sweep's progress lines count
                                               (models >= 0.9), or None
  complete_params(params_K, config) -> params_K
                                             stacked params loaded from a results folder,
                                               completed where an older version of the
                                               family saved less (default: unchanged)
  reports                                    the reports (`jaxmech.reports`, by folder
                                               name) written for this family; one applies
                                               to a run when its task declares it too
  config                                     its config class (`Config.model` of its
                                               runs: a `config.ModelConfig` subclass
                                               holding and checking its fields)
  vlm_view(config) -> VLMView                VLM families: what the seed 003 / 004
                                               methods may ask of them
                                               (`families.vlm_view`); None otherwise.
                                               A checkpoint family's takes (folder,
                                               config, grid, size, video=False): its
                                               processor is the folder's; `video`: the
                                               scenes drawn as videos
  read_config(folder) -> config              checkpoint families: the architecture
                                               alone, no weights read (cheap checks)
  load(folder) -> (config, params)           checkpoint families (real models, e.g.
                                               `qwen2_vl`): open a folder whose
                                               config.json `model_type` is in
                                               `checkpoint_types`. They have no loss or
                                               evaluation (None), no task kinds and no
                                               training config (`config` None): they are
                                               loaded, not trained; `init_params` gives
                                               random params of a config (tests)

Everything that goes into the jitted functions besides params (the caption table, eval
sets) comes from the task's `tables` and `evals`; settings are the model's sweepable
scalars. Behaviour switches without a trained parameter (the text tower's causal mask,
the logit-scale cap) live in `params["static"]`, a subtree of constants that the
forward reads with a stopped gradient: they travel with the params into checkpoints,
analyses and vmaps, and training norms leave them out (`trainable`).

Adding a family: a package under `families/` with its forward and `init_params`, its
loss and evaluation, and a `Family` registered here with `register` (a test can
register a stand-in the same way). `train` and `sweep` need no change.
"""

from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple

import numpy as np

from jaxmech.config import Config, ConfigError, ModelConfig, register_model_config
from jaxmech.data.tasks import get_task
from jaxmech.families.dual_encoder import loss as contrastive
from jaxmech.families.dual_encoder import model as dual_encoder
from jaxmech.families.dual_encoder.config import DualEncoderConfig
from jaxmech.families.dual_encoder.evaluate import METRICS, evaluate
from jaxmech.families.dual_encoder.model import static_params
from jaxmech.families.qwen2_vl import load as qwen_load
from jaxmech.families.qwen2_vl import params as qwen_params
from jaxmech.families.qwen2_vl.config import VARIANTS
from jaxmech.families.qwen2_vl.view import checkpoint_view
from jaxmech.families.toy_vlm import evaluate as evaluate_answers
from jaxmech.families.toy_vlm import loss as answer
from jaxmech.families.toy_vlm import model as ar_vlm
from jaxmech.families.toy_vlm.config import ToyVLMConfig
from jaxmech.families.toy_vlm.view import toy_view


class Family(NamedTuple):
    """One model family's functions (module docstring)."""

    name: str
    init_params: Callable
    loss: Callable | None
    evaluate: Callable | None
    metrics: Callable
    task_kinds: tuple[str, ...]
    progress_metric: str | None = None
    complete_params: Callable = lambda params_K, config: params_K
    reports: tuple[str, ...] = ()
    vlm_view: Callable | None = None
    config: type | None = ModelConfig
    load: Callable | None = None
    checkpoint_types: tuple[str, ...] = ()
    read_config: Callable | None = None


FAMILIES: dict[str, Family] = {}
# the seed 003 / 004 reports: written against the VLM view, for any family that has one
VLM_REPORTS = (
    "patching",
    "spatial_ids",
    "steering",
    "diagnostics",
    "counterfactuals",
    "temporal_ids",
)


def register(family: Family) -> Family:
    """Adds (or replaces) a family in the registry under its name, and its config class
    (a training family's)."""
    FAMILIES[family.name] = family
    if family.config is not None:
        register_model_config(family.name, family.config)
    return family


def get_family(kind: str) -> Family:
    """The registered family of `model_kind`; a clear error for an unknown kind."""
    if kind not in FAMILIES:
        raise ConfigError(f"model_kind = {kind!r} is invalid: allowed one of {', '.join(FAMILIES)}")
    return FAMILIES[kind]


def family_for(config: Config) -> Family:
    """The config's family, checked against its task kind (before any compute)."""
    family = get_family(config.model.model_kind)
    kind = get_task(config.task.task_kind).name
    if kind not in family.task_kinds:
        raise ConfigError(
            f"task_kind = {kind!r} is invalid with model_kind = {family.name!r}: allowed "
            + ", ".join(repr(k) for k in family.task_kinds)
        )
    return family


def view_for(config: Config):
    """The VLM view (`families.vlm_view.VLMView`) of the config's family, for the seed
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


def _dual_encoder_evaluate(params, evals, tables, settings, config):
    del config
    return evaluate(params, evals, tables.captions, settings)


def _dual_encoder_complete(params_K, config):
    """Folders written before `params["static"]` existed: add it from their config."""
    if "static" in params_K or "logit_scale" not in params_K:
        return params_K
    k = np.asarray(params_K["logit_scale"]).shape[0]
    static = {n: np.full((k,), v, np.float32) for n, v in static_params(config).items()}
    return {**params_K, "static": static}


register(
    Family(
        name="dual_encoder",
        init_params=dual_encoder.init_params,
        loss=contrastive.batch_loss,
        evaluate=_dual_encoder_evaluate,
        metrics=lambda config: METRICS,
        task_kinds=("1d", "2d", "three"),
        progress_metric="unseen_acc",
        complete_params=_dual_encoder_complete,
        reports=("mechanism", "relations", "rope", "text"),
        config=DualEncoderConfig,
    )
)

register(
    Family(
        name="ar_vlm",
        init_params=ar_vlm.init_params,
        loss=answer.answer_loss,
        evaluate=evaluate_answers.evaluate_scenes,
        metrics=evaluate_answers.metric_names,
        task_kinds=("scenes", "video"),
        progress_metric="unseen_min_acc",
        reports=VLM_REPORTS + ("vit_terms", "id_loss"),
        vlm_view=toy_view,
        config=ToyVLMConfig,
    )
)

register(
    Family(
        name="qwen2_vl",
        init_params=qwen_params.init_params,
        loss=None,
        evaluate=None,
        metrics=lambda config: (),
        task_kinds=(),
        config=None,
        load=qwen_load.load_checkpoint,
        checkpoint_types=VARIANTS,
        vlm_view=checkpoint_view,
        read_config=qwen_load.read_config,
    )
)


def checkpoint_family(folder: str) -> Family:
    """The family whose `checkpoint_types` has the folder's config.json `model_type`
    (today `qwen2_vl` reads Qwen2-VL and Qwen2.5-VL)."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint = {folder!r}: no config.json (not a checkpoint folder)")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    for family in FAMILIES.values():
        if model_type in family.checkpoint_types:
            return family
    known = [t for f in FAMILIES.values() for t in f.checkpoint_types]
    raise ValueError(
        f"{path}: model_type = {model_type!r} is not supported: allowed one of "
        + ", ".join(map(repr, known))
    )


def read_checkpoint_config(folder: str):
    """(family, config) of a checkpoint folder, its weights not read (a cheap check)."""
    family = checkpoint_family(folder)
    return family, family.read_config(folder)


def load_checkpoint(folder: str, **kwargs):
    """(family, config, params) of a real checkpoint folder (`checkpoint_family`);
    kwargs go to that family's `load` (`dtype`, `place`)."""
    family = checkpoint_family(folder)
    return (family, *family.load(folder, **kwargs))
