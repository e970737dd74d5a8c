"""What a report studies (`LoadedRun`) and what it may ask of it (its subject): the
subject types. Opening them: `reports.runs` (a results folder) and `reports.checkpoints`
(a checkpoint).

A report never tests which kind of subject it has; it asks:

  view(run) -> VLMView            the family's VLM view (`families.vlm_view`)
  question_specs(run) -> {"examples": spec, twin: spec}   the questions, as scene specs
                                  (drawn scenes only; a dataset's subject refuses)
  question_batches(run, relations, twins) -> [QuestionBatch]
                                  the questions of those relations rendered, with their
                                  twins, in batches of one shape (`reports.batches`)
  source                          what its questions are: "drawn", or a dataset's record
                                  (`batches.source_record`)
  id_labels(run) -> range         the labels a universal spatial ID averages over
  layers                          the LM layers studied (None: every one)
  protocol                        whose protocol the tables follow ("jaxmech", "authors")
  over_questions                  intervals over questions (one model) or over models
  question_chunk                  questions per compiled call of a per-question table
                                  (None: all at once)
  rows_per_call(run, compile_at, n, log, seconds) -> (rows, memory.Plan or None)
  probe_rows(run, log) -> probe scenes per chunk (None: all at once)
  store(table, **what) -> chunks.ChunkStore or None   where finished chunks are kept
  with_chunks(folder) -> subject  the subject keeping its chunks in `folder`
  video(run) -> bool              whether its questions are videos
  questions_word                  how a printed header names its question set
  per_block                       whether the counterfactual table mirrors the ViT's
                                  positions in one block at a time too
  estimates_time                  whether a table logs its estimated time first
                                  (`questions.log_estimate`)
  budget, key                     a checkpoint's memory budget and what its questions
                                  depend on (None for a trained run)

* `TrainedSubject`: a results folder's K models (`runs.open_run`), their task's eval
  sets as questions (`EXAMPLES`: seen or unseen pairs);
* `CheckpointSubject`: a real checkpoint (`checkpoints.open_checkpoint`): one model
  (its `model.Model` handle), its processor's view, drawn pair questions or a dataset's
  photographs (`--questions_from`), its memory plan and chunk store.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import Config, Settings
from jaxmech.data.spec import take
from jaxmech.data.tasks.scenes import eval_masks
from jaxmech.families import view_for
from jaxmech.families.vlm_view import VLMView, model_outline
from jaxmech.memory import device_bytes, memory_budget, plan_rows, tree_devices

EXAMPLES = ("seen", "unseen")  # the paper 003 / 004 reports' question sets, main first
EXAMPLE_SETS = {"seen": "seen_pair", "unseen": "unseen_pair"}
EXAMPLE_WORDS = {
    "seen": "seen-pair questions (training-pair labels, layouts no model trained on)",
    "unseen": "unseen-pair questions (validation labels)",
}


class LoadedRun(NamedTuple):
    """What a report studies: a finished results folder's finite models (stacked
    params [K, ...]), or a checkpoint as one model [1, ...]. Reports ask its `subject`
    for what differs between the two, never which kind it is."""

    path: str
    config: Config
    params: Any  # stacked [K, ...], device arrays
    settings: Settings  # device arrays [K]
    data: Any  # the task's tables and eval sets (`train.build_data`); None if not asked
    #   (and for a checkpoint, whose questions its subject holds)
    results: list[dict]  # results.csv rows, one per kept model
    models: tuple[int, ...]  # [K] each model's index in the run (results.csv `model`)
    excluded: tuple[str, ...]  # one line per diverged model left out (`excluded_lines`)
    curves: list[dict] = ()  # curves.csv rows, every model's
    family: Any = None  # `families.Family` of the run
    task: Any = None  # `data.tasks.Task` of the run
    examples: str = "unseen"  # which questions the paper 003 / 004 reports ask (`EXAMPLES`)
    subject: Any = None  # what the reports ask it (`TrainedSubject`, `CheckpointSubject`)
    selection: Any = None  # `runs.Selection` of a --seeds_until run (None: no selection.json)

    @property
    def k(self) -> int:
        return len(self.results)

    def unseen_min(self) -> np.ndarray:
        """[K] each model's smallest unseen-pair accuracy over the relations (NaN where
        the results have no `unseen_min_acc`)."""
        return np.asarray([r.get("unseen_min_acc", np.nan) for r in self.results], float)

    def unseen_acc(self) -> np.ndarray:
        """[K] each model's final unseen-pair accuracy (NaN where the task has none)."""
        return np.asarray([r.get("unseen_acc", np.nan) for r in self.results], float)


class TrainedSubject(NamedTuple):
    """A results folder's K trained models, asked their task's questions (module
    docstring): every table is one compiled call, intervals are over models."""

    layers: Any = None
    protocol: str = "jaxmech"
    over_questions: bool = False
    question_chunk: Any = None
    budget: Any = None
    key: Any = None
    batch: Any = None
    questions_word: str = "unseen-pair"
    per_block: bool = True  # a toy's per-block ViT mirrors are cheap: always in its table
    estimates_time: bool = False  # a toy's tables take seconds: no estimate printed

    def view(self, run) -> VLMView:
        return view_for(run.config)

    def question_specs(self, run) -> dict:
        """{"examples": spec, twin: spec}: the questions of `run.examples` (`EXAMPLES`)
        as scene specs. "unseen": the whole unseen-pair set; "seen": the seen-pair rows
        that belong to every model's seen set (`data.tasks.scenes.eval_masks`: both labels
        trained in pairs, a layout held out), so one batch serves every model."""
        specs = eval_specs(run, EXAMPLE_SETS[run.examples])
        if run.examples == "unseen":
            return specs
        evals = run.data.evals
        rows = jax.vmap(lambda s: eval_masks(evals, s)["seen_pair"])(run.settings)
        keep = np.asarray(rows).all(0)
        if not keep.any():
            raise ValueError(f"{run.path}: no seen-pair question belongs to every model's seen set")
        return {k: take(v, keep) for k, v in specs.items()}

    def question_batches(self, run, relations, twins=(), view=None):
        from jaxmech.reports.batches import drawn_batch

        view = self.view(run) if view is None else view
        return [drawn_batch(view, self.question_specs(run), relations, twins)]

    @property
    def source(self):
        return "drawn"

    def id_labels(self, run) -> range:
        """The labels every model of the run saw in training pairs (1..min
        n_pair_labels; the validation labels' IDs agree with them only in part)."""
        return range(1, int(np.min(np.asarray(run.settings.n_pair_labels))) + 1)

    def rows_per_call(self, run, compile_at, n: int, log=print, seconds=None):
        return n, None  # a run's tables are one call

    def probe_rows(self, run, log=print):
        return None

    def store(self, table: str, **what):
        return None

    def with_chunks(self, folder: str):
        return self

    def video(self, run) -> bool:
        return run.task.video  # the task says (`data.tasks.Task.video`)


def eval_specs(run: LoadedRun, name: str = "unseen_pair") -> dict:
    """{"examples": spec, twin: spec}: one of a trained run's eval sets as scene specs."""
    return run.task.eval_specs(run.config.task, getattr(run.data.evals, name))


class CheckpointSubject(NamedTuple):
    """A real checkpoint, one model: its handle (`model.Model` of `jaxmech.load`, its
    params moved into `LoadedRun.params` [1, ...], so `model.params` is None), its VLM view, its question set
    (`data.spec.pair_questions`), the LM layers a report studies (None: every one), the
    scenes per compiled call (`batch`; None: planned within `budget` from the compiled
    program's memory analysis), what the questions depend on (`key`: the checkpoint's
    files and the options, for `store`) and where a report keeps its finished chunks
    (None: nowhere; `driver.analyse_subject` sets it)."""

    model: Any  # model.Model: family, config, folder, processor (params: the run's)
    vlm_view: VLMView
    specs: dict
    layers: tuple | None
    batch: int | None
    key: dict
    chunks: str | None = None
    budget: Any = None  # memory.Budget: the peak the report may hold
    protocol: str = "jaxmech"  # whose protocol the tables follow
    over_questions: bool = True  # one model: intervals over its questions
    question_chunk: int = 1  # a per-question table asks one question per call
    questions_word: str = "pair"
    photos: Any = None  # a dataset's `data.datasets.questions.QuestionSet` (None: drawn scenes)
    source: Any = "drawn"  # "drawn", or the dataset's record (`batches.source_record`)
    per_block: bool = False  # the counterfactual table's per-block ViT mirrors (opt-in)
    estimates_time: bool = True  # each table logs its estimated time before computing

    def view(self, run) -> VLMView:
        return self.vlm_view

    def question_specs(self, run) -> dict:
        if self.photos is not None:
            raise ValueError(
                f"--questions_from={self.photos.source}: this table asks drawn scenes (its "
                "probes or its edits are cells of a drawn grid); use --questions_from=drawn"
            )
        return self.specs

    def question_batches(self, run, relations, twins=(), view=None):
        """The drawn questions as one batch, or the dataset's photographs one batch per
        processed grid (`batches.photo_batches`; its twins as image transforms), each
        logged; rendered by `view` (None: the subject's; a report's own wording)."""
        from jaxmech.reports import batches

        view = self.vlm_view if view is None else view
        if self.photos is None:
            return [batches.drawn_batch(view, self.specs, relations, twins)]
        out = batches.photo_batches(view, self.photos, relations, twins,
                                    self.protocol, self.key["seed"])  # fmt: skip
        left = len(self.photos.questions) - sum(len(b.index) for b in out)
        print(
            f"{self.photos.source}: {sum(len(b.index) for b in out)} question(s) in "
            f"{len(out)} image size(s) {[b.key['image_grid'][1:] for b in out]}"
            + (f"; {left} of other relations left out (no mirror twin)" if left else "")
        )
        if not out:
            raise ValueError(f"--questions_from={self.photos.source}: no question of the "
                             f"relations asked (n = 0)")  # fmt: skip
        return out

    def id_labels(self, run) -> range:
        """The first half of its labels (the other half's IDs are compared with them)."""
        return range(1, self.vlm_view.n_labels // 2 + 1)

    def rows_per_call(self, run, compile_at, n: int, log=print, seconds=None):
        """(rows per compiled call of a table over `n` questions, its `memory.Plan` or
        None): `batch`, or where that is None the most whose compiled program
        (`compile_at(b)`) fits in the memory budget beside what is held
        (`memory.plan_rows`, logged; the weights are counted once, sharded ones by one
        device's shards), on CPU within ~`memory.CPU_CHUNK_SECONDS` of the table's
        estimated `seconds`. Raises `memory.MemoryBudgetError` when one does not fit."""
        if self.batch is not None:
            return min(self.batch, n), None
        plan = plan_rows(compile_at, n, self.budget or memory_budget(), device_bytes(run.params),
                         log, devices=tree_devices(run.params),
                         row_seconds=seconds / n if seconds else None)  # fmt: skip
        log(f"  memory: {plan.text()}")
        return plan.rows, plan

    def probe_rows(self, run, log=print) -> int:
        """Probe scenes per chunk of the forwards inside one compiled report
        (`spatial_ids.map_chunks`): `rows_per_call` of the view's forward capturing
        every residual site, on probe scenes."""
        from jaxmech.analysis import spatial_ids as si

        view, first = self.vlm_view, _placed_shapes(run.params)
        n_blocks = view.n_lm_blocks(model_outline(run.params))
        sites = [si.resid_site(y, n_blocks) for y in range(n_blocks + 1)]
        inputs = si.probe(view, [1], placements=1).inputs
        n = len(np.asarray(jax.tree_util.tree_leaves(inputs)[0]))
        f = jax.jit(lambda p, x: view.forward(p, x, capture=sites))
        at = lambda b: jax.tree_util.tree_map(lambda v: np.asarray(v)[np.arange(b) % n], inputs)  # noqa: E731
        return self.rows_per_call(run, lambda b: f.lower(first, at(b)).compile(), 1 << 30, log)[0]

    def store(self, table: str, **what):
        """The `chunks.ChunkStore` of table `table` with options `what` beside the
        checkpoint's key, or None outside a report's folder."""
        from jaxmech.chunks import store_for

        if self.chunks is None:
            return None
        return store_for(self.chunks, {**self.key, "table": table, **what})

    def with_chunks(self, folder: str):
        return self._replace(chunks=folder)

    def video(self, run) -> bool:
        return bool(self.key.get("video"))


def subset(run: LoadedRun, index) -> LoadedRun:
    """`run` with only the models at positions `index`; `run` itself where that is every
    model in order (an eager take copies every weight: 4.1 GB more for a 2B checkpoint)."""
    index = np.asarray(index)
    if index.tolist() == list(range(len(run.models))):
        return run
    return run._replace(
        params=_take(run.params, index),
        settings=_take(run.settings, index),
        results=[run.results[i] for i in index],
        models=tuple(run.models[i] for i in index),
    )


def _placed_shapes(params_K):
    """Model 0 of stacked params [K, ...] as shapes that keep their placement, so a
    program lowered on them is the one their arrays run (sharded: its memory analysis
    per device, as `plan_rows` counts it)."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    def one(x):
        s = x.sharding
        if isinstance(s, NamedSharding):  # the leading model axis is never split
            s = NamedSharding(s.mesh, PartitionSpec(*tuple(s.spec)[1:]))
        elif not isinstance(s, SingleDeviceSharding):
            s = None
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)

    return jax.tree_util.tree_map(one, params_K)


def _take(tree, index: np.ndarray):
    """`tree` with only the models at `index` along every leaf's leading axis."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[index], tree)
