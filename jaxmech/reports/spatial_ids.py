"""Seed 003's spatial IDs on a results folder of VLMs (issue 13, part 2).

For every model: the IDs `Delta_y(cell)` at each LM site (`analysis.spatial_ids`) from
probe scenes of the training-pair labels at every cell (the main set; beside it the
validation labels' IDs), their horizontal and vertical axes, the R^2 of a rank-k map
from the ViT's position basis, k = 1..RANKS, beside its split-half noise ceiling (how
much of the ID two halves of the labels agree on), and the cosine between the two label
sets' IDs (is the ID the same for labels never seen in a pair?). Each set is summarised
over the generalising models, then the others (`common.analyse`).

Writes into `RUN/spatial_ids/` (every row also names its `examples`: seen for the
training-pair labels' IDs, unseen for the validation labels'; and its `model_group`):
  r2.csv        model, site, rank, r2, ceiling
  axes.csv      model, site, h_norm, v_norm, cos_hv, cos_train_val (IDs of the two
                label sets, flattened over cells)
  analytic.csv  model, block, peak (the object word's mean attention to its own
                object's token, mean over heads), cos_pred_attn, cos_weighted_attn,
                cos_weighted_total, cos_attn_total (`spatial_ids.analytic_ids`: the ID
                predicted from the weights against the block's attention output's ID
                and against the whole block's)
  summary.json  means over models with 95% intervals; figure spatial_ids.png
"""

from __future__ import annotations

import jax
import numpy as np

from jaxmech.analysis import spatial_ids as si
from jaxmech.families.vlm_view import cell_tokens, over_models
from jaxmech.reports.common import (
    EXAMPLES,
    LoadedRun,
    Report,
    analyse,
    analyse_loaded,
    compiled_call,
    declared,
    fmt_ci,
    id_labels,
    plots_dir,
    probe_rows,
    view_of,
)
from jaxmech.stats import mean_ci

LABEL_WORDS = {
    "seen": "IDs of the training-pair labels",
    "unseen": "IDs of the validation labels (never seen in a pair)",
}

RANKS = (1, 2, 3, 4, 6)


spatial_ids_refusal = declared(
    "spatial_ids"
)  # why the report does not apply to a run (None: it does)


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
    every label): r2 [K, Y, len(RANKS)] with its split-half noise ceiling [K, Y], h, v
    [K, Y, D], delta [K, Y, L, D], analytic {name: [K, blocks]} (`analytic`); and
    cos_train_val [K, Y], the cosine of the two label sets' IDs (a checkpoint's: of
    its two halves of the labels). The probe runs `batch` scenes at a time (a
    checkpoint's `common.probe_rows`; a run's all at once)."""
    view = view_of(run)
    pr = si.probe(view, range(1, view.n_labels + 1))
    label, cell, L = pr.label_N, pr.cell_N, view.grid.cells
    train = np.isin(label, id_labels(run))
    use = np.arange(len(label)) if run.examples is None else (
        np.flatnonzero(train if run.examples == "seen" else ~train))  # fmt: skip
    token = cell_tokens(pr.spans, cell)
    batch = probe_rows(run) or len(label)
    zeros = np.zeros(len(label), np.int32)

    def one_model(p, inputs):  # the probes' inputs an argument, not a folded constant
        aux = si.chunked_probe(view, p, inputs, pr.spans.x_B, token, batch)
        states = si.states_at(aux, view.n_lm_blocks(p), zeros)
        d_train = si.spatial_ids(states[:, train], label[train], cell[train], L)
        d_val = si.spatial_ids(states[:, ~train], label[~train], cell[~train], L)
        delta = si.spatial_ids(states[:, use], label[use], cell[use], L)
        h, v = si.grid_axes(delta, *view.grid)
        own = jax.tree_util.tree_map(lambda x: x[use], aux)  # the set's probe rows
        ana = si.analytic_ids(p, own, zeros[use], zeros[use] + 1, label[use], cell[use], L)
        return {
            "delta": delta,
            "r2": si.rank_k_r2(si.cell_basis(view, p, pr.spans), delta, RANKS),
            "ceiling": si.split_half_ceiling(states[:, use], label[use], cell[use], L),
            "h": h,
            "v": v,
            "cos_train_val": si.id_cosine(d_train, d_val),
            "analytic": analytic(ana),
        }

    models = lambda ps, x: over_models(lambda p: one_model(p, x), ps)  # noqa: E731
    return compiled_call(
        models, (run.params, pr.inputs), f"spatial IDs ({len(label)} probe scenes)"
    )


def _rows(res: dict, models) -> tuple[list[dict], list[dict], list[dict]]:
    k, n_sites, _ = res["r2"].shape
    r2 = [
        {
            "model": models[i],
            "site": y,
            "rank": r,
            "r2": float(res["r2"][i, y, j]),
            "ceiling": float(res["ceiling"][i, y]),
        }
        for i in range(k)
        for y in range(n_sites)
        for j, r in enumerate(RANKS)
    ]
    h, v = res["h"], res["v"]
    cos_hv = (h * v).sum(-1) / (np.linalg.norm(h, axis=-1) * np.linalg.norm(v, axis=-1) + 1e-12)
    axes = [
        {
            "model": models[i],
            "site": y,
            "h_norm": float(np.linalg.norm(h[i, y])),
            "v_norm": float(np.linalg.norm(v[i, y])),
            "cos_hv": float(cos_hv[i, y]),
            "cos_train_val": float(res["cos_train_val"][i, y]),
        }
        for i in range(k)
        for y in range(n_sites)
    ]
    a = res["analytic"]
    ana = [
        {"model": models[i], "block": b} | {key: float(val[i, b]) for key, val in a.items()}
        for i in range(k)
        for b in range(a["peak"].shape[1])
    ]
    return r2, axes, ana


def summarise_analytic(res: dict, log) -> dict:
    a = res["analytic"]
    out = {}
    log(
        "\nthe analytic ID (W_O applied to the position part of the values of X's own "
        "object token) per LM block, 95% CI over models:"
    )
    for b in range(a["peak"].shape[1]):
        out[f"analytic/{b}"] = {key: mean_ci(val[:, b], None, None) for key, val in a.items()}
        log(
            f"{b:>5} "
            + "  ".join(f"{key} {fmt_ci(val[:, b], None, None)}" for key, val in a.items())
        )
    return out


def summarise(res: dict, axes: list[dict], log) -> dict:
    n_sites = res["r2"].shape[1]
    out = {}
    log(
        "R^2 of a rank-k map from the ViT position basis to the spatial ID, and its "
        "split-half noise ceiling (95% CI over models):"
    )
    log(f"{'site':>5} " + " ".join(f"{t:>30}" for t in [f"rank {r}" for r in RANKS] + ["ceiling"]))
    for y in range(n_sites):
        cells = [res["r2"][:, y, j] for j in range(len(RANKS))] + [res["ceiling"][:, y]]
        out[f"r2/{y}"] = {str(r): mean_ci(c, None, None) for r, c in zip(RANKS, cells)}
        out[f"r2/{y}"]["ceiling"] = mean_ci(cells[-1], None, None)
        log(f"{y:>5} " + " ".join(f"{fmt_ci(c, None, None):>30}" for c in cells))
    log(
        "\naxes: |h|, |v| (ID change per column / row), cos(h, v), cos(ID of training-pair labels, ID of validation labels):"
    )
    for y in range(n_sites):
        col = {
            key: [a[key] for a in axes if a["site"] == y]
            for key in ("h_norm", "v_norm", "cos_hv", "cos_train_val")
        }
        out[f"axes/{y}"] = {key: mean_ci(v, None, None) for key, v in col.items()}
        log(f"{y:>5} " + "  ".join(f"{key} {fmt_ci(v, None, None)}" for key, v in col.items()))
    return out


def plot(res: dict, path: str, grid_h: int, grid_w: int) -> str:
    import matplotlib.pyplot as plt

    from jaxmech import plots

    r2 = res["r2"]
    n_sites = r2.shape[1]
    fig, axes = plt.subplots(1, 1 + n_sites, figsize=(3.4 * (1 + n_sites), 3))
    for y in range(n_sites):
        m = r2[:, y].mean(0)
        axes[0].plot(RANKS, m, "o-", label=f"site {y}")
    axes[0].set_xlabel("rank k")
    axes[0].set_ylabel("R^2 (mean over models)")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=7)
    axes[0].set_title("ID from the ViT position basis", fontsize=9)
    for y in range(n_sites):
        h = res["h"][:, y]
        unit = h / (np.linalg.norm(h, axis=-1, keepdims=True) + 1e-12)
        coord = np.einsum("kld,kd->kl", res["delta"][:, y], unit).mean(0).reshape(grid_h, grid_w)
        im = axes[1 + y].imshow(coord, cmap="RdBu_r")
        axes[1 + y].set_title(f"site {y}: ID along its h axis", fontsize=9)
        fig.colorbar(im, ax=axes[1 + y], shrink=0.8)
    return plots.save(fig, path)


def _tables(res: dict, run: LoadedRun) -> dict:
    r2_rows, axes_rows, analytic_rows = _rows(res, run.models)
    return {"r2": r2_rows, "axes": axes_rows, "analytic": analytic_rows}


def _summary(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    log(f"{run.k} models; sites: resid_pre of each LM block, then the last block's output")
    return (
        summarise(res, tables["axes"], log)
        | summarise_analytic(res, log)
        | {"excluded": list(run.excluded), "ranks": list(RANKS)}
    )


REPORT = Report(
    folder="spatial_ids",
    refusal=spatial_ids_refusal,
    compute=compute,
    tables=_tables,
    summarise=_summary,
    plot=lambda res, tables, run, path: plot(res, path, *view_of(run).grid),
    figure="spatial_ids.png",
    examples=EXAMPLES,
    per_model=("delta", "r2", "ceiling", "h", "v", "cos_train_val", "analytic"),
    example_words=LABEL_WORDS,
)


def analyse_spatial_ids_run(path: str, log=print) -> dict:
    """The spatial-ID report of one results folder (`common.analyse`)."""
    return analyse(REPORT, path, log)


def analyse_spatial_ids_checkpoint(run: LoadedRun, out: str, log=print) -> dict:
    """The spatial-ID report of a checkpoint (`common.open_checkpoint`) into `out`."""
    return analyse_loaded(REPORT, run, plots_dir(out, REPORT.folder), log)
