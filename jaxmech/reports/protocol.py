"""The protocol study: under which training protocol does label diversity matter?

Paper 000 reports unseen-pair accuracy rising with N_pair (label diversity) and flat in
n_2 (layouts per pair); under SPEC's defaults N_pair = 5 already generalises. This
module trains the same grid of data settings under a list of training protocols (each
a set of config overrides: `jaxmech.presets`), measures per model the accuracies, the steps it trained,
the CLS-row EP gradient and the EP / EP+BP ablation effects, and writes one Markdown
page with a figure and a verdict per factor.

Every protocol is one resumable sweep (`sweep.run_grid`) in `OUT/<protocol>/`: its
static fields (caption mode, widths, ...) fix one compiled program, its models (cells
x seeds) are the sweepable values. The same study runs on a GPU/TPU with more seeds
(`--seeds=16`): nothing here depends on the backend.

Cells: the N_pair axis at the first n_2 value, and the n_2 axis at the first N_pair
value (default (5, 15), (15, 15), (5, 45): does full layout diversity rescue few labels?).

Diverged models (results.csv `diverged_step >= 0`) are analysed by no statistic, table,
figure or verdict: their mechanism columns are NaN, the cell statistics skip them, and
the log and report.md name each one (`reports.common.excluded_lines`).
"""

from __future__ import annotations

import csv
import json
import os
import time

import jax
import numpy as np

from jaxmech import plots
from jaxmech.analysis.ablate import ablation_table
from jaxmech.analysis.heads import head_table, strongest_heads
from jaxmech.config import Config, ConfigError
from jaxmech.presets import BASELINE, Protocol
from jaxmech.reports.common import excluded_lines, is_diverged, open_run, write_csv
from jaxmech.stats import diff_ci, mean_ci
from jaxmech.sweep import Grid, finite_steps, run_grid
from jaxmech.train import stack_settings, step_budget

FACTOR_TITLES = {
    "dataset": "streaming batches vs a finite set iterated in epochs",
    "length": "training length (streaming)",
    "captions": "caption mode and text depth",
    "singles": "single-object captions and their share of a batch",
    "weight_decay": "weight decay",
    "init": "init scale of E and P",
    "width": "model width",
    "cls_position": "position row on CLS",
}

# ablations measured per model: the EP term, the CLS query x key positions without PP
# (EP+BP) and with it (EP+PP+BP = QP; the one that is identifiable with cls_position)
ABLATIONS = ("none", "ep", "ep+bp", "ep+pp+bp")


def cells_from(n_pairs: list[int], n_2s: list[int]) -> tuple[tuple[int, int], ...]:
    """(N_pair, n_2) cells: the N_pair axis at n_2s[0], the n_2 axis at n_pairs[0]."""
    cells = [(p, n_2s[0]) for p in n_pairs] + [(n_pairs[0], q) for q in n_2s[1:]]
    return tuple(dict.fromkeys(cells))


def protocol_grid(
    protocol: Protocol, cells, seeds: int, first_seed: int = 0, base: Config | None = None
) -> Grid:
    """The protocol's sweep: every cell x `seeds` seeds, one shared config.

    Raises ConfigError (naming the field) for overrides or cells the task refuses.
    """
    if seeds < 1:
        raise ConfigError(f"seeds = {seeds} is invalid: allowed an integer >= 1")
    config = (base or Config()).replace(**protocol.overrides)
    settings = [
        config.replace(seed=first_seed + s, n_pair_labels=p, layouts_per_pair=q).settings()
        for p, q in cells
        for s in range(seeds)
    ]
    config = finite_steps(config, settings, "steps" in protocol.overrides)
    return Grid(config, ("n_pair_labels", "layouts_per_pair"), tuple(settings))


def mechanism_columns() -> list[str]:
    """The columns `mechanism_rows` adds to a model's results row."""
    cols = [f"{s}_{a}" for a in ABLATIONS[1:] for s in ("unseen", "labelset")]
    return cols + ["ep_slope", "ep_gradient"]


def mechanism_rows(path: str, log=print) -> list[dict]:
    """Per finite model of a results folder (`model`: its index in the run): ablated
    accuracies and the strongest EP gradient. Diverged models are left out and logged."""
    run = open_run(path, log=log)
    cfg = run.config
    table = jax.device_get(ablation_table(run.params, run.settings, run.data, ABLATIONS))
    strongest = strongest_heads(
        jax.device_get(head_table(run.params, cfg.task.n_labels, cfg.task.image_len))
    )
    rows = []
    for i in range(run.k):
        row = {"model": run.models[i]}
        for j, a in enumerate(ABLATIONS[1:], start=1):
            row[f"unseen_{a}"] = float(table["unseen_acc"][i, j])
            row[f"labelset_{a}"] = float(table["labelset_acc"][i, j])
        row["ep_slope"] = float(strongest["ep_slope"][i])
        row["ep_gradient"] = float(strongest["ep_gradient"][i])
        rows.append(row)
    return rows


def _read_mechanism(path: str) -> dict[int, dict]:
    """{model: its `mechanism_columns`} of a protocol_mechanism.csv; a ValueError naming
    the file when it is not one."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        return {int(float(r["model"])): {c: float(r[c]) for c in mechanism_columns()} for r in rows}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path} is not a table of per-model mechanism numbers ({type(e).__name__}: "
            f"{e}); delete it and the study recomputes it"
        ) from None


def protocol_mechanism(path: str, rows: list[dict]) -> dict[int, dict]:
    """{model: mechanism columns} of the finite models among results `rows` of protocol
    folder `path`, cached in path/protocol_mechanism.csv (recomputed when the cache
    lacks one of them)."""
    finite = {int(r["model"]) for r in rows if not is_diverged(r)}
    if not finite:
        return {}
    cache = os.path.join(path, "protocol_mechanism.csv")
    by_model = _read_mechanism(cache) if os.path.isfile(cache) else {}
    if not finite <= set(by_model):
        # run_study logs the excluded models itself, cached or not
        write_csv(cache, mechanism_rows(path, log=lambda line: None))
        by_model = _read_mechanism(cache)
    return by_model


def merge_mechanism(rows: list[dict], by_model: dict[int, dict]) -> list[dict]:
    """Each results row with its model's mechanism columns; NaN for a diverged model
    (its last finite params are not a trained model)."""
    missing = dict.fromkeys(mechanism_columns(), np.nan)
    return [{**r, **(missing if is_diverged(r) else by_model[int(r["model"])])} for r in rows]


def run_study(
    out: str,
    protocols,
    cells,
    seeds: int,
    *,
    first_seed: int = 0,
    overwrite: bool = False,
    chunk_size: int | None = None,
    base: Config | None = None,
    log=print,
) -> dict:
    """Trains (resumably) and analyses every protocol; returns {name: merged rows}.

    `base` is the config the protocols' overrides apply to (default: SPEC defaults).
    Every grid is built, and so validated, before anything trains. Diverged models are
    logged, one line each, and get NaN mechanism columns (`merge_mechanism`).
    """
    grids = {p.name: protocol_grid(p, cells, seeds, first_seed, base) for p in protocols}
    merged = {}
    for p in protocols:
        path = os.path.join(out, p.name)
        grid = grids[p.name]
        k = len(grid.settings)
        budget = np.asarray(step_budget(stack_settings(list(grid.settings)), grid.config))
        log(f"\n=== protocol {p.name} ({p.label}): {k} models, {int(budget.sum())} model-steps")
        t0 = time.perf_counter()
        res = run_grid(grid, path, overwrite=overwrite, chunk_size=chunk_size, log=log)
        for line in excluded_lines(res["rows"]):
            log(f"    {p.name}: {line}")
        mech = protocol_mechanism(path, res["rows"])
        merged[p.name] = merge_mechanism(res["rows"], mech)
        took = time.perf_counter() - t0
        time_path = os.path.join(path, "protocol_time.json")
        if res["wall_s"] > 0 or not os.path.isfile(time_path):
            # wall time of the invocation that finished training it (a resumed protocol
            # counts its last invocation only)
            with open(time_path, "w") as f:
                json.dump({"train_s": res["wall_s"], "total_s": took}, f)
        log(f"    {p.name}: {took:.0f} s (training {res['wall_s']:.0f} s)")
    return merged


# ---------------------------------------------------------------------------
# report


def _cell(rows, p, q):
    return [
        r
        for r in rows
        if r["n_pair_labels"] == p and r["layouts_per_pair"] == q and not is_diverged(r)
    ]


def _fmt(m, lo, hi):
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]" if np.isfinite(lo) else f"{m:.3f}"


def _col(rows, name):
    return [r[name] for r in rows]


def trend(rows, cells) -> dict:
    """The two contrasts of the paper's claim, as Welch 95% intervals over seeds.

    label_gain: unseen-pair(N_pair max) - unseen-pair(N_pair min), at the first n_2;
    layout_gain: unseen-pair(n_2 max) - unseen-pair(n_2 first), at the first N_pair.
    """
    p0, q0 = cells[0]
    ps = sorted({p for p, q in cells if q == q0})
    qs = sorted({q for p, q in cells if p == p0})
    lo_p, hi_p = _cell(rows, ps[0], q0), _cell(rows, ps[-1], q0)
    steps = lambda c: float(np.mean(_col(c, "steps_trained"))) if c else float("nan")  # noqa: E731
    out = {
        "label_gain": diff_ci(_col(lo_p, "unseen_acc"), _col(hi_p, "unseen_acc")),
        "label_steps": (steps(lo_p), steps(hi_p)),
    }
    if len(qs) > 1:
        lay = _cell(rows, p0, qs[-1])
        out["layout_gain"] = diff_ci(
            _col(_cell(rows, p0, q0), "unseen_acc"), _col(lay, "unseen_acc")
        )
        out["layout_steps"] = (steps(_cell(rows, p0, q0)), steps(lay))
        out["layout_means"] = (
            float(np.mean(_col(_cell(rows, p0, q0), "unseen_acc"))),
            float(np.mean(_col(lay, "unseen_acc"))),
        )
    return out


def _steps_note(steps) -> str:
    """Says when the two cells of a contrast trained different numbers of steps."""
    a, b = steps
    if not (np.isfinite(a) and np.isfinite(b)) or a == b:
        return ""
    return f", steps {a:.0f} vs {b:.0f}: confounded with training length"


def verdict(tr: dict) -> str:
    """Reads the contrasts: does the paper's trend (label gain, flat layouts) appear?"""
    g, glo, ghi = tr["label_gain"]
    note = _steps_note(tr.get("label_steps", (np.nan, np.nan)))
    if not np.isfinite(glo):
        label = f"label gain {g:+.3f} (too few seeds for an interval)"
        clear = False
    elif glo > 0 and g >= 0.1:
        label = f"**clearly lower at the smallest N_pair** (gain {_fmt(g, glo, ghi)}{note})"
        clear = True
    elif glo > 0:
        label, clear = (
            f"slightly lower at the smallest N_pair (gain {_fmt(g, glo, ghi)}{note})",
            False,
        )
    else:
        label, clear = f"no clear N_pair effect (gain {_fmt(g, glo, ghi)}{note})", False
    if "layout_gain" not in tr:
        return label + "; n_2 axis not run"
    d, dlo, dhi = tr["layout_gain"]
    flat = np.isfinite(dlo) and dlo <= 0 <= dhi or abs(d) < 0.05
    lnote = _steps_note(tr.get("layout_steps", (np.nan, np.nan)))
    at_chance = max(tr.get("layout_means", (1.0, 1.0))) < 0.6
    lay = (
        f"n_2 flat{' at chance' if at_chance else ''} (gain {_fmt(d, dlo, dhi)}{lnote})"
        if flat
        else f"n_2 matters too (gain {_fmt(d, dlo, dhi)}{lnote})"
    )
    paper = "paper's trend: **yes**" if clear and flat else "paper's trend: no"
    return f"{label}; {lay}; {paper}"


def cell_table(protocols, merged, cells) -> list[str]:
    """Markdown rows: per protocol and cell, accuracies and mechanism with 95% CIs."""
    head = (
        "| protocol | N_pair | n_2 | n | steps | unseen-pair | seen-pair | single | label-set "
        "| unseen, EP ablated | unseen, EP+BP | unseen, EP+PP+BP | abs(EP slope) | monotone EP |"
    )
    lines = [head, "|" + "---|" * 14]
    for p in protocols:
        rows = merged.get(p.name)
        if not rows:
            continue
        for cp, cq in cells:
            c = _cell(rows, cp, cq)
            if not c:
                continue
            ci = lambda name, lo=0.0, hi=1.0: _fmt(*mean_ci(_col(c, name), lo, hi)[:3])  # noqa: E731
            steps = np.mean(_col(c, "steps_trained"))
            mono = np.mean(np.abs(_col(c, "ep_gradient")) >= 0.9)
            lines.append(
                f"| {p.name} | {cp} | {cq} | {len(c)} | {steps:.0f} | {ci('unseen_acc')} | "
                f"{ci('seen_acc')} | {ci('single_acc')} | {ci('labelset_acc')} | "
                f"{ci('unseen_ep')} | {ci('unseen_ep+bp')} | {ci('unseen_ep+pp+bp')} | "
                f"{ci('ep_slope_abs', None, None)} | {mono:.2f} |"
            )
    return lines


def factor_figure(factor: str, protocols, merged, cells, path: str) -> str:
    """Unseen-pair accuracy vs N_pair (left) and vs n_2 (right), one line per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p0, q0 = cells[0]
    ps = sorted({p for p, q in cells if q == q0})
    qs = sorted({q for p, q in cells if p == p0})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for prot in protocols:
        rows = merged.get(prot.name)
        if not rows:
            continue
        style = dict(ls="--", color="gray") if prot.name == BASELINE.name else {}
        for ax, xs, pick in (
            (axes[0], ps, lambda x: _cell(rows, x, q0)),
            (axes[1], qs, lambda x: _cell(rows, p0, x)),
        ):
            stats = [mean_ci(_col(pick(x), "unseen_acc")) for x in xs]
            m = np.asarray([s[0] for s in stats])
            lo = np.asarray([s[1] for s in stats])
            hi = np.asarray([s[2] for s in stats])
            err = np.stack(
                [m - np.where(np.isfinite(lo), lo, m), np.where(np.isfinite(hi), hi, m) - m]
            )
            ax.errorbar(xs, m, yerr=err, marker="o", capsize=3, label=prot.label, **style)
    axes[0].set_xlabel(f"N_pair (n_2 = {q0})")
    axes[1].set_xlabel(f"n_2, layouts per pair (N_pair = {p0})")
    axes[0].set_ylabel("unseen-pair accuracy (mean, 95% CI)")
    for ax in axes:
        ax.axhline(0.5, color="k", lw=0.5)
        ax.set_ylim(0.4, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"factor: {FACTOR_TITLES.get(factor, factor)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _total_s(out: str, name: str) -> float | None:
    """Seconds protocol `name` took to train and analyse (its protocol_time.json), None
    when it has no record; a ValueError naming the file when the record is broken."""
    path = os.path.join(out, name, "protocol_time.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return float(json.load(f)["total_s"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path} is not a protocol time record ({type(e).__name__}: {e}); delete it "
            "(the next run of the study writes it again)"
        ) from None


def excluded_section(protocols, merged) -> list[str]:
    """Markdown lines naming each diverged model per protocol (none: no section)."""
    lines = []
    for p in protocols:
        lines += [f"- {p.name}: {line}" for line in excluded_lines(merged.get(p.name, []))]
    if not lines:
        return []
    return ["", "## Excluded models", "", "Diverged; in no statistic, table or figure.", ""] + lines


def write_report(out: str, protocols, merged, cells, seeds: int, wall_s: float | None) -> str:
    """OUT/report.md: setup, per-factor figure and verdict, the full cell table."""
    figdir = plots.ensure_dir(os.path.join(out, "figures"))
    for rows in merged.values():
        for r in rows:
            r["ep_slope_abs"] = abs(r["ep_slope"])
    lines = [
        "# Protocol study: when does label diversity matter?",
        "",
        f"Cells (N_pair, n_2): {', '.join(map(str, cells))}; {seeds} seed(s) per cell; "
        "95% t-intervals over seeds (Welch for differences). `steps` = optimiser steps "
        "a model took (finite sets: epochs x set size / pair samples per batch).",
    ]
    times = {p.name: t for p in protocols if (t := _total_s(out, p.name)) is not None}
    if times:
        lines.append(
            f"Wall time to train and analyse these protocols: {sum(times.values()) / 60:.1f} "
            f"min in all ({', '.join(f'{n} {t:.0f} s' for n, t in times.items())})."
        )
    if wall_s is not None:
        lines.append(f"Wall time of the invocation that wrote this page: {wall_s / 60:.1f} min.")
    lines += ["", "## Verdicts", "", "| protocol | factor | verdict |", "|---|---|---|"]
    verdicts = {}
    for p in protocols:
        if p.name in merged:
            verdicts[p.name] = verdict(trend(merged[p.name], cells))
            lines.append(f"| {p.name} ({p.label}) | {p.factor} | {verdicts[p.name]} |")
    factors = list(dict.fromkeys(p.factor for p in protocols if p.factor != "baseline"))
    for f in factors:
        members = [BASELINE] + [p for p in protocols if p.factor == f]
        fig = factor_figure(f, members, merged, cells, os.path.join(figdir, f"factor_{f}.png"))
        lines += [
            "",
            f"## {f}: {FACTOR_TITLES.get(f, f)}",
            "",
            f"![{f}](figures/{os.path.basename(fig)})",
            "",
        ]
        for p in members:
            if p.name in verdicts:
                lines.append(f"- {p.label}: {verdicts[p.name]}")
    lines += ["", "## All cells", ""] + cell_table(protocols, merged, cells)
    lines += excluded_section(protocols, merged)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
