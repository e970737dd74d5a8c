"""The task interface: what training, sweeps and evaluation need from a task kind.

A task kind (`TaskConfig.task_kind`) is one `Task`, found with `get_task(kind)`. Its
functions are pure; `sample_batch` is jittable and runs inside the training scan, the
other two run once on the host.

  build_tables(task_config) -> tables        host NumPy arrays shared by every model
                                               (the caption table, label splits, ...)
  build_eval_sets(task_config, tables) -> evals
                                             fixed validation sets (host NumPy)
  sample_batch(tables, key, settings, task_config, batch_size, *, finite, step,
               order_key) -> batch           one model's training batch (jittable; the
                                               settings are that model's scalars)
  epoch_items(settings, batch_size) -> (n_items, per_batch)
                                             finite-set tasks only (else None): items in
                                               one epoch and items per batch, for
                                               `train.step_budget`
  answer_relations                           question tasks only: the relations asked,
                                               as (metric name, relation id) pairs
  words                                      question tasks only: the word ids' names
  reports                                    the reports (by folder name) its data
                                               supports; one applies to a run when the
                                               family declares it too
  caption_words                              caption tasks: the caption words after the
                                               labels (`data.tasks.vocab`; `task_vocab`)
  config                                     its config class (a `config.TaskConfig`
                                               subclass: the fields it reads)
  eval_specs(task_config, eval_set) -> {name: SceneSpec}
                                             scene tasks only: one eval set and its
                                               twins as scene specs (`data.spec`), what
                                               the paper 003 / 004 methods render
  video                                      scene tasks: whether its scenes are videos
                                               (relation 1 is time: before / after)

What a batch holds is between the task and the model families that train on it: the
caption tasks here give a `CaptionBatch`, whose `positives_BxB` says which caption is
true of which image where that is more than "identical captions" (the three-object
task). A model family names the task kinds it accepts (`families.TrainedFamily`).

Adding a task kind: write its module under `data/` with those functions and register
it in `TASKS` below, with its config class (a `config.TaskConfig` subclass holding and
checking its fields).
Shapes use the vocabulary of `jaxmech.shapes`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from jaxmech.config import Config, ConfigError, register_task_config
from jaxmech.data.tasks import relations1d, relations2d, relations3, scenes, video, vocab


class CaptionBatch(NamedTuple):
    """A batch of images and the ids of their true captions (rows of `tables.captions`).

    images_BxL: int32 pixel ids. caption_ids_B: int32. positives_BxB: bool [image,
    caption] with a True diagonal, or None when the positives are the samples with
    identical captions.
    """

    images_BxL: jax.Array
    caption_ids_B: jax.Array
    positives_BxB: Any = None


class Task(NamedTuple):
    """One task kind's functions (module docstring)."""

    name: str
    build_tables: Callable
    build_eval_sets: Callable
    sample_batch: Callable
    epoch_items: Callable | None = None
    answer_relations: tuple = ()  # question tasks: ((metric name, relation id), ...)
    words: tuple = ()  # question tasks: the names of the word ids
    eval_specs: Callable | None = None  # scene tasks: an eval set as `data.spec` specs
    reports: tuple[str, ...] = ()  # the reports its data supports (folder names)
    caption_words: tuple[str, ...] = vocab.WORDS  # caption tasks: the text words
    config: type = relations1d.LineConfig  # its config class (`config.TaskConfig`)
    video: bool = False  # question tasks: its scenes are videos (relation 1 is time)


def caption_sampler(module, positives: Callable | None = None) -> Callable:
    """A task's `sample_batch` from a caption module's `(images, caption_ids)` sampler;
    `positives(images, caption_ids, task_config)` adds the batch's positives."""

    def sample_batch(tables, key, settings, task, batch_size, *, finite, step, order_key):
        images, ids = module.sample_batch(
            tables, key, settings, task, batch_size, finite=finite, step=step, order_key=order_key
        )
        pos = None if positives is None else positives(images, ids, task)
        return CaptionBatch(images, ids, pos)

    return sample_batch


def _line_epoch_items(settings, batch_size: int):
    two_per_batch = batch_size - relations1d.singles_per_batch(settings, batch_size)
    return relations1d.n_two_object_items(settings), two_per_batch


TASKS: dict[str, Task] = {
    "1d": Task(
        "1d",
        relations1d.build_tables,
        relations1d.build_eval_sets,
        caption_sampler(relations1d),
        _line_epoch_items,
        reports=("mechanism", "rope", "text"),
    ),
    "2d": Task(
        "2d",
        relations2d.build_tables,
        relations2d.build_eval_sets,
        caption_sampler(relations2d),
        reports=("relations",),
        caption_words=vocab.WORDS_2D,
        config=relations2d.GridConfig,
    ),
    "three": Task(
        "three",
        relations3.build_tables,
        relations3.build_eval_sets,
        caption_sampler(relations3, relations3.positives),
        reports=("relations",),
        config=relations3.ThreeConfig,
    ),
    # questions about grid scenes for the autoregressive VLM: batches are
    # `scenes.SceneBatch`, eval sets `scenes.SceneEvalSets` (streaming only)
    "scenes": Task(
        "scenes",
        scenes.build_tables,
        scenes.build_eval_sets,
        scenes.sample_batch,
        answer_relations=(("h", 0), ("v", 1)),
        words=scenes.SCENE_WORDS,
        eval_specs=scenes.eval_specs,
        reports=("patching", "spatial_ids", "steering", "diagnostics", "counterfactuals")
        + ("vit_terms", "id_loss", "arbitrary_steering"),
        config=scenes.SceneConfig,
    ),
    # the scenes read as video: rows are frames, questions before / after (`data.tasks.video`)
    "video": Task(
        "video",
        video.build_tables,
        video.build_eval_sets,
        video.sample_batch,
        answer_relations=video.ANSWER_RELATIONS,
        words=video.VIDEO_WORDS,
        eval_specs=video.eval_specs,
        reports=("patching", "spatial_ids", "temporal_ids", "id_loss"),
        config=video.VideoConfig,
        video=True,
    ),
}
for _task in TASKS.values():
    register_task_config(_task.name, _task.config)


def get_task(kind: str) -> Task:
    """The registered task of `task_kind`; a clear error for an unknown kind."""
    if kind not in TASKS:
        raise ConfigError(f"task_kind = {kind!r} is invalid: allowed one of {', '.join(TASKS)}")
    return TASKS[kind]


def task_vocab(task_config) -> vocab.Vocab:
    """The caption vocabulary of a `TaskConfig`: its labels and its task's words."""
    return vocab.Vocab(task_config.n_labels, get_task(task_config.task_kind).caption_words)


class Data(NamedTuple):
    """The arrays every model of a run shares (replicated over devices): the task's
    tables and fixed validation sets (`data.tasks.Task`)."""

    tables: Any
    evals: Any


def build_data(config: Config) -> Data:
    """Tables and validation sets for the config's task (host NumPy, built once)."""
    task = get_task(config.task.task_kind)
    tables = task.build_tables(config.task)
    return Data(tables, task.build_eval_sets(config.task, tables))
