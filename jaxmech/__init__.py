"""jaxmech: a pure-JAX laboratory for mechanistic studies of spatial reasoning.

Top-level API: one model handle for every family (`load(folder or ORG/NAME)` for a checkpoint,
`init(kind, config, key)` for a trained family: `jaxmech.model.Model`, with `forward`,
`sites`, `view`, and a checkpoint's `encode`, `tokenizer`, `next_token_logprobs`);
configs; one `Edits` type for every family; training; the model-family and task
registries; results loading; and the VLM interface of papers 003 / 004: a family's
`view_for(config)`, scene specs, and the methods that run on any VLM family (mirror-swap
patching, spatial IDs, the counterfactual table). Paper 000's dual encoder is
`jaxmech.dual_encoder` (its `init_params`, `forward`, `encode_images`, `encode_texts`,
`evaluate`, `decompose`, `with_static` are also exported here, as older code reads them).
Axis letters: `jaxmech.shapes`.
"""

from jaxmech import dual_encoder
from jaxmech.analysis import counterfactuals
from jaxmech.analysis.align import alignment_study, procrustes
from jaxmech.analysis.decompose import decompose
from jaxmech.analysis.patching import patch_logp, token_groups
from jaxmech.analysis.spatial_ids import probe, spatial_ids, word_states
from jaxmech.analysis.text_heads import eot_patterns, first_mention_preference
from jaxmech.config import (
    SWEEPABLE,
    Config,
    ConfigError,
    ModelConfig,
    Settings,
    TaskConfig,
    TrainConfig,
)
from jaxmech.data.relations1d import build_eval_sets, build_tables, sample_batch
from jaxmech.data.spec import Grid, SceneSpec, probe_specs
from jaxmech.data.tasks import Task, get_task
from jaxmech.families import Family, get_family, load_checkpoint, register, view_for
from jaxmech.families.dual_encoder.checks import with_static
from jaxmech.families.dual_encoder.evaluate import evaluate
from jaxmech.families.dual_encoder.model import encode_images, encode_texts, forward, init_params
from jaxmech.families.vlm_view import Examples, Spans, VLMView, answer_ids, examples
from jaxmech.model import Model, init, load
from jaxmech.models.edits import TERMS, Edits, term_mask
from jaxmech.results import load_run
from jaxmech.train import build_data, init_state, stack_settings, train_models, train_step

__all__ = [
    "SWEEPABLE",
    "TERMS",
    "Config",
    "ConfigError",
    "Edits",
    "Examples",
    "Family",
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
    "encode_images",
    "encode_texts",
    "eot_patterns",
    "evaluate",
    "examples",
    "first_mention_preference",
    "forward",
    "get_family",
    "get_task",
    "init",
    "init_params",
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
    "with_static",
    "word_states",
]
