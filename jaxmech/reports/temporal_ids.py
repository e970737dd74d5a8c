"""Paper 003's temporal IDs on toy video VLMs.

The video task (`data.tasks.video`) is the scenes grid read as time (row = frame), so the
spatial-ID tools run unchanged: the object word's ID `Delta_y(cell)` from probe scenes
(`analysis.spatial_ids`), and steering with it (`analysis.steering.steer_models`: X's word
moved by `alpha (Delta(target) - Delta(source))` to the frame at the far end beyond Y,
in X's column, against norm-matched noise and an ID-orthogonal direction). The
temporal ID is the frame part of `Delta`: its mean over each frame's cells
(`temporal_ids`). Per LM site y it reports

* time share: the part of the ID's energy that the frame means hold (1: the ID says
  only when, 0: only where in the frame);
* linearity: R^2 of the frame means against a line in the frame index (the paper's
  "early / late frames linearly separable": a linear ID gives 1);
* steering: flip rates of before/after answers (answers right before steering) per
  alpha, ID against the controls; and the belief logit(after) - logit(before) with X's
  ID moved to each frame (alpha 1).

Writes into `RUN/temporal_ids/`: ids.csv (model, site, time_share, linear_r2,
frame_means projected on the time axis), flips.csv (model, site, kind, alpha,
flip_rate, n_right, rel_norm), curves.csv (model, site, frame, belief), summary.json,
temporal_ids.png.

`--protocol=authors` on a checkpoint opened as videos: Fig. 10A-C as the authors'
`temporal_models/` scripts do them (`reports.temporal_authors`, whose docstring lists
what differs from their scripts and why); writes mirror_swap.csv, steering.csv,
pca.csv, summary.json, temporal_ids.png and temporal_ids_paper.png.
"""

from __future__ import annotations

import numpy as np

from jaxmech import plots
from jaxmech.analysis import steering as st
from jaxmech.analysis import temporal_ids as tid
from jaxmech.data.spec import RELATIONS
from jaxmech.data.tasks.video import TIME
from jaxmech.reports import temporal_authors as ta
from jaxmech.reports.common import (
    LoadedRun,
    Report,
    declared,
    fmt_ci,
    needs_depth,
    probe_rows,
    protocol_of,
    steered_sites,
    steering_examples,
    view_of,
)
from jaxmech.stats import mean_ci

FOLDER = "temporal_ids"


def temporal_refusal(config, path: str) -> str | None:
    """Why the report does not apply (None: it does): a VLM asked about time, with an
    LM site to steer."""
    return declared(FOLDER)(config, path) or needs_depth(config, path)


def compute(run: LoadedRun) -> dict:
    """Per model: the steering results (`analysis.steering.steer_models`, the IDs of
    every label; a checkpoint's at its `--layers` from 1 on, probe scenes sized by
    memory) and the statistics of its IDs at every site."""
    ex, source, target = steering_examples(run)
    view = view_of(run)
    res = st.steer_models(view, run.params, ex, source, target, sites=steered_sites(run),
                          probe_batch=probe_rows(run))  # fmt: skip
    stats = [tid.id_stats(d, view.grid.h) for d in res["delta"]]
    return {"ids": {k: np.stack([s[k] for s in stats]) for k in stats[0]}, **res}


def flips(res: dict) -> dict:
    """{kind: [K, Y', A]} flip rates of time questions, "n" [K, Y'], "rel_norm"."""
    fr = st.flip_rates(res)
    name = RELATIONS[TIME]
    return {k: fr[(k, name)] for k in (*st.KINDS, "n", "rel_norm")}


def frame_beliefs(res: dict, n_frames: int) -> np.ndarray:
    """[K, Y', T] mean logit(after) - logit(before) with X's ID moved to each frame."""
    c = res["curves"]  # [K, Y', L, B, 4]: left, right, above (before), below (after)
    belief = (c[..., 2 * TIME + 1] - c[..., 2 * TIME]).mean(-1)  # [K, Y', L]
    return belief.reshape(belief.shape[:2] + (n_frames, -1)).mean(-1)


def rows(res: dict, fr: dict, beliefs: np.ndarray, models) -> tuple[list, list, list]:
    ids = res["ids"]
    k, n_sites = ids["time_share"].shape
    id_rows = [
        {"model": models[i], "site": y, "time_share": float(ids["time_share"][i, y]),
         "linear_r2": float(ids["linear_r2"][i, y]),
         **{f"frame_{f}": float(v) for f, v in enumerate(ids["on_axis"][i, y])}}
        for i in range(k) for y in range(n_sites)
    ]  # fmt: skip
    flip_rows = [
        {"model": models[i], "site": y + 1, "kind": kind, "alpha": a,
         "flip_rate": float(fr[kind][i, y, j]), "n_right": int(fr["n"][i, y]),
         "rel_norm": float(fr["rel_norm"][i, y, j])}
        for i in range(k) for y in range(fr["n"].shape[1]) for kind in st.KINDS
        for j, a in enumerate(st.ALPHAS)
    ]  # fmt: skip
    curve_rows = [
        {"model": models[i], "site": y + 1, "frame": f, "belief": float(beliefs[i, y, f])}
        for i in range(k) for y in range(beliefs.shape[1]) for f in range(beliefs.shape[2])
    ]  # fmt: skip
    return id_rows, flip_rows, curve_rows


def summarise(res: dict, fr: dict, beliefs: np.ndarray, log) -> dict:
    out = {}
    ids = res["ids"]
    log("temporal IDs per LM site (95% CI over models):")
    for y in range(ids["time_share"].shape[1]):
        share, r2 = ids["time_share"][:, y], ids["linear_r2"][:, y]
        if np.isnan(share).all():
            log(f"  site {y}: no ID (the word has seen no image yet)")
            continue
        out[f"site{y}/time_share"], out[f"site{y}/linear_r2"] = mean_ci(share), mean_ci(r2)
        log(f"  site {y}: time share {fmt_ci(share, 0, 1)}  linear R^2 {fmt_ci(r2, None, 1)}")
    for y in range(fr["n"].shape[1]):
        site = f"resid_pre.{y + 1}"
        log(f"steering X's word at {site}: before/after flip rate (answers right before)")
        for j, alpha in enumerate(st.ALPHAS):
            cells = {kind: fr[kind][:, y, j] for kind in st.KINDS}
            out[f"{site}/{alpha}"] = {kind: mean_ci(v) for kind, v in cells.items()}
            norm = float(np.mean(fr["rel_norm"][:, y, j]))
            log(f"  alpha {alpha:>4} |added|/|x| {norm:.2f}  "
                + "  ".join(f"{kind} {fmt_ci(v, 0, 1)}" for kind, v in cells.items()))  # fmt: skip
        gap = beliefs[:, y, -1] - beliefs[:, y, 0]
        out[f"{site}/curve_last_minus_first"] = mean_ci(gap, None, None)
        log(f"  ID moved to the last frame minus the first: logit(after) - logit(before) "
            f"{fmt_ci(gap, None, None)}")  # fmt: skip
    return out


def plot(res: dict, fr: dict, beliefs: np.ndarray, path: str) -> str:
    import matplotlib.pyplot as plt

    y = fr["n"].shape[1] - 1  # the last steered site
    on_axis = res["ids"]["on_axis"][:, y + 1]  # that site's ID, [K, T]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.3))
    frames = np.arange(on_axis.shape[1])
    for row in on_axis:
        axes[0].plot(frames, row, color="C0", alpha=0.3)
    axes[0].plot(frames, on_axis.mean(0), "o-", color="C0")
    axes[0].set_title(f"temporal ID on its time axis (resid_pre.{y + 1})", fontsize=9)
    axes[0].set_xlabel("frame")
    for kind, colour in zip(st.KINDS, ("C3", "C0", "C2")):
        v = fr[kind][:, y]
        band = np.array([mean_ci(v[:, a])[1:3] for a in range(v.shape[1])])
        axes[1].plot(st.ALPHAS, v.mean(0), color=colour, label=kind)
        axes[1].fill_between(st.ALPHAS, band[:, 0], band[:, 1], color=colour, alpha=0.15)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("alpha")
    axes[1].set_ylabel("before/after flip rate")
    axes[1].legend(fontsize=7)
    axes[1].set_title("steering X's temporal ID to the far end", fontsize=9)
    b = beliefs[:, y]
    axes[2].plot(frames, b.T, color="C1", alpha=0.3)
    axes[2].plot(frames, b.mean(0), "o-", color="C1")
    axes[2].set_xlabel("frame X's ID is moved to")
    axes[2].set_title("logit(after) - logit(before)", fontsize=9)
    return plots.save(fig, path)


def _compute(run: LoadedRun) -> dict:
    if protocol_of(run) == "authors":
        return ta.compute(run)
    res = compute(run)
    return res | {"flip_rates": flips(res), "beliefs": frame_beliefs(res, view_of(run).grid.h)}


def _tables(res: dict, run: LoadedRun) -> dict:
    if res.get("protocol") == "authors":
        return ta.tables(res)
    id_rows, flip_rows, curve_rows = rows(res, res["flip_rates"], res["beliefs"], run.models)
    return {"ids": id_rows, "flips": flip_rows, "curves": curve_rows}


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    if res.get("protocol") == "authors":
        return ta.summarise(res, tables, log)
    which = run.subject.questions_word
    log(f"{run.k} models; {which} before/after questions")
    summary = summarise(res, res["flip_rates"], res["beliefs"], log)
    return summary | {"excluded": list(run.excluded)}


def check_video(run: LoadedRun, log=print) -> None:
    """Refuses a subject whose questions are not videos (a checkpoint must be opened
    with `video=True`) and, under the authors' protocol, a view or layers their
    experiments cannot run on (`temporal_authors.setup`), before any compute."""
    if not run.subject.video(run):
        raise ValueError("temporal IDs: expected a checkpoint opened as videos (video=True)")
    if protocol_of(run) == "authors":
        ta.setup(run)


REPORT = Report(
    folder=FOLDER,
    refusal=temporal_refusal,
    compute=_compute,
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: (
        ta.plot(res, tables, path)
        if res.get("protocol") == "authors"
        else plot(res, res["flip_rates"], res["beliefs"], path)
    ),
    figure="temporal_ids.png",
    check=check_video,
    video=True,
)
