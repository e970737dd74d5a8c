"""Paper 003's spatial IDs on a results folder of VLMs.

For every model: the IDs `Delta_y(cell)` at each LM site (`analysis.spatial_ids`; a
checkpoint's `--layers` only) from probe scenes of the training-pair labels at every
cell (the main set; beside it the validation labels' IDs; the other object at
PLACEMENTS random cells, or under `--protocol=authors` at every other cell once, as
the authors' `tile_two_objects.py`; one object size, where the authors draw 4), their
horizontal and vertical axes, the R^2 of a rank-k map from the ViT's position basis,
k = 1..RANKS, beside the same fit from one-hot row + column indicators (BASELINE) and
its split-half noise ceiling (how much of the ID two halves of the labels agree on),
and the cosine between the two label sets' IDs (is the ID the same for labels never
seen in a pair?). Each set is summarised over the generalising models, then the
others (`common.analyse`); one model (a checkpoint) has no interval over models, so
its fits are printed alone (ONE_FIT) and its analytic peak, a mean over probes, with
the per-probe bootstrap interval (`common.question_ci`).

Writes into `RUN/spatial_ids/` (every row also names its `examples`: seen for the
training-pair labels' IDs, unseen for the validation labels'; and its `model_group`):
  r2.csv        model, site, rank, r2, baseline_r2, ceiling
  axes.csv      model, site, h_norm, v_norm, cos_hv, cos_train_val (IDs of the two
                label sets, flattened over cells)
  analytic.csv  model, block, peak (the object word's attention mass on its own
                object's cell, mean over probes and heads), cos_pred_attn,
                cos_weighted_attn, cos_weighted_total, cos_attn_total
                (`spatial_ids.analytic_ids`: the ID predicted from the weights against
                the block's attention output's ID and against the whole block's)
  summary.json  means over models with 95% intervals; figure spatial_ids.png
"""

from __future__ import annotations

import jax
import numpy as np

from jaxmech.analysis import spatial_ids as si
from jaxmech.families.vlm_view import cell_tokens, model_outline, over_models
from jaxmech.reports.common import (
    EXAMPLES,
    LoadedRun,
    Report,
    compiled_call,
    declared,
    fmt_ci,
    fmt_question_ci,
    id_labels,
    probe_rows,
    protocol_of,
    question_ci,
    view_of,
)
from jaxmech.reports.tables import Measure
from jaxmech.stats import mean_ci

LABEL_WORDS = {
    "seen": "IDs of the training-pair labels",
    "unseen": "IDs of the validation labels (never seen in a pair)",
}

RANKS = (1, 2, 3, 4, 6)
PLACEMENTS = 4  # random cells of the other object per (label, cell), jaxmech's protocol
ONE_FIT = "no interval: one fit of one model (a checkpoint), not a mean over questions"
BASELINE = (
    "baseline: the same rank-k fit from one-hot row + one-hot column indicators "
    "(`additive_basis`). Qwen's 2D rotary gives rows and columns separate frequencies, "
    "so the cell-averaged position basis spans additive row + column functions only: "
    "an R^2 at the baseline's says the ID is additive, not how rotary codes position"
)


spatial_ids_refusal = declared(
    "spatial_ids"
)  # why the report does not apply to a run (None: it does)


def sites_of(run: LoadedRun) -> tuple[list[int], list[int]]:
    """(the LM sites the report studies: a checkpoint's `--layers` as the authors index
    them, else every one; the blocks of its analytic IDs, `spatial_ids.id_blocks`)."""
    n = view_of(run).n_lm_blocks(model_outline(run.params))
    layers = run.subject.layers
    return si.id_sites(n, layers), si.id_blocks(n, layers)


def analytic(a: dict) -> dict:
    """[Y] per LM block: the cosines of `spatial_ids.analytic_ids`'s IDs and the peak."""
    return {
        "peak": a["peak"].mean(-1),
        "cos_pred_attn": si.id_cosine(a["pred"], a["attn"]),
        "cos_weighted_attn": si.id_cosine(a["weighted"], a["attn"]),
        "cos_weighted_total": si.id_cosine(a["weighted"], a["total"]),
        "cos_attn_total": si.id_cosine(a["attn"], a["total"]),
    }


def compute(run: LoadedRun) -> dict:
    """Per model, from the probe scenes of the labels of `run.examples` ("seen": the
    training-pair labels, `common.id_labels`; "unseen": the others; a checkpoint's:
    every label; factorial under `--protocol=authors`, `spatial_ids.probe`) at the
    sites `sites_of(run)` (Y) and the blocks (B): r2 [K, Y, len(RANKS)] with its
    baseline from one-hot rows + columns (`additive_basis`) and its split-half noise
    ceiling [K, Y], h, v [K, Y, D], delta [K, Y, L, D], analytic {name: [K, B]}
    (`analytic`) and peak_probes [K, B, N] (each probe's attention mass); and
    cos_train_val [K, Y], the cosine of the two label sets' IDs (a checkpoint's: of
    its two halves of the labels). X's cell is read over all its image tokens
    (`cell_tokens`). The probe runs `batch` scenes at a time (a checkpoint's
    `common.probe_rows`; a run's all at once)."""
    view = view_of(run)
    factorial = protocol_of(run) == "authors"
    pr = si.probe(view, range(1, view.n_labels + 1), PLACEMENTS, factorial=factorial)
    label, cell, L = pr.label_N, pr.cell_N, view.grid.cells
    train = np.isin(label, id_labels(run))
    use = np.arange(len(label)) if run.examples is None else (
        np.flatnonzero(train if run.examples == "seen" else ~train))  # fmt: skip
    token = cell_tokens(pr.spans, cell)  # [N, T]: every token of X's cell
    batch = probe_rows(run) or len(label)
    zeros = np.zeros(len(label), np.int32)
    sites = sites_of(run)[0]
    additive = si.additive_basis(*view.grid)

    def one_model(p, inputs):  # the probes' inputs an argument, not a folded constant
        aux = si.chunked_probe(view, p, inputs, pr.spans.x_B, token, batch, sites)
        states = si.states_at(aux, view.n_lm_blocks(p), zeros, sites)
        d_train = si.spatial_ids(states[:, train], label[train], cell[train], L)
        d_val = si.spatial_ids(states[:, ~train], label[~train], cell[~train], L)
        delta = si.spatial_ids(states[:, use], label[use], cell[use], L)
        h, v = si.grid_axes(delta, *view.grid, authors=factorial)  # theirs: all-pairs axes
        own = jax.tree_util.tree_map(lambda x: x[use], aux)  # the set's probe rows
        ana = si.analytic_ids(p, own, zeros[use], zeros[use] + 1, label[use], cell[use], L,
                              sites)  # fmt: skip
        return {
            "delta": delta,
            "r2": si.rank_k_r2(si.cell_basis(view, p, pr.spans), delta, RANKS),
            "baseline": si.rank_k_r2(additive, delta, RANKS),
            "ceiling": si.split_half_ceiling(states[:, use], label[use], cell[use], L),
            "h": h,
            "v": v,
            "cos_train_val": si.id_cosine(d_train, d_val),
            "analytic": analytic(ana),
            "peak_probes": ana["peak_N"],
        }

    models = lambda ps, x: over_models(lambda p: one_model(p, x), ps)  # noqa: E731
    return compiled_call(
        models, (run.params, pr.inputs), f"spatial IDs ({len(label)} probe scenes)",
        estimate=run.subject.estimates_time,
    )  # fmt: skip


def _rows(res: dict, models, sites, blocks) -> tuple[list[dict], list[dict], list[dict]]:
    k = res["r2"].shape[0]
    r2 = [
        {
            "model": models[i],
            "site": y,
            "rank": r,
            "r2": float(res["r2"][i, j, m]),
            "baseline_r2": float(res["baseline"][i, j, m]),
            "ceiling": float(res["ceiling"][i, j]),
        }
        for i in range(k)
        for j, y in enumerate(sites)
        for m, r in enumerate(RANKS)
    ]
    h, v = res["h"], res["v"]
    cos_hv = (h * v).sum(-1) / (np.linalg.norm(h, axis=-1) * np.linalg.norm(v, axis=-1) + 1e-12)
    axes = [
        {
            "model": models[i],
            "site": y,
            "h_norm": float(np.linalg.norm(h[i, j])),
            "v_norm": float(np.linalg.norm(v[i, j])),
            "cos_hv": float(cos_hv[i, j]),
            "cos_train_val": float(res["cos_train_val"][i, j]),
        }
        for i in range(k)
        for j, y in enumerate(sites)
    ]
    a = res["analytic"]
    ana = [
        {"model": models[i], "block": b} | {key: float(val[i, j]) for key, val in a.items()}
        for i in range(k)
        for j, b in enumerate(blocks)
    ]
    return r2, axes, ana


def _cell(values, one: bool) -> str:
    """A printed cell: over models (`fmt_ci`), or a checkpoint's one value alone."""
    return f"{float(np.ravel(values)[0]):+.3f}" if one else fmt_ci(values, None, None)


def _stat(values, one: bool):
    """summary.json's entry: `mean_ci` over models, or a checkpoint's one value."""
    return float(np.ravel(values)[0]) if one else mean_ci(values, None, None)


def summarise_analytic(res: dict, blocks, one: bool, log) -> dict:
    a = res["analytic"]
    out = {}
    log(
        "\nthe analytic ID (W_O applied to the position part of the values of X's own "
        "object's cell) per LM block, "
        + ("peak: 95% per-probe bootstrap interval; the cosines: one value each (" + ONE_FIT
           + "):" if one else "95% CI over models:")
    )  # fmt: skip
    for j, b in enumerate(blocks):
        row = {key: _stat(val[:, j], one) for key, val in a.items()}
        cells = {key: _cell(val[:, j], one) for key, val in a.items()}
        if one:  # the peak is a mean over the probes: its interval is theirs
            row["peak"] = question_ci(res["peak_probes"][0, j], 0.0, 1.0)
            cells["peak"] = fmt_question_ci(res["peak_probes"][0, j], 0.0, 1.0)
        out[f"analytic/{b}"] = row
        log(f"{b:>5} " + "  ".join(f"{key} {c}" for key, c in cells.items()))
    return out


def summarise(res: dict, axes: list[dict], sites, one: bool, log) -> dict:
    out = {}
    log(
        "R^2 of a rank-k map from the ViT position basis to the spatial ID, its "
        f"baseline and its split-half noise ceiling ({ONE_FIT if one else '95% CI over models'}); "
        f"{BASELINE}:"
    )
    w = 8 if one else 30
    log(f"{'site':>5} {'':>8} " + " ".join(f"{t:>{w}}" for t in [f"rank {r}" for r in RANKS]))
    for j, y in enumerate(sites):
        fits = {"r2": res["r2"][:, j], "baseline": res["baseline"][:, j]}
        out[f"r2/{y}"] = {str(r): _stat(fits["r2"][:, m], one) for m, r in enumerate(RANKS)}
        out[f"r2/{y}"]["ceiling"] = _stat(res["ceiling"][:, j], one)
        out[f"baseline_r2/{y}"] = {
            str(r): _stat(fits["baseline"][:, m], one) for m, r in enumerate(RANKS)
        }
        for name, f in fits.items():
            cells = " ".join(f"{_cell(f[:, m], one):>{w}}" for m in range(len(RANKS)))
            log(f"{y if name == 'r2' else '':>5} {name:>8} {cells}")
        log(f"{'':>5} {'ceiling':>8} {_cell(res['ceiling'][:, j], one):>{w}}")
    log(
        "\naxes: |h|, |v| (ID change per column / row), cos(h, v), cos(ID of training-pair "
        "labels, ID of validation labels)" + (f" ({ONE_FIT})" if one else "") + ":"
    )
    for y in sites:
        col = {
            key: [a[key] for a in axes if a["site"] == y]
            for key in ("h_norm", "v_norm", "cos_hv", "cos_train_val")
        }
        out[f"axes/{y}"] = {key: _stat(v, one) for key, v in col.items()}
        log(f"{y:>5} " + "  ".join(f"{key} {_cell(v, one)}" for key, v in col.items()))
    return out


def plot(res: dict, path: str, grid_h: int, grid_w: int, sites) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    r2, n = res["r2"], len(sites)
    fig, axes = plt.subplots(1, 1 + n, figsize=(3.4 * (1 + n), 3))
    for j, y in enumerate(sites):
        line = axes[0].plot(RANKS, r2[:, j].mean(0), "o-", label=f"site {y}")[0]
        axes[0].plot(RANKS, res["baseline"][:, j].mean(0), ":", color=line.get_color())
    axes[0].set_xlabel("rank k")
    axes[0].set_ylabel("R^2 (mean over models)")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=7)
    axes[0].set_title("ID from the ViT position basis\n(dotted: one-hot row + column)",
                      fontsize=9)  # fmt: skip
    for j, y in enumerate(sites):
        h = res["h"][:, j]
        unit = h / (np.linalg.norm(h, axis=-1, keepdims=True) + 1e-12)
        coord = np.einsum("kld,kd->kl", res["delta"][:, j], unit).mean(0).reshape(grid_h, grid_w)
        im = axes[1 + j].imshow(coord, cmap="RdBu_r")
        axes[1 + j].set_title(f"site {y}: ID along its h axis", fontsize=9)
        fig.colorbar(im, ax=axes[1 + j], shrink=0.8)
    return plots.save(fig, path)


def plane_coords(delta_LxD, h_D, v_D) -> tuple[np.ndarray, float]:
    """([L, 2] each cell's ID on the plane of h and v, v made orthogonal to h first;
    the share of the IDs' variance over cells that plane holds), as Fig. 5 projects
    them. NaNs where h or v is zero (no axis to project on)."""
    d = np.asarray(delta_LxD, float)
    u = np.asarray(h_D, float)
    u = u / np.linalg.norm(u) if np.linalg.norm(u) > 0 else np.full_like(u, np.nan)
    w = np.asarray(v_D, float) - (np.asarray(v_D, float) @ u) * u
    w = w / np.linalg.norm(w) if np.linalg.norm(w) > 0 else np.full_like(w, np.nan)
    xy = np.stack([d @ u, d @ w], -1)
    total = d.var(0).sum()
    return xy, float(xy.var(0).sum() / total) if total > 0 else float("nan")


def plot_paper(res: dict, path: str, grid_h: int, grid_w: int, sites) -> str:
    """Fig. 5 as the paper draws it: per site, every cell's ID projected on the plane
    of its two axes (h, v), a grid of points joined along rows and columns, titled by
    the share of the IDs' variance the plane explains; a run's: the mean over models
    of each model's own projection."""
    from jaxmech import plots

    k = res["delta"].shape[0]
    panels = []
    for j, y in enumerate(sites):
        fits = [plane_coords(res["delta"][i, j], res["h"][i, j], res["v"][i, j]) for i in range(k)]
        xy = np.mean([f[0] for f in fits], 0)
        if not np.isfinite(xy).all():  # a model without an axis: nothing to draw
            panels.append((f"Layer {y}", None))
            continue
        explained = np.mean([f[1] for f in fits])
        panels.append((f"Layer {y}: Explained {explained:.2f}", xy))
    over = "one model" if k == 1 else f"mean over {k} models"
    fig = plots.id_grid_figure(panels, grid_h, grid_w, f"Spatial ID grid on its h, v axes "
                               f"({over}; colour: the cell's column, darker lower rows)")  # fmt: skip
    return plots.save(fig, path)


def _plot(res: dict, tables: dict, run: LoadedRun, path: str) -> list[str]:
    """The table figure (`plot`) and Fig. 5 beside it (`plot_paper`)."""
    grid, sites = view_of(run).grid, sites_of(run)[0]
    return [plot(res, path, *grid, sites),
            plot_paper(res, path.replace(".png", "_paper.png"), *grid, sites)]  # fmt: skip


def _tables(res: dict, run: LoadedRun) -> dict:
    r2_rows, axes_rows, analytic_rows = _rows(res, run.models, *sites_of(run))
    return {"r2": r2_rows, "axes": axes_rows, "analytic": analytic_rows}


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    sites, blocks = sites_of(run)
    one = run.k == 1  # one model (a checkpoint): no interval over models
    factorial = protocol_of(run) == "authors"
    probes = ("factorial: the other object at every other cell once (the authors' "
              "tile_two_objects.py), one object size (their 4 sizes are not reproduced)"
              if factorial else f"the other object at {PLACEMENTS} random cells")  # fmt: skip
    log(f"{run.k} models; sites {sites} (site y: the residual after y LM blocks); X's cell "
        f"read over all its image tokens; probes {probes}")  # fmt: skip
    return (
        summarise(res, tables["axes"], sites, one, log)
        | summarise_analytic(res, blocks, one, log)
        | {"excluded": list(run.excluded), "ranks": list(RANKS), "sites": sites}
        | {"probes": probes, "baseline": BASELINE}
        | ({"intervals": ONE_FIT + "; analytic peak: per-probe bootstrap"} if one else {})
    )


REPORT = Report(
    folder="spatial_ids",
    refusal=spatial_ids_refusal,
    compute=compute,
    tables=_tables,
    summarise=_summary,
    plot=_plot,
    figure="spatial_ids.png",
    examples=EXAMPLES,
    per_model=tuple("delta r2 baseline ceiling h v cos_train_val analytic peak_probes".split()),
    example_words=LABEL_WORDS,
    compare=(
        Measure("R^2 rank 2", "r2", "r2", (("rank", 2),), ("site",)),
        Measure("split-half ceiling", "r2", "ceiling", (("rank", 2),), ("site",)),
        Measure(
            "cos(training labels' ID, validation labels')", "axes", "cos_train_val", (), ("site",)
        ),
    ),
)
