"""What a report studies (`LoadedRun`) and what it may ask of it (its subject).

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
  rows_per_call(run, compile_at, n, log) -> (rows, memory.Plan or None)
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

* `TrainedSubject`: a results folder's K models (`open_run`), their task's eval sets as
  questions (`EXAMPLES`: seen or unseen pairs), model groups (`model_groups`); a run
  trained with `--seeds_until` carries its `Selection` (the rule fixed before
  training, checked against sweep.json and results.csv), whose passing models every
  report takes as its main group;
* `CheckpointSubject`: a real checkpoint (`open_checkpoint`): one model, its
  processor's view, drawn pair questions or a dataset's photographs
  (`--questions_from`), its memory plan and chunk store;
* `check_run` / `check_runs`: the cheap checks an entry point runs on every folder of
  `--run` before any compute. Diverged models (results.csv `diverged_step >= 0`) are
  left out and named (`excluded_lines`), so no report averages them in.
"""

from __future__ import annotations

import csv
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.config import SWEEPABLE, Config, Settings
from jaxmech.data.questions import PROTOCOLS
from jaxmech.data.scenes import eval_masks
from jaxmech.data.spec import take
from jaxmech.families import view_for
from jaxmech.families.vlm_view import VLMView, model_outline
from jaxmech.memory import (
    check_weights_fit,
    device_bytes,
    memory_budget,
    plan_rows,
    release_freed,
    tree_bytes,
    tree_devices,
)
from jaxmech.models.hub import check_place, stored_elements
from jaxmech.results import load_config, load_run
from jaxmech.sweep import read_selection
from jaxmech.sweep.until import cap_words

EXAMPLES = ("seen", "unseen")  # the paper 003 / 004 reports' question sets, main first
EXAMPLE_SETS = {"seen": "seen_pair", "unseen": "unseen_pair"}
EXAMPLE_WORDS = {
    "seen": "seen-pair questions (training-pair labels, layouts no model trained on)",
    "unseen": "unseen-pair questions (validation labels)",
}
GENERALISING = 0.9  # unseen_min_acc at which a model counts as generalising


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
    selection: Any = None  # `Selection` of a --seeds_until run (None: no selection.json)

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


class Selection(NamedTuple):
    """A run's selection (`sweep.read_selection`, checked there against the rule it
    trained under and its results): the rule's text, the models trained (diverged
    ones included) and those that pass (results.csv `model`). Reports take the passing
    models as their main group and the others beside them (`model_groups`)."""

    rule: str
    trained: int
    passing: tuple[int, ...]
    cap: str = ""  # the seeds it might try, and the caps it was raised from (`cap_words`)

    def words(self) -> str:
        cap = f"; {self.cap}" if self.cap else ""
        return f"n = {len(self.passing)} of {self.trained} trained (rule: {self.rule}{cap})"

    def record(self) -> dict:
        """What a report's summary.json says of it."""
        return {"rule": self.rule, "n": len(self.passing), "trained": self.trained,
                "passing_models": list(self.passing), "cap": self.cap,
                "words": self.words()}  # fmt: skip


def run_selection(path: str, rows: list[dict]) -> Selection | None:
    """The `Selection` of results folder `path` with results.csv `rows` (None: the
    run has no selection.json); ValueError naming the file when it was changed."""
    sel = read_selection(path, rows)
    if sel is None:
        return None
    passing = tuple(sel["passing_models"])
    return Selection(sel["text"], int(sel["trained"]), passing, cap_words(sel))


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
        that belong to every model's seen set (`data.scenes.eval_masks`: both labels
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

    def rows_per_call(self, run, compile_at, n: int, log=print):
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
    """A real checkpoint, one model: its VLM view, its question set
    (`data.spec.pair_questions`), the LM layers a report studies (None: every one), the
    scenes per compiled call (`batch`; None: planned within `budget` from the compiled
    program's memory analysis), what the questions depend on (`key`: the checkpoint's
    files and the options, for `store`) and where a report keeps its finished chunks
    (None: nowhere; `driver.analyse_subject` sets it)."""

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
    photos: Any = None  # a dataset's `data.questions.QuestionSet` (None: drawn scenes)
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

    def rows_per_call(self, run, compile_at, n: int, log=print):
        """(rows per compiled call of a table over `n` questions, its `memory.Plan` or
        None): `batch`, or where that is None the most whose compiled program
        (`compile_at(b)`) fits in the memory budget beside what is held
        (`memory.plan_rows`, logged; the weights are counted once, sharded ones by one
        device's shards). Raises `memory.MemoryBudgetError` when one does not fit."""
        if self.batch is not None:
            return min(self.batch, n), None
        plan = plan_rows(compile_at, n, self.budget or memory_budget(), device_bytes(run.params),
                         log, devices=tree_devices(run.params))  # fmt: skip
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


def is_diverged(row: dict) -> bool:
    """Whether a results.csv row is a model whose loss or gradient went non-finite."""
    return row["diverged_step"] >= 0


def setting_text(value) -> str:
    # settings are stored as float32: print the shortest text that reads back the same
    return str(np.float32(value)) if isinstance(value, float) else str(value)


def excluded_lines(rows: list[dict]) -> list[str]:
    """One line per diverged model of results.csv `rows`, naming it for the reader.

    A model is named by its index in the run and the settings that tell it apart: the
    sweepable fields that vary over the run or differ from the defaults, then its seed.
    """
    if not rows:
        return []
    defaults = Config().flat()
    names = [
        n
        for n in SWEEPABLE
        if n != "seed"
        and n in rows[0]
        and (
            len({r[n] for r in rows}) > 1
            or not np.isclose(float(rows[0][n]), float(defaults[n]), rtol=1e-6)
        )
    ]
    lines = []
    for r in rows:
        if is_diverged(r):
            fields = ", ".join(f"{n}={setting_text(r[n])}" for n in (*names, "seed") if n in r)
            lines.append(
                f"excluded: model {r['model']} ({fields}): diverged at step {r['diverged_step']}"
            )
    return lines


def _results_rows(path: str) -> list[dict]:
    """results.csv of folder `path` as rows with int `model` and `diverged_step`
    (`_checked_rows`)."""
    file = os.path.join(path, "results.csv")
    with open(file, newline="") as f:
        return _checked_rows(file, list(csv.DictReader(f)))


def _checked_rows(file: str, rows: list[dict]) -> list[dict]:
    """`rows` of results table `file` with int `model` and `diverged_step`; a
    ValueError naming the file when it has no rows or lacks those columns."""
    if not rows:
        raise ValueError(f"{file} holds no model rows; train the run again (or --overwrite it)")
    try:
        for r in rows:
            r["model"], r["diverged_step"] = int(r["model"]), int(r["diverged_step"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{file} is not a results table (each row needs integer `model` and "
            "`diverged_step` columns); train the run again (or --overwrite it)"
        ) from None
    return rows


def _refuse_all_diverged(path: str, rows: list[dict]) -> None:
    if all(is_diverged(r) for r in rows):
        raise ValueError(
            f"{path}: every model of this run diverged ({len(rows)} model(s)), so there is "
            "nothing to analyse; train it again with a smaller lr or weight_decay"
        )


def check_run(path: str) -> Config:
    """The Config of a finished results folder, after the checks a report needs.

    Cheap (reads config.json and results.csv), so entry points refuse a bad folder
    before any compute. Raises ValueError naming the folder or file: not a finished
    results folder (`results.load_config`), a results.csv without model rows, or a run
    whose every model diverged.
    """
    config = load_config(path)
    rows = _results_rows(path)
    _refuse_all_diverged(path, rows)
    run_selection(path, rows)  # a selection changed after training: refused here
    return config


def check_runs(text: str, refusal) -> list[str]:
    """The results folders named by a `--run` flag (comma-separated), each checked
    (`check_run`, then `refusal(config, path)`: why the report does not apply, or
    None) before any compute. Raises ValueError starting "--run" for no folder, a bad
    folder or a refused one."""
    runs = [r.strip() for r in (text or "").split(",") if r.strip()]
    if not runs:
        raise ValueError(f"--run = {text!r}: give at least one results folder (comma-separated)")
    for r in runs:
        try:
            why = refusal(check_run(r), r)
        except ValueError as e:
            raise ValueError(f"--run: {e}") from None
        if why:
            raise ValueError(f"--run: {why}")
    return runs


def model_groups(run: LoadedRun) -> list[tuple[str, np.ndarray]]:
    """[(name, positions of the models in the run)]: "generalising" (unseen_min_acc >=
    `GENERALISING`) first, then "others", so a mean never mixes the two kinds; empty
    groups left out. A run whose results have no unseen_min_acc: [("all", every)]. A
    run with a selection (`LoadedRun.selection`): "passing" (its rule, fixed before
    training) first, then "failing"."""
    if run.selection is not None:
        passing = np.isin(np.asarray(run.models), run.selection.passing)
        groups = [("passing", np.flatnonzero(passing)), ("failing", np.flatnonzero(~passing))]
        return [(g, i) for g, i in groups if len(i)]
    u = run.unseen_min()
    if np.isnan(u).all():
        return [("all", np.arange(run.k))]
    gen = u >= GENERALISING
    groups = [("generalising", np.flatnonzero(gen)), ("others", np.flatnonzero(~gen))]
    return [(g, i) for g, i in groups if len(i)]


def subset(run: LoadedRun, index) -> LoadedRun:
    """`run` with only the models at positions `index`."""
    index = np.asarray(index)
    return run._replace(
        params=_take(run.params, index),
        settings=_take(run.settings, index),
        results=[run.results[i] for i in index],
        models=tuple(run.models[i] for i in index),
    )


def open_run(path: str, *, with_data: bool = True, log=print) -> LoadedRun:
    """Loads results folder `path` (strict: see `results.load_config`) for a report: one
    call below the reports (`results.load_run`) gives the config, params, settings, the
    family, the task and (with `with_data`) the task's data.

    Only the finite models are kept: a diverged model's params are the last finite ones,
    not a trained model, and its numbers would be averaged into every statistic. Each
    left-out model is logged (`excluded_lines`) and listed in `LoadedRun.excluded`;
    `LoadedRun.models` keeps the kept models' indices in the run, for per-model rows.
    Raises ValueError naming `path` when results.csv does not match params/ or every
    model diverged.
    """
    run = load_run(path, with_data=with_data)
    k = len(np.asarray(run.settings.seed))
    # the rows load_run read have the columns used below (else a clear error)
    _checked_rows(os.path.join(path, "results.csv"), run.results)
    if len(run.results) != k:
        raise ValueError(
            f"{os.path.join(path, 'results.csv')} has {len(run.results)} row(s) but params/ "
            f"holds {k} model(s); the folder is damaged: train the run again"
        )
    _refuse_all_diverged(path, run.results)
    excluded = excluded_lines(run.results)
    for line in excluded:
        log(line)
    keep = np.asarray([i for i, r in enumerate(run.results) if not is_diverged(r)])
    return LoadedRun(
        path,
        run.config,
        _take(run.params, keep),
        _take(run.settings, keep),
        run.data,
        [run.results[i] for i in keep],
        tuple(int(run.results[i]["model"]) for i in keep),
        tuple(excluded),
        run.curves,
        run.family,
        run.task,
        subject=TrainedSubject(),
        selection=run_selection(path, run.results),
    )


def open_checkpoint(folder: str, *, grid=(4, 4), size: int | None = None, questions: int = 64,
                    seed: int | None = None, layers=None, batch: int | None = None,
                    dtype="float32", place: str = "auto",
                    video: bool = False, memory: str | None = None,
                    protocol: str = "jaxmech", questions_from: str = "drawn",
                    data: str | None = None, per_block: bool = False,
                    log=print) -> LoadedRun:  # fmt: skip
    """A real checkpoint (a folder, or a Hub name `ORG/NAME[@REVISION]` resolved through
    the Hugging Face cache: `hub_names.checkpoint_folder`) as a one-model `LoadedRun` for
    the paper 003 / 004 reports: params stacked [1, ...], its subject a
    `CheckpointSubject` (the family's VLM view of `grid` scenes drawn `size` pixels
    square (None: the family's default size for them, e.g. 448 for Qwen2-VL),
    `questions` pair questions per spatial relation drawn from `seed`; `batch` per compiled call, None: sized by memory), no
    config, settings or task. `video`: the scenes drawn as videos (the family's video
    view), asked about time only (relation 1: before / after). `memory`: the budget
    (`memory.memory_budget`: GB, a fraction or a percent; None: the default) every
    table's rows per call are planned within. `place`: the weights on one device
    ("one"), each matrix split over every device ("shard": `models.hub._sharding`), or
    "auto" (sharded where they do not fit one device); sharded, a table's rows are
    planned per device (`CheckpointSubject.rows_per_call`). `layers`: as the authors
    index them (layer L the residual after L blocks, `lm/resid_pre.L`; 0..n).
    `protocol`: "authors"
    (their scripts' wording, answer words and table protocols) or "jaxmech"
    (`protocol_of`). `questions_from`: "drawn", or a dataset (`data.questions.SOURCES`)
    read from folder `data`, at most `questions` of them (None: the source's default:
    every one, COCO-Spatial's 100) drawn from `seed` (None: 0, and a dataset's sample
    under the authors' protocol 42, their `random.seed(42)`:
    `data.questions.sample_seed`). `per_block`: the counterfactual table
    also mirrors the ViT's positions in one block at a time (`analysis.counterfactuals.
    names_for`; 2 rows per ViT block, off by default at a checkpoint's size). Bad
    options and malformed records raise ValueError naming them, before the weights are
    read."""
    from jaxmech.chunks import file_stamps
    from jaxmech.data.questions import sample_seed
    from jaxmech.data.spec import Grid
    from jaxmech.families.registry import read_checkpoint_config
    from jaxmech.hub_names import checkpoint_folder

    photos = _photo_questions(questions_from, data, questions, sample_seed(seed, protocol), video)
    seed = 0 if seed is None else seed  # the drawn scenes' (and the twins') seed
    questions = 64 if questions is None else questions
    _check_options(questions, batch, protocol)
    check_place(place)
    budget = memory_budget(memory)
    folder = checkpoint_folder(folder)  # a Hub name: its cached snapshot, fetched if need be
    family, config = read_checkpoint_config(folder)
    view = family.view(folder, config, Grid(*grid), size, video=video, wording=protocol)
    size = view.size
    _check_layers(layers, view.n_lm_blocks(None))
    # drawn before the weights are read, so a grid with no question of a relation is
    # refused at once (`spec.check_pair_grid`)
    specs = _pair_specs(view, questions, seed, video)
    params = _load_weights(folder, family, dtype, place, budget, log)
    key = {"checkpoint": os.path.abspath(folder), "files": file_stamps(folder), "grid": grid,
           "size": size, "questions": questions, "seed": seed, "dtype": dtype, "video": video,
           "protocol": protocol}  # fmt: skip
    from jaxmech.reports.batches import source_record

    source = "drawn" if photos is None else source_record(photos, data)
    if photos is not None:
        key |= {"source": source, "questions_from": questions_from}
        log(f"questions: {photos.source} from {data}, {len(photos.questions)} "
            f"({photos.sample})")  # fmt: skip
    subject = CheckpointSubject(view, specs, None if layers is None else tuple(layers), batch,
                                key, budget=budget, protocol=protocol, photos=photos,
                                source=source, per_block=per_block)  # fmt: skip
    return LoadedRun(path=folder, config=None, params=jax.tree_util.tree_map(_stacked, params),
                     settings=None, data=None, results=[{"model": 0, "diverged_step": -1}],
                     models=(0,), excluded=(), family=family, examples=None,
                     subject=subject)  # fmt: skip


def _load_weights(folder: str, family, dtype: str, place: str, budget, log) -> dict:
    """A checkpoint's params in `dtype`, placed by `place`: refused before any weight is
    read where they alone exceed `budget` (`memory.check_weights_fit`), the host copies
    released after, what was loaded logged."""
    from jaxmech.families import load_checkpoint
    from jaxmech.models.precision import describe

    weights = stored_elements(folder) * jnp.dtype(dtype).itemsize
    devices = 1 if place == "one" else len(jax.devices())
    check_weights_fit(weights, budget, dtype, f"checkpoint {folder}", devices)
    log(f"loading {folder} ({dtype}, place={place})")
    _, config, params = load_checkpoint(folder, dtype=getattr(jnp, dtype), place=place)
    log(describe(dtype))  # which products, and why (models.precision)
    release_freed()  # the tensors' host copies
    log(f"checkpoint {folder}: {family.describe(config)}, {dtype}, weights "
        f"{tree_bytes(params) / 2**30:.2f} GB{placement_text(params)}; memory budget "
        f"{budget.bytes / 2**30:.1f} GB ({budget.how})")  # fmt: skip
    return params


def placement_text(params) -> str:
    """How loaded `params` lie on the devices, for the log ("" on one device)."""
    devices = tree_devices(params)
    if devices == 1:
        return ""
    leaves = jax.tree_util.tree_leaves(params)
    split = sum(not x.sharding.is_fully_replicated for x in leaves)
    return (f", sharded over {devices} devices ({split} of {len(leaves)} arrays split, the "
            f"others replicated): {device_bytes(params) / 2**30:.2f} GB on each")  # fmt: skip


def _check_options(questions: int, batch, protocol: str) -> None:
    for name, v in (("questions", questions), ("batch", 1 if batch is None else batch)):
        if v < 1:
            raise ValueError(f"{name} = {v}: expected at least 1")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol = {protocol!r}: expected one of {', '.join(PROTOCOLS)}")


def _check_layers(layers, n: int) -> None:
    """`layers` as the authors index them must lie in [0, n] for an LM of n blocks."""
    if layers is not None and (not layers or min(layers) < 0 or max(layers) > n):
        raise ValueError(
            f"layers = {list(layers)}: expected LM layers in [0, {n}] (layer L: the "
            f"residual after L of the {n} blocks)"
        )


def _pair_specs(view: VLMView, questions: int, seed: int, video: bool) -> dict:
    """{"examples": spec, twin: spec}: `questions` drawn pair questions per relation
    (a video's: relation 1 only), the relations concatenated."""
    from jaxmech.data.spec import SceneSpec, pair_questions

    per_rel = [pair_questions(view.grid, questions, view.n_labels, view.n_colours, seed, rel)
               for rel in ((1,) if video else (0, 1))]  # fmt: skip
    return {k: SceneSpec(*map(np.concatenate, zip(*(d[k] for d in per_rel)))) for k in per_rel[0]}


def _photo_questions(source: str, data, n, seed: int, video: bool):
    """The QuestionSet of `--questions_from` (None: drawn scenes), every record checked."""
    from jaxmech.data.questions import SOURCES, load_questions

    if source == "drawn":
        if data:
            raise ValueError(f"data = {data!r}: only read with a dataset's --questions_from")
        return None
    if source not in SOURCES:
        raise ValueError(f"questions_from = {source!r}: expected drawn or one of "
                         f"{', '.join(SOURCES)}")  # fmt: skip
    if video:
        raise ValueError(f"questions_from = {source!r}: a video report asks drawn videos only")
    if not data:
        raise ValueError(f"questions_from = {source!r}: give the dataset's folder (--data)")
    return load_questions(source, data, n=n, seed=seed)


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


def _stacked(x):
    """x [...] as one model [1, ...], the unstacked copy freed at once (so a loaded
    checkpoint's weights are never held twice)."""
    y = x[None]
    x.delete()
    return y


def _take(tree, index: np.ndarray):
    """`tree` with only the models at `index` along every leaf's leading axis."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[index], tree)
