"""The one report driver: a report declares itself (`Report`), and `analyse` (a results
folder) or `analyse_subject` (anything `subjects` opens, e.g. a checkpoint) runs it:
ask the subject -> compute -> write the CSVs -> print and write summary.json -> plot.
`report_main(REPORT)` is an entry point's `main`: `--run` folders or `--checkpoint`
folders, every one checked before any compute.

* `declared(name)`: a report's refusal, from what the run's family and task declare
  (`TrainedFamily.reports`, `Task.reports`); `needs_depth` for the LM-site reports;
* `report_parts`: a report split into (question set, model group) parts, main first
  (`subjects.model_groups`: the generalising models, then the others; a run trained
  with `--seeds_until`: the models passing its selection rule, then the failing ones,
  every report saying "n = k of m trained (rule: ...)"), and `Report.compare`'s
  headline numbers compared between the two (passing - failing, Welch 95% interval
  over models: `tables.compare_groups`, summary.json's "passing_vs_failing");
* `compiled_call`: one compiled call with its compile and compute times logged.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxmech.data.tasks import get_task
from jaxmech.families import get_family
from jaxmech.heartbeat import heartbeat
from jaxmech.memory import peak_bytes, release_freed
from jaxmech.reports.checkpoints import open_checkpoint
from jaxmech.reports.runs import GENERALISING, check_run, check_runs, model_groups, open_run
from jaxmech.reports.subjects import EXAMPLE_WORDS, LoadedRun, subset
from jaxmech.reports.tables import (
    COMPARED,
    compare_groups,
    print_comparison,
    write_csv,
    write_json,
)


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
    its task both declare the report (`TrainedFamily.reports`, `Task.reports`), else why not
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


def report_main(report, refusal=None, on_checkpoint=None, video: bool = False):
    """The `main(argv)` of a report entry point: every folder of its `--run` flag
    (which the entry module defines: absl flags belong to one module) is checked by
    `check_runs` before any compute, then the report runs on each. `report`: a `Report`
    (its refusal and folder; with `--checkpoint=DIR`, `cli.define_checkpoint_flags`,
    the checkpoint is opened, `open_checkpoint`, and its report written into `--out`),
    or a function `analyse(folder)` with its `refusal` (and `on_checkpoint(run, out)`).
    `video`: checkpoints opened as videos."""
    from absl import app, flags

    from jaxmech.cli import setup_runtime

    across = None
    if isinstance(report, Report):
        refusal, video, across = report.refusal, report.video, report.across
        analyse_one = lambda path: analyse(report, path)  # noqa: E731

        def on_checkpoint(run, out):
            try:  # a subject the report refuses: a usage error, not a traceback
                report.check and report.check(run, print)
            except ValueError as e:
                raise app.UsageError(str(e)) from None
            return analyse_loaded(report, run, plots_dir(out, report.folder))
    else:
        analyse_one = report

    def main(argv):
        del argv
        setup_runtime()
        F = flags.FLAGS
        if on_checkpoint is not None and "checkpoint" in F and F.checkpoint:
            if F.run:
                raise app.UsageError("give --run or --checkpoint, not both")
            source = F["questions_from"].value if "questions_from" in F else "drawn"
            if source != "drawn" and not (isinstance(report, Report) and report.photos):
                raise app.UsageError(
                    f"--questions_from={source}: this report asks drawn scenes only (its "
                    "probes or edits are cells of a drawn grid); use --questions_from=drawn"
                )
            return checkpoints_main(F, on_checkpoint, video, across)
        try:
            runs = check_runs(F.run, refusal)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
        for r in runs:
            print(f"\n=== {r}")
            analyse_one(r)

    return main


def checkpoints_main(F, on_checkpoint, video: bool, across=None) -> None:
    """`--checkpoint=A[,B,...]`: each checkpoint's report into `--out` (several: into
    OUT/NAME/ each, then `across_checkpoints.json`, the paper's median over models,
    with the report's own record across them, `across(summaries, OUT)`: `Report.across`).
    Each is a folder or a Hub name `ORG/NAME[@REVISION]` (resolved through the Hugging
    Face cache, fetched here: `hub_names.checkpoint_folder`; NAME names its results).
    Every folder and option is checked before any weight is read."""
    from absl import app

    from jaxmech.cli import checkpoint_options
    from jaxmech.families.registry import read_checkpoint_config
    from jaxmech.hub_names import checkpoint_folder

    folders = [f for f in F.checkpoint.split(",") if f]
    name = lambda f: os.path.basename(os.path.normpath(f))  # noqa: E731
    try:
        opts = checkpoint_options(F)
        local = {f: checkpoint_folder(f) for f in folders}
        for f in folders:
            read_checkpoint_config(local[f])
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
            run = open_checkpoint(local[f], **opts, video=video)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
        print(f"\n=== {f} -> {sub}")
        summaries[name(f)] = on_checkpoint(run, sub)["summary"]
        budget = run.subject.budget
        del run
        print(f"memory: peak {peak_bytes() / 2**30:.2f} GB resident (budget "
              f"{budget.bytes / 2**30:.1f} GB)")  # fmt: skip
    if many:
        path = os.path.join(out, "across_checkpoints.json")
        record = across_checkpoints(summaries)
        if across is not None:  # e.g. steering's Fig. 9: one point per checkpoint
            record |= across(summaries, out)
        write_json(path, record)
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
    check: Callable | None = None  # check(run, log): refuses a subject before compute
    video: bool = False  # its checkpoints are opened as videos
    photos: bool = False  # it takes a dataset's photographs (`--questions_from`)
    # across(summaries, out) -> dict: its record over several checkpoints (their
    # summaries by name), added to `across_checkpoints.json`, its figures in `out`
    across: Callable | None = None
    # the headline numbers (`tables.Measure`, each read from the per-model rows of one
    # of its tables) compared between a selection's passing and failing models
    compare: tuple = ()


class _Part(NamedTuple):
    """One (question set, model group) of a report: its run, result and tables."""

    key: str
    words: str
    run: LoadedRun
    res: Any
    tables: dict


def _group_words(group: str, models, selection=None) -> str:
    if group == "passing":  # a selected run's: its count and rule, fixed before training
        return f"passing models, {selection.words()}: {list(models)}"
    if group == "failing":
        return (f"failing models, n = {len(models)} of {selection.trained} trained fail "
                f"{selection.rule} (not averaged in): {list(models)}")  # fmt: skip
    sign, name = (">=", "generalising") if group == "generalising" else ("<", "other")
    return f"{name} models (unseen_min_acc {sign} {GENERALISING:g}): {list(models)}"


def _labelled(
    rows: list[dict], examples: str | None, group_of: dict | None, group: str | None = None
) -> list[dict]:
    """`rows` with their question set (`examples`) and model group after `model`
    (`group_of` by model, or the `group` every row was computed on)."""
    head = {} if examples is None else {"examples": examples}
    if group is not None:
        head["model_group"] = group
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
        [] if group == "all" else [_group_words(group, sub.models, run.selection)]
    )
    key = "/".join(x for x in (e, None if group == "all" else group) if x)
    return _Part(key, ", ".join(words), sub, take_models(res, report.per_model, index), own)


def report_parts(report: Report, run: LoadedRun) -> tuple[list[_Part], dict, dict]:
    """(every (question set, model group) part, main first; the tables of every set,
    each row labelled with its `examples` and `model_group` where the report splits
    them; {question set: `compute`'s result over every model}).

    A run with a selection (`LoadedRun.selection`) is always split into its passing
    and failing models: a report without per-model results (`Report.per_model` empty)
    is then computed on each group apart, and `full` holds the passing models'."""
    apart = not report.per_model and run.selection is not None
    groups = model_groups(run) if report.per_model or apart else [("all", np.arange(run.k))]
    group_of = {run.models[i]: g for g, index in groups for i in index}
    parts, tables, full = [], {}, {}
    for e in (report.examples if run.examples else ()) or (None,):
        r = run if e is None else run._replace(examples=e)
        if apart:
            parts += _parts_apart(report, r, groups, tables, full)
            continue
        res = full[e] = report.compute(r)
        own = report.tables(res, r)
        for name, rows in own.items():
            tables.setdefault(name, []).extend(
                _labelled(rows, e, group_of if report.per_model else None)
            )
        parts += [_part(report, r, res, own, g, index) for g, index in groups]
    return parts, tables, full


def _parts_apart(report: Report, run: LoadedRun, groups, tables: dict, full: dict) -> list:
    """`report_parts` of one question set, `compute` run on each model group alone (its
    rows labelled with the group; `full` keeps the first group's result)."""
    e, parts = run.examples if report.examples else None, []
    for g, index in groups:
        sub = subset(run, index)
        res = report.compute(sub)
        full.setdefault(e, res)
        own = report.tables(res, sub)
        for name, rows in own.items():
            tables.setdefault(name, []).extend(_labelled(rows, e, None, g))
        parts.append(_part(report, sub, res, own, g, np.arange(sub.k)))
    return parts


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
    if report.check is not None:
        report.check(run, log)
    return analyse_loaded(report, run, out, log)


def analyse_loaded(report: Report, run: LoadedRun, out: str, log=print) -> dict:
    """`analyse` on an opened subject, written into `out` (its finished chunks, where
    it keeps them, in `out/chunks/`: `questions.table_store`)."""
    run = run._replace(subject=run.subject.with_chunks(os.path.join(out, "chunks")))
    parts, tables, full = report_parts(report, run)
    for name, rows in tables.items():
        write_csv(os.path.join(out, f"{name}.csv"), rows)
    # a selection no model passes has no main group: its failing models stay beside
    main = run.selection is None or len(run.selection.passing) > 0
    if run.selection is not None:  # the models the main rows rest on, and the rule
        none = "" if main else ": no model passes, so no main group (the failing ones beside)"
        log(f"selection: {run.selection.words()}{none}")
    if len(parts) == 1 and not parts[0].key:
        summary = report.summarise(parts[0].res, parts[0].tables, run, log)
    else:
        summary = {"main": parts[0].key if main else None}
        if run.selection is None:
            summary["threshold"] = GENERALISING
        else:
            summary["selection"] = run.selection.record()
        for i, p in enumerate(parts):
            log(f"\n--- {'main: ' if i == 0 and main else 'beside: '}{p.words}")
            summary[p.key] = report.summarise(p.res, p.tables, p.run, log)
        if run.selection is not None and report.compare:
            summary["passing_vs_failing"] = compared(report, tables, log)
    if run.subject.source != "drawn":  # what was asked: the dataset, its files' sha256
        summary = {"questions": run.subject.source} | summary
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


def compared(report: Report, tables: dict, log=print) -> dict:
    """summary.json's "passing_vs_failing": {"method": how, question set: {measure:
    `tables.group_difference`}} of `report.compare` over the labelled `tables` of a run
    with a selection, printed as one block."""
    comparison = compare_groups(tables, report.compare)
    print_comparison(comparison, log, report.example_words)
    return {"method": COMPARED} | comparison


def analyse_subject(report: Report, run: LoadedRun, out: str, log=print) -> dict:
    """`report` on an opened subject (e.g. `open_checkpoint`'s), after its `check`,
    into `out/{report.folder}`."""
    if report.check is not None:
        report.check(run, log)
    return analyse_loaded(report, run, plots_dir(out, report.folder), log)


def take_models(res: dict, keys, index) -> dict:
    """`res` with the leaves under `keys` (models on axis 0) at model positions `index`."""
    pick = lambda x: np.asarray(x)[np.asarray(index)]  # noqa: E731
    return res | {k: jax.tree_util.tree_map(pick, res[k]) for k in keys}


def compiled_call(fn, args: tuple, what: str, log=print, estimate: bool = False):
    """`jax.device_get(jax.jit(fn)(*args))`, compiled first, with compile and compute
    times logged apart (`what` names the call), so a long call is not a silent one;
    `estimate` (a checkpoint's: `subject.estimates_time`): both times estimated first
    (`estimate_line`)."""
    import time

    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    if estimate:
        log(estimate_line(traced.jaxpr, what))
    log(f"  {what}: compiling")
    with heartbeat(f"{what}: compiling", log):
        call = traced.lower().compile()
    release_freed()  # the compile's scratch
    t1 = time.perf_counter()
    m = call.memory_analysis()
    scratch = f", XLA's scratch {m.temp_size_in_bytes / 2**30:.2f} GB" if m is not None else ""
    log(f"  {what}: compiled in {t1 - t0:.0f} s{scratch}; computing")
    with heartbeat(f"{what}: computing", log):
        out = jax.device_get(call(*args))
    log(f"  {what}: computed in {time.perf_counter() - t1:.0f} s")
    return out


def estimate_line(jaxpr, what: str) -> str:
    """The estimated compute and compile times of the program `jaxpr` (one line, for
    before it is compiled): its products' FLOPs (`sizing.program_cost`, loops counted
    whole) over this machine's matmul rates (`sizing.product_seconds`); the compile
    apart: its equations
    x `sizing.COMPILE_S_PER_EQUATION` (measured on a 2-core CPU; less where the
    compilation cache holds the program)."""
    from jaxmech.sizing import COMPILE_S_PER_EQUATION, product_seconds, program_cost

    cost = program_cost(jaxpr)
    secs, rates = product_seconds(cost)
    flops = (cost["flops"] + cost["flops_low"]) / 1e9
    compile_s = cost["equations"] * COMPILE_S_PER_EQUATION
    return (f"  {what}: estimate ~{_duration(secs)} computing ({flops:.4g} GFLOP of products "
            f"at this machine's {rates}) after ~{_duration(compile_s)} compiling "
            f"({cost['equations']} operations x {COMPILE_S_PER_EQUATION * 1e3:.1f} ms)")  # fmt: skip


def _duration(secs: float) -> str:
    if secs < 10:
        return f"{secs:.2g} s"
    return f"{secs:.0f} s" if secs < 120 else f"{secs / 60:.1f} min"
