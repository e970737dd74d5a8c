"""jaxmech: a pure-JAX laboratory for mechanistic studies of spatial reasoning.

Top-level API: configs, `init_params`, the one `forward` (and its towers), edits and
`with_static` (the switches stored in params), training and evaluation functions, the
model-family and task registries, and results loading. Axis letters: `jaxmech.shapes`.
"""

from jaxmech.analysis.align import alignment_study, procrustes
from jaxmech.analysis.decompose import decompose
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
from jaxmech.data.tasks import Task, get_task
from jaxmech.evaluate import evaluate
from jaxmech.families import Family, get_family, register
from jaxmech.models.checks import with_static
from jaxmech.models.dual_encoder import encode_images, encode_texts, forward, init_params
from jaxmech.models.edits import TERMS, Edits, term_mask
from jaxmech.results import load_run
from jaxmech.train import build_data, init_state, stack_settings, train_models, train_step

__all__ = [
    "SWEEPABLE",
    "TERMS",
    "Config",
    "ConfigError",
    "Edits",
    "Family",
    "ModelConfig",
    "Settings",
    "Task",
    "TaskConfig",
    "TrainConfig",
    "alignment_study",
    "build_data",
    "build_eval_sets",
    "build_tables",
    "decompose",
    "encode_images",
    "encode_texts",
    "eot_patterns",
    "evaluate",
    "first_mention_preference",
    "forward",
    "get_family",
    "get_task",
    "init_params",
    "init_state",
    "load_run",
    "procrustes",
    "register",
    "sample_batch",
    "stack_settings",
    "term_mask",
    "train_models",
    "train_step",
    "with_static",
]
