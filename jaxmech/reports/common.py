"""What every report shares: a loaded run, CSV / JSON files, seed summaries, ablation tables.

* `open_run(path)`: a finished results folder as device arrays (stacked params [K, ...],
  settings [K]) plus the task's data, the prologue of every report. Diverged models
  (results.csv `diverged_step >= 0`: their params are the last finite ones, not a
  trained model) are left out and named, one `excluded: ...` line each, so no report
  averages them in; the kept models keep their index in the run (`LoadedRun.models`);
* `check_run(path)`: the cheap check an entry point runs on every folder before any
  compute (config.json, results.csv, at least one finite model); `check_runs(text,
  refusal)` does it for every folder of a `--run` flag;
* `Report` / `analyse`: the one report driver (open -> compute -> write the CSVs ->
  print and write summary.json -> plot) that a report declares itself to;
* `declared(name)`: a report's refusal, from what the run's family and task declare
  (`Family.reports`, `Task.reports`); `needs_depth` for the LM-site reports;
* `view_of(run)`, `eval_specs(run)`, `question_specs(run)`, `relation_questions(run)`,
  `steering_examples(run)`, `id_labels(run)`: a run's VLM view, its questions of one
  set (`EXAMPLES`: seen pairs, the main set, and unseen pairs) as rendered examples
  (`families.vlm_view`), and the labels its universal IDs average over, what the seed
  003 / 004 reports share;
* `model_groups(run)`, `subset(run, index)`: the generalising models (unseen_min_acc
  >= `GENERALISING`) and the others, so that no mean mixes the two; `report_parts`
  splits a report into (question set, model group) parts, main first;
* `write_csv` (the one CSV writer, from `jaxmech.results`) and `write_json`;
* `spread` / `fmt_spread` / `fmt_ci`: mean, std, min, max over models (finite values),
  and mean +- std with a 95% t-interval (`jaxmech.stats.mean_ci`);
* `ablation_rows`, `ablation_summary`, `print_ablation_summary`: a [K, A] table of
  accuracies per metric (models x ablations) as CSV rows, as per-ablation statistics,
  and as the printed table.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis.steering import adversarial_targets
from jaxmech.cli import PROTOCOLS
from jaxmech.config import SWEEPABLE, Config, Settings
from jaxmech.data.scenes import eval_masks
from jaxmech.data.spec import PRESENCE, take
from jaxmech.data.tasks import get_task
from jaxmech.families import get_family, view_for
from jaxmech.families.vlm_view import Examples, VLMView, examples, model_outline
from jaxmech.memory import memory_budget, peak_bytes, plan_rows, release_freed, tree_bytes
from jaxmech.results import load_config, load_run, write_csv
from jaxmech.stats import bootstrap_ci, mean_ci

__all__ = [
    "COMPACT",
    "WIDE",
    "LoadedRun",
    "TableStyle",
    "ablation_rows",
    "ablation_summary",
    "check_run",
    "check_runs",
    "excluded_lines",
    "fmt_ci",
    "fmt_spread",
    "is_diverged",
    "load_config",
    "open_run",
    "print_ablation_summary",
    "spread",
    "write_csv",
    "setting_text",
    "write_json",
]


class LoadedRun(NamedTuple):
    """A finished results folder, ready for analysis: its finite models only."""

    path: str
    config: Config
    params: Any  # stacked [K, ...], device arrays
    settings: Settings  # device arrays [K]
    data: Any  # the task's tables and eval sets (`train.build_data`); None if not asked
    results: list[dict]  # results.csv rows, one per kept model
    models: tuple[int, ...]  # [K] each model's index in the run (results.csv `model`)
    excluded: tuple[str, ...]  # one line per diverged model left out (`excluded_lines`)
    curves: list[dict] = ()  # curves.csv rows, every model's
    family: Any = None  # `families.Family` of the run
    task: Any = None  # `data.tasks.Task` of the run
    examples: str = "unseen"  # which questions the seed 003 / 004 reports ask (`EXAMPLES`)

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
    _refuse_all_diverged(path, _results_rows(path))
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


def open_report(
    path: str, refusal, folder: str, log=print, with_data: bool = True
) -> tuple[LoadedRun, str]:
    """(the loaded run, its report folder `path/folder`, created) for a report's
    analyse function, after `check_run` and `refusal(config, path)` (raised as
    ValueError when the report does not apply)."""
    why = refusal(check_run(path), path)
    if why:
        raise ValueError(why)
    return open_run(path, with_data=with_data, log=log), plots_dir(path, folder)


def plots_dir(path: str, folder: str) -> str:
    """`path/folder`, created: a report's folder."""
    from jaxmech import plots

    return plots.ensure_dir(os.path.join(path, folder))


def declared(report: str, hint: str = ""):
    """The refusal of report `report` (its folder name): None when the run's family and
    its task both declare the report (`Family.reports`, `Task.reports`), else why not
    (`hint`, with {path} filled in, says which report to use instead)."""

    def refusal(config, path: str) -> str | None:
        family, task = get_family(config.model.model_kind), get_task(config.task.task_kind)
        for field, holder in (("model_kind", family), ("task_kind", task)):
            if report not in holder.reports:
                known = ", ".join(holder.reports) or "none"
                more = f"; {hint.format(path=path)}" if hint else ""
                return (
                    f"{path}: {field} = {holder.name!r} has no {report} report (its "
                    f"reports: {known}){more}"
                )
        return None

    return refusal


def needs_depth(config, path: str) -> str | None:
    """Why a VLM has no LM site to steer, one after an LM block and before the last
    (None: it has one, or its config does not say: `lm_n_layers`)."""
    depth = getattr(config.model, "lm_n_layers", None)
    if depth is not None and depth < 2:
        return (
            f"{path}: lm_n_layers = {depth}: steering needs a site after an LM block "
            "and before the last"
        )
    return None


def view_of(run: LoadedRun) -> VLMView:
    """The VLM view of a run's family (`families.view_for`), or a checkpoint's."""
    if isinstance(run.data, CheckpointData):
        return run.data.view
    return view_for(run.config)


EXAMPLES = ("seen", "unseen")  # the seed 003 / 004 reports' question sets, main first
EXAMPLE_SETS = {"seen": "seen_pair", "unseen": "unseen_pair"}
EXAMPLE_WORDS = {
    "seen": "seen-pair questions (training-pair labels, layouts no model trained on)",
    "unseen": "unseen-pair questions (validation labels)",
}
GENERALISING = 0.9  # unseen_min_acc at which a model counts as generalising


def question_specs(run: LoadedRun) -> dict:
    """{"examples": spec, twin: spec}: the questions of `run.examples` (`EXAMPLES`) as
    scene specs. "unseen": the whole unseen-pair set; "seen": the seen-pair rows that
    belong to every model's seen set (`data.scenes.eval_masks`: both labels trained in
    pairs, a layout held out), so one batch serves every model of the run. A
    checkpoint's: its question set (`open_checkpoint`)."""
    if isinstance(run.data, CheckpointData):
        return run.data.specs
    specs = eval_specs(run, EXAMPLE_SETS[run.examples])
    if run.examples == "unseen":
        return specs
    evals = run.data.evals
    rows = jax.vmap(lambda s: eval_masks(evals, s)["seen_pair"])(run.settings)
    keep = np.asarray(rows).all(0)
    if not keep.any():
        raise ValueError(f"{run.path}: no seen-pair question belongs to every model's seen set")
    return {k: take(v, keep) for k, v in specs.items()}


def id_labels(run: LoadedRun) -> range:
    """The labels a universal spatial ID is averaged over: those every model of the run
    saw in training pairs (1..min n_pair_labels; the validation labels' IDs agree with
    them only in part, issue 26). A checkpoint's: the first half of its labels (the
    other half's IDs are compared with them)."""
    if isinstance(run.data, CheckpointData):
        return range(1, run.data.view.n_labels // 2 + 1)
    return range(1, int(np.min(np.asarray(run.settings.n_pair_labels))) + 1)


def relation_questions(run: LoadedRun) -> Examples:
    """The questions of `run.examples` (`question_specs`) of both spatial relations
    (presence questions left out), rendered by the run's family; `spec.cells_BxK`
    [N, 3]: X, Y, distractor (-1: none)."""
    spec = question_specs(run)["examples"]
    return examples(view_of(run), take(spec, np.asarray(spec.relation_B) < PRESENCE))


def steering_examples(run: LoadedRun):
    """(Examples, source cells, target cells) of `relation_questions`: X steered from
    its cell to the far edge beyond Y (`analysis.steering.adversarial_targets`)."""
    ex, grid = relation_questions(run), view_of(run).grid
    cells = np.asarray(ex.spec.cells_BxK)
    target = adversarial_targets(cells, np.asarray(ex.spec.relation_B), grid.h, grid.w)
    return ex, cells[:, 0], target


def eval_specs(run: LoadedRun, name: str = "unseen_pair") -> dict:
    """{"examples": spec, twin: spec}: one of the run's eval sets as scene specs."""
    return run.task.eval_specs(run.config.task, getattr(run.data.evals, name))


def model_groups(run: LoadedRun) -> list[tuple[str, np.ndarray]]:
    """[(name, positions of the models in the run)]: "generalising" (unseen_min_acc >=
    `GENERALISING`) first, then "others", so a mean never mixes the two kinds; empty
    groups left out. A run whose results have no unseen_min_acc: [("all", every)]."""
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


def take_models(res: dict, keys, index) -> dict:
    """`res` with the leaves under `keys` (models on axis 0) at model positions `index`."""
    pick = lambda x: np.asarray(x)[np.asarray(index)]  # noqa: E731
    return res | {k: jax.tree_util.tree_map(pick, res[k]) for k in keys}


def report_main(analyse, refusal, on_checkpoint=None, video: bool = False):
    """The `main(argv)` of a report entry point: every folder of its `--run` flag
    (which the entry module defines: absl flags belong to one module) is checked by
    `check_runs` before any compute, then `analyse(folder)` runs on each. With
    `on_checkpoint(run, out)` the entry point also takes `--checkpoint=DIR`
    (`cli.define_checkpoint_flags`): the checkpoint is opened (`open_checkpoint`) and
    its report written into `--out` (`video`: opened as videos)."""
    from absl import app, flags

    from jaxmech.cli import setup_runtime

    def main(argv):
        del argv
        setup_runtime()
        F = flags.FLAGS
        if on_checkpoint is not None and F.checkpoint:
            if F.run:
                raise app.UsageError("give --run or --checkpoint, not both")
            return checkpoints_main(F, on_checkpoint, video)
        try:
            runs = check_runs(F.run, refusal)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
        for r in runs:
            print(f"\n=== {r}")
            analyse(r)

    return main


def checkpoints_main(F, on_checkpoint, video: bool) -> None:
    """`--checkpoint=A[,B,...]`: each checkpoint's report into `--out` (several: into
    OUT/NAME/ each, then `across_checkpoints.json`, the paper's median over models).
    Every folder and option is checked before any weight is read."""
    from absl import app

    from jaxmech.cli import checkpoint_options
    from jaxmech.families.registry import read_checkpoint_config

    folders = [f for f in F.checkpoint.split(",") if f]
    name = lambda f: os.path.basename(os.path.normpath(f))  # noqa: E731
    try:
        opts = checkpoint_options(F)
        for f in folders:
            read_checkpoint_config(f)
        if len({name(f) for f in folders}) < len(folders):
            raise ValueError(f"--checkpoint = {F.checkpoint!r}: two folders share a name")
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    many = len(folders) > 1
    out = F.out or os.path.join("runs", "checkpoints", "across" if many else name(folders[0]))
    summaries = {}
    for f in folders:
        sub = os.path.join(out, name(f)) if many else out
        try:
            run = open_checkpoint(f, **opts, video=video)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
        print(f"\n=== {f} -> {sub}")
        summaries[name(f)] = on_checkpoint(run, sub)["summary"]
        budget = run.data.budget
        del run
        print(f"memory: peak {peak_bytes() / 2**30:.2f} GB resident (budget "
              f"{budget.bytes / 2**30:.1f} GB)")  # fmt: skip
    if many:
        path = os.path.join(out, "across_checkpoints.json")
        write_json(path, across_checkpoints(summaries))
        print(f"\nmedian over {len(folders)} checkpoints of every number, with its spread: {path}")


def across_checkpoints(summaries: dict) -> dict:
    """{"checkpoints": names, key: ...}: the summaries of several checkpoints (same
    report) merged key by key; where each holds an interval (mean, low, high, n), the
    median of the means over the checkpoints with their min and max (the paper's
    median over models) and how many had a value; other leaves as a list per
    checkpoint."""
    names, values = list(summaries), list(summaries.values())

    def merge(vs):
        if all(isinstance(v, dict) for v in vs):
            keys = [k for k in vs[0] if all(k in v for v in vs)]
            return {k: merge([v[k] for v in vs]) for k in keys}
        if all(isinstance(v, (list, tuple)) and len(v) == 4 and all(
                isinstance(x, (int, float)) for x in v) for v in vs):  # fmt: skip
            m = np.asarray([v[0] for v in vs], float)
            m = m[np.isfinite(m)]
            if len(m) == 0:
                return {"median": None, "min": None, "max": None, "models": 0}
            return {"median": float(np.median(m)), "min": float(m.min()),
                    "max": float(m.max()), "models": int(len(m))}  # fmt: skip
        return list(vs)

    return {"checkpoints": names} | merge(values)


class Report(NamedTuple):
    """One report, as the driver (`analyse`) runs it: open the run (refused first by
    `refusal(config, path)`), `compute(run) -> res` (the compiled call, and what the
    tables and figure derive from it), `tables(res, run) -> {name: rows}` (each written
    to `folder/{name}.csv`), `summarise(res, tables, run, log) -> dict` (prints the
    report and returns summary.json's contents), `plot(res, tables, run, path) -> path`
    (the figure `folder/{figure}`; a report with several figures returns their paths
    and names the folder's first). `with_data`: whether the run's task data is built
    (a report of the results files alone needs none).

    `examples`: the question sets it is computed on, each once (`EXAMPLES`, main
    first; `LoadedRun.examples` says which); () computes once. `per_model`: the keys of
    `compute`'s result whose leaves have the models on axis 0: the summary is then
    printed per model group (`model_groups`, generalising first); () does not split.
    The figure shows the main set and group; `example_words` name the sets in the
    printed headers."""

    folder: str
    refusal: Callable
    compute: Callable
    tables: Callable
    summarise: Callable
    plot: Callable
    figure: str
    with_data: bool = True
    examples: tuple[str, ...] = ()
    per_model: tuple[str, ...] = ()
    example_words: dict = EXAMPLE_WORDS  # how the printed header names each set


class _Part(NamedTuple):
    """One (question set, model group) of a report: its run, result and tables."""

    key: str
    words: str
    run: LoadedRun
    res: Any
    tables: dict


def _group_words(group: str, models) -> str:
    sign, name = (">=", "generalising") if group == "generalising" else ("<", "other")
    return f"{name} models (unseen_min_acc {sign} {GENERALISING:g}): {list(models)}"


def _labelled(rows: list[dict], examples: str | None, group_of: dict | None) -> list[dict]:
    """`rows` with their question set (`examples`) and model group after `model`."""
    head = {} if examples is None else {"examples": examples}
    if group_of is None:
        return [{**head, **x} for x in rows]
    return [{"model": x["model"], **head, "model_group": group_of[x["model"]], **x} for x in rows]


def _part(report: Report, run: LoadedRun, res, tables: dict, group: str, index) -> _Part:
    """The part of `run`'s result and tables (one question set) for one model group."""
    sub = subset(run, index) if report.per_model else run
    kept = set(sub.models)
    own = {n: [x for x in rows if x.get("model", -1) in kept or "model" not in x]
           for n, rows in tables.items()}  # fmt: skip
    e = run.examples if report.examples else None
    words = ([report.example_words[e]] if e else []) + (
        [] if group == "all" else [_group_words(group, sub.models)]
    )
    key = "/".join(x for x in (e, None if group == "all" else group) if x)
    return _Part(key, ", ".join(words), sub, take_models(res, report.per_model, index), own)


def report_parts(report: Report, run: LoadedRun) -> tuple[list[_Part], dict, dict]:
    """(every (question set, model group) part, main first; the tables of every set,
    each row labelled with its `examples` and `model_group` where the report splits
    them; {question set: `compute`'s result over every model})."""
    groups = model_groups(run) if report.per_model else [("all", np.arange(run.k))]
    group_of = {run.models[i]: g for g, index in groups for i in index}
    parts, tables, full = [], {}, {}
    for e in (report.examples if run.examples else ()) or (None,):
        r = run if e is None else run._replace(examples=e)
        res = full[e] = report.compute(r)
        own = report.tables(res, r)
        for name, rows in own.items():
            tables.setdefault(name, []).extend(
                _labelled(rows, e, group_of if report.per_model else None)
            )
        parts += [_part(report, r, res, own, g, index) for g, index in groups]
    return parts, tables, full


def analyse(report: Report, path: str, log=print) -> dict:
    """Computes, writes, prints and plots `report` on results folder `path`: {"summary":
    summary.json's dict, "tables": {name: rows}, "res": `compute`'s result on the
    main question set (every model), "by_examples": {question set: that result},
    "parts": {part key: its result}}. Raises ValueError (before any compute) for a run
    the report does not apply to.

    A report with question sets or model groups (`Report.examples`, `per_model`) prints
    one summary per part, the main one (seen pairs, generalising models) first; the
    summary holds each under its key ("seen/generalising", ...) and names the main."""
    run, out = open_report(path, report.refusal, report.folder, log, report.with_data)
    return analyse_loaded(report, run, out, log)


def analyse_loaded(report: Report, run: LoadedRun, out: str, log=print) -> dict:
    """`analyse` on a loaded run (or checkpoint: `open_checkpoint`, whose finished
    chunks are kept in `out/chunks/`: `table_store`), written into `out`."""
    if checkpoint_data(run) is not None:
        run = run._replace(data=run.data._replace(chunks=os.path.join(out, "chunks")))
    parts, tables, full = report_parts(report, run)
    for name, rows in tables.items():
        write_csv(os.path.join(out, f"{name}.csv"), rows)
    if len(parts) == 1 and not parts[0].key:
        summary = report.summarise(parts[0].res, parts[0].tables, run, log)
    else:
        summary = {"main": parts[0].key, "threshold": GENERALISING}
        for i, p in enumerate(parts):
            log(f"\n--- {'main: ' if i == 0 else 'beside: '}{p.words}")
            summary[p.key] = report.summarise(p.res, p.tables, p.run, log)
    write_json(os.path.join(out, "summary.json"), summary)
    main = parts[0]
    fig = report.plot(main.res, main.tables, main.run, os.path.join(out, report.figure))
    figs = "  ".join([fig] if isinstance(fig, str) else fig)
    log("results: " + os.path.join(out, f"{next(iter(tables))}.csv") + "  figures: " + figs)
    return {
        "summary": summary,
        "tables": tables,
        "res": next(iter(full.values())),
        "by_examples": full,
        "parts": {p.key: p.res for p in parts},
    }


class CheckpointData(NamedTuple):
    """What a checkpoint's `LoadedRun` holds instead of a task's data: its VLM view, its
    question set (`data.spec.pair_questions`), the LM blocks a report studies (None:
    every one), the scenes per compiled call (None: planned within `budget` from the
    compiled program's memory analysis, `rows_per_call`), what the questions depend on
    (`key`: the checkpoint's files and the options, for `table_store`) and where a
    report keeps its finished chunks (None: nowhere; `analyse_loaded` sets it)."""

    view: VLMView
    specs: dict
    layers: tuple | None
    batch: int | None
    key: dict
    chunks: str | None = None
    budget: Any = None  # memory.Budget: the peak the report may hold
    protocol: str = "jaxmech"  # whose protocol the tables follow (`protocol_of`)


def protocol_of(run: LoadedRun) -> str:
    """Whose protocol a report follows on `run`: a checkpoint's `--protocol` ("authors":
    the seed authors' scripts, BUILD_NOTES' difference table; "jaxmech"); a results
    folder's is jaxmech's."""
    ckpt = checkpoint_data(run)
    return ckpt.protocol if ckpt else "jaxmech"


def checkpoint_data(run: LoadedRun) -> CheckpointData | None:
    return run.data if isinstance(run.data, CheckpointData) else None


def steered_sites(run: LoadedRun) -> list[int]:
    """The LM sites the steering reports steer: every layer 1 <= y < n (before layer 1
    the object word has seen no image; after the last block only the final norm reads
    the residual), a checkpoint's within its `--layers`."""
    ckpt = checkpoint_data(run)
    n = view_of(run).n_lm_blocks(model_outline(run.params))
    return [y for y in (ckpt.layers if ckpt and ckpt.layers else range(n)) if 1 <= y < n]


def rows_per_call(run: LoadedRun, compile_at, n: int, log=print):
    """(rows per compiled call of a table over `n` questions, its `memory.Plan` or
    None): all of a run's; a checkpoint's `--batch`, or where that is None the most
    whose compiled program (`compile_at(b)`) fits in the checkpoint's memory budget
    beside what is held (`memory.plan_rows`, logged; the weights, arguments of the
    program, are counted once). Raises `memory.MemoryBudgetError` when one does not
    fit."""
    ckpt = checkpoint_data(run)
    if ckpt is None:
        return n, None
    if ckpt.batch is not None:
        return min(ckpt.batch, n), None
    plan = plan_rows(compile_at, n, ckpt.budget or memory_budget(), tree_bytes(run.params), log)
    log(f"  memory: {plan.text()}")
    return plan.rows, plan


def probe_rows(run: LoadedRun, log=print) -> int | None:
    """Probe scenes per chunk of a checkpoint's forwards inside one compiled report
    (`spatial_ids.map_chunks`: the probes', and the questions' where a report chunks
    them too): its `rows_per_call` of the view's forward capturing every residual site,
    on probe scenes; None (every scene at once) for a run."""
    from jaxmech.analysis import spatial_ids as si

    if checkpoint_data(run) is None:
        return None
    view, first = view_of(run), model_outline(run.params)
    n_blocks = view.n_lm_blocks(first)
    sites = [si.resid_site(y, n_blocks) for y in range(n_blocks + 1)]
    inputs = si.probe(view, [1], placements=1).inputs
    n = len(np.asarray(jax.tree_util.tree_leaves(inputs)[0]))
    f = jax.jit(lambda p, x: view.forward(p, x, capture=sites))
    at = lambda b: jax.tree_util.tree_map(lambda v: np.asarray(v)[np.arange(b) % n], inputs)  # noqa: E731
    return rows_per_call(run, lambda b: f.lower(first, at(b)).compile(), 1 << 30, log)[0]


def table_store(run: LoadedRun, table: str, **what):
    """The `chunks.ChunkStore` of a checkpoint's table named `table` with options
    `what` (e.g. its layers and rows per call) beside the checkpoint's key, or None
    (a run's tables are one call; a checkpoint's outside `analyse_loaded`)."""
    from jaxmech.chunks import store_for

    ckpt = checkpoint_data(run)
    if ckpt is None or ckpt.chunks is None:
        return None
    return store_for(ckpt.chunks, {**ckpt.key, "table": table, **what})


def chunk_progress(log, batch: int):
    """`progress(done, n, resumed=0)` that logs the questions done, the time spent and
    an ETA after each chunk of `batch` (silent when the questions fit in one);
    `resumed` of them were read from a store, not computed."""
    import time

    t0 = time.perf_counter()

    def progress(done: int, n: int, resumed: int = 0) -> None:
        if n > batch:
            spent = time.perf_counter() - t0
            rate = spent / max(done - resumed, 1)
            was = f" ({resumed} resumed)" if resumed else ""
            log(f"  {done}/{n} questions{was}, {spent:.0f} s, ETA {rate * (n - done):.0f} s")

    return progress


def open_checkpoint(folder: str, *, grid=(4, 4), size: int = 448, questions: int = 64,
                    seed: int = 0, layers=None, batch: int | None = None, dtype="float32",
                    video: bool = False, memory: str | None = None,
                    protocol: str = "jaxmech", log=print) -> LoadedRun:  # fmt: skip
    """A real checkpoint folder as a one-model `LoadedRun` for the seed 003 / 004
    reports: params stacked [1, ...], `data` a `CheckpointData` (the family's VLM view of
    `grid` scenes drawn `size` pixels square, `questions` pair questions per spatial
    relation drawn from `seed`; `batch` per compiled call, None: sized by memory), no
    config, settings or task. `video`: the scenes drawn as videos (the family's video
    view), asked about time only (relation 1: before / after). `memory`: the budget
    (`memory.memory_budget`: GB, a fraction or a percent; None: the default) every
    table's rows per call are planned within. `layers`: as the authors index them
    (layer L the residual after L blocks, `lm/resid_pre.L`; 0..n). `protocol`: "authors"
    (their scripts' wording, answer words and table protocols) or "jaxmech"
    (`protocol_of`). Bad options raise ValueError naming them, before the weights are
    read."""
    from jaxmech.chunks import file_stamps
    from jaxmech.data.spec import Grid, SceneSpec, pair_questions
    from jaxmech.families import load_checkpoint
    from jaxmech.families.registry import read_checkpoint_config

    for name, v in (("questions", questions), ("batch", 1 if batch is None else batch)):
        if v < 1:
            raise ValueError(f"{name} = {v}: expected at least 1")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol = {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    budget = memory_budget(memory)
    family, config = read_checkpoint_config(folder)
    view = family.vlm_view(folder, config, Grid(*grid), size, video=video, wording=protocol)
    n = view.n_lm_blocks(None)
    if layers is not None and (not layers or min(layers) < 0 or max(layers) > n):
        raise ValueError(
            f"layers = {list(layers)}: expected LM layers in [0, {n}] (layer L: the "
            f"residual after L of the {n} blocks)"
        )
    # drawn before the weights are read, so a grid with no question of a relation is
    # refused at once (`spec.check_pair_grid`)
    per_rel = [pair_questions(view.grid, questions, view.n_labels, view.n_colours, seed, rel)
               for rel in ((1,) if video else (0, 1))]  # fmt: skip
    specs = {k: SceneSpec(*map(np.concatenate, zip(*(d[k] for d in per_rel)))) for k in per_rel[0]}
    log(f"loading {folder} ({dtype})")
    _, config, params = load_checkpoint(folder, dtype=getattr(jnp, dtype))
    release_freed()  # the tensors' host copies
    log(f"checkpoint {folder}: {config.variant}, {n} LM blocks, {dtype}, weights "
        f"{tree_bytes(params) / 2**30:.2f} GB; memory budget {budget.bytes / 2**30:.1f} GB "
        f"({budget.how})")  # fmt: skip
    key = {"checkpoint": os.path.abspath(folder), "files": file_stamps(folder), "grid": grid,
           "size": size, "questions": questions, "seed": seed, "dtype": dtype, "video": video,
           "protocol": protocol}  # fmt: skip
    return LoadedRun(
        path=folder,
        config=None,
        params=jax.tree_util.tree_map(_stacked, params),
        settings=None,
        data=CheckpointData(
            view,
            specs,
            None if layers is None else tuple(layers),
            batch,
            key,
            budget=budget,
            protocol=protocol,
        ),  # fmt: skip
        results=[{"model": 0, "diverged_step": -1}],
        models=(0,),
        excluded=(),
        family=family,
        examples=None,
    )


def _stacked(x):
    """x [...] as one model [1, ...], the unstacked copy freed at once (so a loaded
    checkpoint's weights are never held twice)."""
    y = x[None]
    x.delete()
    return y


def _take(tree, index: np.ndarray):
    """`tree` with only the models at `index` along every leaf's leading axis."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[index], tree)


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
    )


def compiled_call(fn, args: tuple, what: str, log=print):
    """`jax.device_get(jax.jit(fn)(*args))`, compiled first, with compile and compute
    times logged apart (`what` names the call), so a long call is not a silent one."""
    import time

    t0 = time.perf_counter()
    log(f"  {what}: compiling")
    call = jax.jit(fn).lower(*args).compile()
    release_freed()  # the compile's scratch
    t1 = time.perf_counter()
    m = call.memory_analysis()
    scratch = f", XLA's scratch {m.temp_size_in_bytes / 2**30:.2f} GB" if m is not None else ""
    log(f"  {what}: compiled in {t1 - t0:.0f} s{scratch}; computing")
    out = jax.device_get(call(*args))
    log(f"  {what}: computed in {time.perf_counter() - t1:.0f} s")
    return out


def write_json(path: str, obj) -> None:
    """A report's summary.json (NumPy scalars written as floats)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=float)


def spread(values) -> tuple[float, float, float, float]:
    """(mean, std, min, max) over the finite values; NaNs when there are none."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    return (v.mean(), v.std(), v.min(), v.max()) if len(v) else (np.nan,) * 4


def fmt_spread(values, cell: str = "{mean:6.3f} +-{std:5.3f} [{min:.2f},{max:.2f}]") -> str:
    """`spread` of `values` as one table cell (format fields: mean, std, min, max)."""
    mean, std, lo, hi = spread(values)
    return cell.format(mean=mean, std=std, min=lo, max=hi)


def fmt_ci(values, lo: float | None = -1.0, hi: float | None = 1.0) -> str:
    """mean +-std [95% CI] over models (interval clipped to [lo, hi]), one table cell;
    "empty (n = 0)" where no value is finite (never a measured-looking zero or NaN)."""
    m, a, b, n = mean_ci(values, lo, hi)
    if n == 0:
        return "empty (n = 0)"
    v = np.asarray(values, float)
    return f"{m:+.3f} +-{float(v[np.isfinite(v)].std()):.3f} [{a:+.3f},{b:+.3f}]"


def question_ci(values, lo: float | None = None, hi: float | None = None):
    """(mean, ci_low, ci_high, n) of one checkpoint's per-question numbers (NaN: a
    question the number is not defined on, left out): the seeded per-question
    bootstrap 95% interval (`stats.bootstrap_ci`), clipped to [lo, hi]. A checkpoint is
    one model, so `mean_ci` over models has none."""
    return bootstrap_ci(values, lo, hi)


def fmt_question_ci(values, lo: float | None = None, hi: float | None = None) -> str:
    """`question_ci` as one table cell (`fmt_interval`)."""
    return fmt_interval(question_ci(values, lo, hi))


def fmt_interval(ci, signed: bool = True) -> str:
    """(mean, ci_low, ci_high, n) as one table cell, "mean [lo, hi] (n = N)"; "empty
    (n = 0)" where nothing was counted (never a measured-looking zero)."""
    m, a, b, n = ci
    if n == 0:
        return "empty (n = 0)"
    f = "+.3f" if signed else ".3f"
    return f"{m:{f}} [{a:{f}},{b:{f}}] (n = {n})"


def cell_interval(per_example_KxB, lo: float | None = None, hi: float | None = None):
    """(mean, ci_low, ci_high, n) of one table cell from each model's per-example values
    [K, B] (NaN: not counted): over the per-model means (`mean_ci`) for a run of
    several models; over the questions (`question_ci`, the per-question bootstrap) for
    one model, a checkpoint; n counts what it rests on."""
    v = np.asarray(per_example_KxB)
    if v.shape[0] == 1:
        return question_ci(v[0], lo, hi)
    n = np.isfinite(v).sum(-1)
    return mean_ci(np.where(n > 0, np.nansum(v, -1) / np.maximum(n, 1), np.nan), lo, hi)


def ablation_rows(table: dict, columns: list[dict], metrics, models=None) -> list[dict]:
    """CSV rows of a models x ablations table, model-major.

    Args:
      table: {metric: [K, A]} accuracies.
      columns: A dicts, the labels of each column (e.g. {"ablation": "ep"}); they go
        between `model` and the metrics.
      metrics: which metrics of `table`, in CSV order.
      models: [K] the `model` of each row (`LoadedRun.models`: the index in the run);
        default 0..K-1.
    """
    k = np.shape(table[metrics[0]])[0]
    models = range(k) if models is None else models
    return [
        {"model": models[i], **col, **{m: float(table[m][i, j]) for m in metrics}}
        for i in range(k)
        for j, col in enumerate(columns)
    ]


def ablation_summary(table: dict, names, metrics) -> dict:
    """{name: {metric: {mean, std, min, max}}} over models of a {metric: [K, A]} table."""
    out = {}
    for j, a in enumerate(names):
        out[a] = {}
        for m in metrics:
            mean, std, lo, hi = spread(np.asarray(table[m])[:, j])
            out[a][m] = {"mean": mean, "std": std, "min": lo, "max": hi}
    return out


class TableStyle(NamedTuple):
    """Layout of a printed ablation table."""

    name_width: int  # the ablation-name column
    col_width: int  # every metric column
    cell: str  # format of a cell; fields mean, std, min, max
    short_titles: bool  # drop "_acc" from the metric titles


WIDE = TableStyle(12, 24, "{mean:6.3f} +-{std:5.3f} [{min:.2f},{max:.2f}]", False)
COMPACT = TableStyle(10, 15, "{mean:.3f} +-{std:.3f}", True)


def print_ablation_summary(
    summary: dict, metrics, log, header: str = "ablation", style: TableStyle = WIDE
) -> None:
    """Logs an `ablation_summary`: a header line, then one line per ablation."""
    titles = [m.replace("_acc", "") if style.short_titles else m for m in metrics]
    log(f"{header:>{style.name_width}} " + " ".join(f"{t:>{style.col_width}}" for t in titles))
    for a, stats in summary.items():
        cells = [style.cell.format(**stats[m]) for m in metrics]
        log(f"{a:>{style.name_width}} " + " ".join(f"{c:>{style.col_width}}" for c in cells))
