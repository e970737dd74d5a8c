"""jaxmech: a pure-JAX laboratory for mechanistic studies of spatial reasoning.

Top-level API: one model handle for every family (`load(folder or ORG/NAME)` for a checkpoint,
`init(kind, config, key)` for a trained family: `jaxmech.model.Model`, with `forward`,
`sites`, `view`, and a checkpoint's `encode`, `tokenizer`, `next_token_logprobs`);
configs; one `Edits` type for every family; training; the model-family and task
registries; results loading; and the VLM interface of papers 003 / 004: a family's
`view_for(config)`, scene specs, and the methods that run on any VLM family (mirror-swap
patching, spatial IDs, the counterfactual table) and paper 000's (`decompose`, text
heads, alignment). Paper 000's dual encoder's own functions are `jaxmech.dual_encoder`'s.
Axis letters: `jaxmech.shapes`.
"""

import importlib

from jaxmech.analysis import counterfactuals
from jaxmech.analysis.patching import patch_logp, token_groups
from jaxmech.analysis.spatial_ids import probe, spatial_ids, word_states
from jaxmech.config import (
    SWEEPABLE,
    Config,
    ConfigError,
    ModelConfig,
    Settings,
    TaskConfig,
    TrainConfig,
)
from jaxmech.data.spec import Grid, SceneSpec, probe_specs
from jaxmech.data.tasks import Task, get_task
from jaxmech.data.tasks.relations1d import build_eval_sets, build_tables, sample_batch
from jaxmech.families import get_family, load_checkpoint, register, view_for
from jaxmech.families.vlm_view import Examples, Spans, VLMView, answer_ids, examples
from jaxmech.model import Model, init, load
from jaxmech.models.edits import TERMS, Edits, term_mask
from jaxmech.results import load_run
from jaxmech.train import build_data, init_state, stack_settings, train_models, train_step

# Exports whose modules import a family's package: read on first use (module
# `__getattr__`), so `import jaxmech` imports no family (a command imports only its own).
_LAZY = {
    "alignment_study": "jaxmech.analysis.align",
    "procrustes": "jaxmech.analysis.align",
    "decompose": "jaxmech.analysis.decompose",
    "eot_patterns": "jaxmech.analysis.text_heads",
    "first_mention_preference": "jaxmech.analysis.text_heads",
    "dual_encoder": None,  # the module itself
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxmech' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name] or f"jaxmech.{name}")
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "SWEEPABLE",
    "TERMS",
    "Config",
    "ConfigError",
    "Edits",
    "Examples",
    "Grid",
    "Model",
    "ModelConfig",
    "SceneSpec",
    "Settings",
    "Spans",
    "Task",
    "TaskConfig",
    "TrainConfig",
    "VLMView",
    "answer_ids",
    "alignment_study",
    "build_data",
    "build_eval_sets",
    "build_tables",
    "counterfactuals",
    "decompose",
    "dual_encoder",
    "eot_patterns",
    "examples",
    "first_mention_preference",
    "get_family",
    "get_task",
    "init",
    "init_state",
    "load",
    "load_checkpoint",
    "load_run",
    "patch_logp",
    "probe",
    "probe_specs",
    "procrustes",
    "register",
    "sample_batch",
    "spatial_ids",
    "stack_settings",
    "term_mask",
    "token_groups",
    "train_models",
    "train_step",
    "view_for",
    "word_states",
]
