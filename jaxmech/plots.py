"""Matplotlib figures from saved result rows (no model code; Agg backend)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ACC_LABELS = {
    "single_acc": "single-object positional",
    "seen_acc": "seen-pair configuration",
    "unseen_acc": "unseen-pair",
    "labelset_acc": "label-set (unseen pairs)",
}


def training_curves(
    curves: list[dict], path: str, title: str = "", metrics=tuple(ACC_LABELS)
) -> str:
    """Accuracies (`metrics`) against step, one thin line per model, mean in bold."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.6), sharey=True)
    axes = np.atleast_1d(axes)
    models = sorted({r["model"] for r in curves})
    for ax, key in zip(axes, metrics):
        label = ACC_LABELS.get(key, key)
        all_y = []
        for m in models:
            rs = [r for r in curves if r["model"] == m]
            steps = [r["step"] for r in rs]
            ys = [r[key] for r in rs]
            all_y.append(ys)
            ax.plot(steps, ys, color="tab:blue", alpha=0.3, lw=1)
        ax.plot(steps, np.nanmean(np.asarray(all_y, float), 0), color="k", lw=2, label="mean")
        ax.axhline(0.5, color="gray", ls=":", lw=1)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.set_ylim(0.4, 1.02)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle(title or f"training curves ({len(models)} models)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_vs(
    rows: list[dict], field: str, path: str, title: str = "", metrics=tuple(ACC_LABELS)
) -> str:
    """Final accuracies (`metrics`) against a swept field: mean with 95% CI over seeds,
    seeds as dots."""
    from jaxmech.stats import mean_ci

    xs = sorted({r[field] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for j, key in enumerate(metrics):
        label = ACC_LABELS.get(key, key)
        stats = [mean_ci([r[key] for r in rows if r[field] == x]) for x in xs]
        m = np.asarray([s[0] for s in stats])
        err = np.abs(np.asarray([[s[1], s[2]] for s in stats]).T - m)
        offset = (j - 1.5) * 0.012 * (max(xs) - min(xs) or 1)
        for x in xs:
            v = [r[key] for r in rows if r[field] == x]
            ax.scatter(np.full(len(v), x + offset), v, s=7, alpha=0.35, color=f"C{j}")
        ax.errorbar(
            np.asarray(xs) + offset,
            m,
            yerr=np.nan_to_num(err),
            marker="o",
            capsize=3,
            label=label,
            color=f"C{j}",
        )
    ax.axhline(0.5, color="gray", ls=":", lw=1)
    ax.set_xlabel(field)
    ax.set_ylabel("final accuracy (mean, 95% CI over seeds)")
    ax.set_ylim(0.4, 1.02)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or f"accuracy vs {field}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save(fig, path: str) -> str:
    """Lays out, writes (110 dpi) and closes `fig`; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ensure_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def term_heatmaps(terms: dict, path: str, title: str = "", labels=None) -> str:
    """One [S, S] heatmap per named term (rows: queries, columns: keys), shared colour scale."""
    names = list(terms)
    vmax = max(float(np.abs(np.asarray(terms[n])).max()) for n in names) or 1.0
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.4))
    for ax, n in zip(np.atleast_1d(axes), names):
        im = ax.imshow(np.asarray(terms[n]), cmap="RdBu_r", vmin=-vmax, vmax=vmax)
        ax.set_title(n)
        ax.set_xlabel("key")
        if labels is not None:
            ax.set_xticks(range(len(labels)), labels, fontsize=7)
            ax.set_yticks(range(len(labels)), labels, fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("query")
    fig.colorbar(im, ax=list(np.atleast_1d(axes)), shrink=0.8, label="logit contribution")
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def head_profiles(profiles: dict, path: str, title: str = "") -> str:
    """CLS-row terms over key positions, one panel per term, one line per head."""
    names = list(profiles)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), sharey=True)
    for ax, n in zip(np.atleast_1d(axes), names):
        prof = np.asarray(profiles[n])
        for h in range(prof.shape[0]):
            ax.plot(range(prof.shape[1]), prof[h], marker="o", ms=3, label=f"head {h}")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_title(f"CLS-row {n}")
        ax.set_xlabel("key pixel position")
    np.atleast_1d(axes)[0].set_ylabel("logit contribution")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ablation_bars(
    rows: list[dict],
    ablations: list[str],
    path: str,
    title: str = "",
    keys=("unseen_acc", "labelset_acc", "seen_acc", "single_acc"),
) -> str:
    """Mean accuracy per ablation (bars), seeds as dots, one bar per metric in `keys`."""
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(ablations) + 2), 4))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        for i, a in enumerate(ablations):
            v = np.asarray([r[key] for r in rows if r["ablation"] == a], float)
            x = i + (j - (len(keys) - 1) / 2) * width
            ax.bar(
                x,
                np.nanmean(v),
                width,
                color=f"C{j}",
                alpha=0.7,
                label=ACC_LABELS.get(key, key) if i == 0 else None,
            )
            ax.scatter(np.full(len(v), x), v, s=6, color="k", zorder=3)
    ax.axhline(0.5, color="gray", ls=":", lw=1)
    ax.set_xticks(range(len(ablations)), ablations, rotation=30)
    ax.set_ylim(0.3, 1.05)
    ax.set_ylabel("accuracy (mean; dots: models)")
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(title or "term ablations (all vision heads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def groups_strip(groups: dict, path: str, ylabel: str, title: str = "") -> str:
    """Values of several groups as strips with their means (e.g. EP gradient by outcome)."""
    fig, ax = plt.subplots(figsize=(1.8 * len(groups) + 2, 4))
    for i, vals in enumerate(groups.values()):
        v = np.asarray(vals, float)
        jitter = (np.random.default_rng(i).random(len(v)) - 0.5) * 0.3
        ax.scatter(i + jitter, v, s=12, alpha=0.7)
        if len(v):
            ax.hlines(np.mean(v), i - 0.3, i + 0.3, color="k", lw=2)
    ax.set_xticks(range(len(groups)), [f"{k}\n(n={len(v)})" for k, v in groups.items()])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def grid_heatmaps(grids, path: str, title: str = "", row_labels=None, panel_titles=None) -> str:
    """A grid of small heatmaps: grids [R, C, h, w] (e.g. models x heads x grid cells).

    Each panel has its own symmetric colour scale (`panel_titles[r][c]` may say the
    range); used for the CLS-row EP term over the keys of a 2D image, one panel per head.
    """
    g = np.asarray(grids)
    R, C = g.shape[:2]
    fig, axes = plt.subplots(R, C, figsize=(2.3 * C, 2.3 * R), squeeze=False)
    for r in range(R):
        for c in range(C):
            ax = axes[r, c]
            vmax = float(np.abs(g[r, c]).max()) or 1.0
            im = ax.imshow(g[r, c], cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            ax.set_xticks([])
            ax.set_yticks([])
            if panel_titles is not None:
                ax.set_title(panel_titles[r][c], fontsize=7)
            if c == 0 and row_labels is not None:
                ax.set_ylabel(row_labels[r], fontsize=8)
            fig.colorbar(im, ax=ax, shrink=0.7).ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- paper 003's figures as the paper draws them (`*_paper.png`, beside the tables) ---
# Each `*_figure` returns the open Figure (a test reads its axes back); `save` writes it.
# A cell is (mean, ci_low, ci_high, n); n = 0 is drawn as a labelled empty panel, never
# as a zero.


def empty_panel(ax, what: str = "") -> None:
    """Marks `ax` as holding nothing: "n = 0" (and what is missing) in its middle."""
    ax.text(0.5, 0.5, "n = 0" + (f"\n{what}" if what else ""), ha="center", va="center",
            transform=ax.transAxes, fontsize=10, color="gray")  # fmt: skip


def _grid(n: int, cols: int, size=(3.6, 3.2), **kw):
    """(fig, the first n of a rows x cols grid of axes), the rest hidden."""
    cols = max(1, min(cols, n))
    rows = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows),
                             squeeze=False, **kw)  # fmt: skip
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def shift_curves_figure(panels, layers, suptitle: str = ""):
    """Fig. 4: belief shift against layer, one curve per token group with its 95%
    interval as a band. `panels`: rows of (title, {curve label: [Y, 4] cells}); a
    panel whose every cell has n = 0 is drawn empty."""
    n_rows, n_cols = len(panels), max(len(r) for r in panels)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4.2 * n_cols, 3.4 * n_rows),
                             squeeze=False, sharey=True)  # fmt: skip
    x = np.asarray(layers)
    for r, row in enumerate(panels):
        for c, (title, curves) in enumerate(row):
            ax = axes[r, c]
            cells = {k: np.asarray(v, float).reshape(len(x), 4) for k, v in curves.items()}
            for j, (label, v) in enumerate(cells.items()):
                if (v[:, 3] == 0).all():
                    continue  # nothing counted: no curve, said by the panel's label
                m = np.where(v[:, 3] > 0, v[:, 0], np.nan)
                ax.plot(x, m, "-", color=f"C{j}", label=label)
                ax.fill_between(x, v[:, 1], v[:, 2], color=f"C{j}", alpha=0.25, lw=0)
            if all((v[:, 3] == 0).all() for v in cells.values()):
                empty_panel(ax, "no question counted")
            else:
                ax.legend(fontsize=7, loc="best")
            ax.axhline(0, color="gray", ls="--", alpha=0.5)
            if len(x):  # an empty panel spans the same layers as its neighbours
                ax.set_xlim(x.min() - 0.5, x.max() + 0.5)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("Layer")
            if c == 0:
                ax.set_ylabel("Belief Shift")
    fig.suptitle(suptitle, fontsize=10)
    return fig


KIND_WORDS = {"id": "spatial ID steering", "noise": "norm-matched noise",
              "orthogonal": "orthogonal to the ID span"}  # fmt: skip
KIND_COLOURS = {"id": "skyblue", "noise": "peachpuff", "orthogonal": "palegreen"}


def flip_bars_figure(bars: dict, title: str):
    """Fig. 2: horizontal bars of the flip rate (% belief swapped) per model, one bar
    per kind (ID steering, its norm-matched controls) with its 95% interval.
    `bars`: {model: {kind: cell}}; a model with nothing counted says "n = 0"."""
    models = list(bars)
    kinds = list(next(iter(bars.values()), {}))
    height = 0.8 / max(len(kinds), 1)
    fig, ax = plt.subplots(figsize=(8.5, 1.2 + 0.9 * max(len(models), 1)))
    for j, kind in enumerate(kinds):
        cells = np.asarray([bars[m][kind] for m in models], float).reshape(-1, 4)
        ok = cells[:, 3] > 0
        y = np.arange(len(models)) + j * height
        err = np.abs(cells[:, 1:3].T - cells[:, 0])
        ax.barh(y[ok], cells[ok, 0], height, color=KIND_COLOURS.get(kind, f"C{j}"),
                xerr=np.nan_to_num(err[:, ok]), capsize=2, label=KIND_WORDS.get(kind, kind))  # fmt: skip
    for i, m in enumerate(models):
        if all(bars[m][k][3] == 0 for k in kinds):
            ax.text(0.02, i + 0.4 - height / 2, "n = 0: no question counted", va="center",
                    color="gray")  # fmt: skip
    ax.set_yticks(np.arange(len(models)) + 0.4 - height / 2, models)
    ax.set_xlim(0, 1)
    ax.set_xticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0], ["0", "20", "40", "60", "80", "100"])
    ax.set_xlabel("% belief swapped (95% CI)")
    if not models:
        empty_panel(ax, "no model")
    elif any(bars[m][k][3] > 0 for m in models for k in kinds):
        ax.legend(fontsize=8, loc="best")
    ax.set_title(title, fontsize=10)
    return fig


def _cell_colours(grid_h: int, grid_w: int) -> np.ndarray:
    """[H * W, 4] a colour per cell: its column's hue, darker down the rows (the
    paper's bivariate map: which column, how far down)."""
    hue = plt.get_cmap("tab10")(np.arange(grid_w) % 10)[:, :3]
    shade = np.linspace(0.35, 1.0, grid_h)[::-1]  # the top row lightest
    rgb = 1 - (1 - hue[None]) * shade[:, None, None]
    return np.concatenate([rgb, np.ones((grid_h, grid_w, 1))], -1).reshape(-1, 4)


def id_grid_figure(panels, grid_h: int, grid_w: int, suptitle: str = ""):
    """Fig. 5: each cell's ID projected on the two leading axes (h, v), drawn as a grid
    of points joined along rows (solid) and columns (dotted), image orientation (v
    down, the h axis on top). `panels`: (title, [H * W, 2] coordinates or None: n = 0)."""
    fig, axes = _grid(len(panels) or 1, 4, (3.8, 3.8))
    colours = _cell_colours(grid_h, grid_w)
    for ax, (title, xy) in zip(axes, panels or [("", None)]):
        ax.set_xlabel("ID along h (column axis)")
        ax.set_ylabel("ID along v (row axis)")
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
        ax.set_title(title, fontsize=9, y=-0.16)
        if xy is None or not np.isfinite(xy).any():
            empty_panel(ax, "no ID")
            continue
        g = np.asarray(xy, float).reshape(grid_h, grid_w, 2)
        for row in g:
            ax.plot(row[:, 0], row[:, 1], "-", color="gray", lw=0.8)
        for col in g.transpose(1, 0, 2):
            ax.plot(col[:, 0], col[:, 1], ":", color="gray", lw=0.8)
        ax.scatter(g[..., 0].ravel(), g[..., 1].ravel(), c=colours, s=90, zorder=3,
                   edgecolors="k", linewidths=0.4)  # fmt: skip
        ax.invert_yaxis()
    fig.suptitle(suptitle, fontsize=10)
    return fig


def deviation_histograms_figure(panels, suptitle: str = ""):
    """Fig. 8A: densities of the ID deviation (the margin relative to the ground
    truth) of right vs wrong answers, one panel per layer. `panels`: (title, right
    values, wrong values); a side with no value says n = 0 in its legend, a panel
    with neither is drawn empty."""
    fig, axes = _grid(len(panels) or 1, 4, (3.6, 3.2))
    for ax, (title, right, wrong) in zip(axes, panels or [("", [], [])]):
        sides = [("right", right, "steelblue"), ("wrong", wrong, "salmon")]
        sides = [(w, np.asarray(v, float)[np.isfinite(v)], c) for w, v, c in sides]
        both = np.concatenate([v for _, v, _ in sides])
        ax.set_xlabel("Margin Relative to GT (ID deviation, cells)")
        ax.set_ylabel("Density")
        ax.set_title(title, fontsize=9)
        if not len(both):
            empty_panel(ax, "no answer")
            continue
        bins = np.histogram_bin_edges(both, bins=10)
        for word, v, colour in sides:
            label = f"{word} answers (n = {len(v)})"
            if len(v):
                ax.hist(v, bins, density=True, alpha=0.7, color=colour, label=label)
            else:  # a legend entry only: the side is empty, not zero
                ax.plot([], [], "s", color=colour, label=label)
        ax.axvline(0, color="k", lw=0.5)
        ax.legend(fontsize=7)
    fig.suptitle(suptitle, fontsize=10)
    return fig


def accuracy_vs_steerability_figure(names, accuracy, steerability, note: str = ""):
    """Fig. 9: one point per model, its steerability (ID flip rate) on x and its
    accuracy on y (the paper's orientation), each with its 95% interval; `note`: the
    correlation across models, written under the title. `accuracy`, `steerability`:
    [M, 4] cells; a model with n = 0 on either is left out and named so."""
    acc, steer = (np.asarray(v, float).reshape(-1, 4) for v in (accuracy, steerability))
    fig, ax = plt.subplots(figsize=(5.6, 5.2))
    colours = plt.get_cmap("rainbow")(np.linspace(0, 1, max(len(names), 1)))
    missing = []
    for i, name in enumerate(names):
        if acc[i, 3] == 0 or steer[i, 3] == 0:
            missing.append(name)
            continue
        err = lambda c: np.nan_to_num(np.abs(c[1:3] - c[0]))[:, None]  # noqa: E731
        ax.errorbar(steer[i, 0], acc[i, 0], xerr=err(steer[i]), yerr=err(acc[i]), fmt="o",
                    ms=8, capsize=3, color=colours[i], label=name)  # fmt: skip
    if len(missing) == len(names):
        empty_panel(ax, "no model with both numbers")
    else:
        ax.legend(fontsize=8)
    if missing and len(missing) < len(names):
        ax.text(0.02, 0.02, "n = 0, not drawn: " + ", ".join(missing), fontsize=7,
                transform=ax.transAxes, color="gray")  # fmt: skip
    ax.set_xlabel("Steerability: ID flip rate (95% CI)")
    ax.set_ylabel("Accuracy on the steered questions (95% CI)")
    ax.set_title("Accuracy vs. Steerability" + (f"\n{note}" if note else ""), fontsize=9)
    ax.grid(True)
    return fig


def target_curves_figure(rows, ticks, suptitle: str = ""):
    """Figs. 6B and 7: each word's change of log p against the ID steered onto the
    subject (x: the target cells `ticks`, as the authors key them), a curve per word
    with its 95% band, the norm-matched noise control dashed. `rows`: rows of panels
    (title, {curve: [T, 4] cells}, {control: [T, 4] cells}); a panel with nothing
    counted is drawn empty."""
    n_rows, n_cols = len(rows), max((len(r) for r in rows), default=1)
    fig, axes = plt.subplots(max(n_rows, 1), n_cols, figsize=(3.6 * n_cols, 3.0 * max(n_rows, 1)),
                             squeeze=False)  # fmt: skip
    x = np.arange(len(ticks))
    for r, row in enumerate(rows):
        for c, (title, curves, controls) in enumerate(row):
            ax, drawn = axes[r, c], False
            for j, (label, v) in enumerate(curves.items()):
                v = np.asarray(v, float).reshape(len(x), 4)
                if (v[:, 3] == 0).all():
                    continue
                ax.plot(x, np.where(v[:, 3] > 0, v[:, 0], np.nan), "-", color=f"C{j}", label=label)
                ax.fill_between(x, v[:, 1], v[:, 2], color=f"C{j}", alpha=0.25, lw=0)
                drawn = True
            for j, (label, v) in enumerate(controls.items()):
                v = np.asarray(v, float).reshape(len(x), 4)
                ax.plot(x, np.where(v[:, 3] > 0, v[:, 0], np.nan), "--", color=f"C{j}",
                        alpha=0.6, lw=1, label=label)  # fmt: skip
            if not drawn:
                empty_panel(ax, "no question counted")
            else:
                ax.legend(fontsize=6, loc="best")
            ax.axhline(0, color="gray", lw=0.5)
            ax.set_xticks(x, ticks)
            ax.set_xlabel("Intervention ID on subject")
            ax.set_ylabel("Change in Log Prob (steered - unsteered)", fontsize=8)
            ax.set_title(title, fontsize=9)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return fig


def target_share_figure(grids: dict, suptitle: str = ""):
    """Per target cell, laid out as the image, the share of answers on the target's side
    (0..1, written in each cell; blank: not a target). `grids`: {title: [H, W]}."""
    fig, axes = _grid(max(len(grids), 1), 4, size=(3.0, 2.8))
    for ax, (title, g) in zip(axes, grids.items()):
        g = np.asarray(g, float)
        im = ax.imshow(g, cmap="viridis", vmin=0, vmax=1)
        for (i, j), v in np.ndenumerate(g):
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(title, fontsize=8)
        fig.colorbar(im, ax=ax, shrink=0.7).ax.tick_params(labelsize=6)
    if not grids:
        empty_panel(axes[0], "no layer")
    fig.suptitle(suptitle, fontsize=9)
    return fig


def layer_logp_figure(curves: dict, layers, suptitle: str = ""):
    """Fig. 6A: log likelihood of each answer word against the layer steered.
    `curves`: {label: ([Y, 4] cells (mean, ci_low, ci_high, n), colour, line style)},
    each drawn with its 95% interval as a band."""
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    x = np.arange(len(layers))
    for label, (cells, colour, style) in curves.items():
        v = np.asarray(cells, float).reshape(len(x), 4)
        m = np.where(v[:, 3] > 0, v[:, 0], np.nan)
        ax.plot(x, m, style, marker="o", ms=3, color=colour, label=label)
        ax.fill_between(x, v[:, 1], v[:, 2], color=colour, alpha=0.15, lw=0)
    ax.set_xticks(x, [str(y) for y in layers])
    ax.set_xlabel("layer of intervention")
    ax.set_ylabel("log likelihood")
    ax.grid(alpha=0.4)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    return fig


def _band(ax, x, cells, label, colour):
    """One curve of (mean, lo, hi, n) cells with its 95% interval as a band."""
    v = np.asarray(cells, float).reshape(len(x), 4)
    ax.plot(x, np.where(v[:, 3] > 0, v[:, 0], np.nan), "o-", ms=3, color=colour, label=label)
    ax.fill_between(x, v[:, 1], v[:, 2], color=colour, alpha=0.3, lw=0)


def temporal_fig10(swap: dict, layers, groups, pca: dict, steer_rows, layer: int, n_frames: int):
    """Fig. 10 as `fig10.ipynb` draws it. A: belief shift against layer per token group
    (`swap`: {(layer, group, word): cell row}), a panel per read word, y in [-1, 2];
    B: the frames' IDs on the first principal component (rainbow) with "before" (B)
    and "after" (A) (`pca`: `analysis.temporal_ids.pca_line`); C: change of log p of
    'after' / 'before' against the ID steered onto the subject, a panel per original
    answer (`steer_rows`: the steering table at block `layer`). Bands: 95% intervals
    over the questions (the notebook's: +- 1 sd)."""
    fig = plt.figure(figsize=(10.5, 9.5))
    gs = fig.add_gridspec(3, 2, height_ratios=[4, 1.5, 3])
    x = np.asarray(layers)
    for c, word in enumerate(("before", "after")):
        ax = fig.add_subplot(gs[0, c])
        for j, g in enumerate(groups):
            row = lambda L: swap[(L, g, word)]  # noqa: E731
            _band(ax, x, [[row(L)[k] for k in ("mean", "lo", "hi", "n")] for L in x], g, f"C{j}")
        ax.set_ylim(-1, 2)
        ax.axhline(0, color="gray", ls="--", alpha=0.5)
        ax.set(xlabel="Layer", ylabel="Belief Shift", title=f"A: time-reversed twin, read '{word}'")
        ax.legend(fontsize=7)
    ax = fig.add_subplot(gs[1, :])
    colours = plt.get_cmap("rainbow")(np.linspace(0, 1, len(pca["frames"])))
    for f, (v, colour) in enumerate(zip(pca["frames"], colours)):
        ax.scatter(v, 0, color=colour, s=80, label=f"Frame {f + 1}")
    for mark, v, size in zip(("$B$", "$A$"), pca["marks"], (120, 150)):
        ax.scatter(v, 0, color="black", marker=mark, s=size)
    ax.set_yticks([])
    ax.set_xlabel("First Principal Component")
    ax.grid(True, axis="x", linestyle="--", alpha=0.5)
    title = f"B: 1D PCA of Average Embeddings\nVar explained: {pca['explained']:.2f}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, ncol=len(colours), loc="upper center", bbox_to_anchor=(0.5, -0.45))
    ids = np.arange(n_frames)
    for c, side in enumerate(("before", "after")):
        ax = fig.add_subplot(gs[2, c])
        for j, word in enumerate(("after", "before")):
            cells = {r["frame"]: r for r in steer_rows
                     if r["layer"] == layer and r["original"] == side and r["word"] == word}  # fmt: skip
            _band(ax, ids, [[cells[f][k] for k in ("mean", "lo", "hi", "n")] for f in ids],
                  f"ΔP('{word}')", f"C{j}")  # fmt: skip
        ax.set_xticks(ids, [str(f + 1) for f in ids])
        ax.set(xlabel="Intervention ID on subject", ylabel="Change in Log Prob",
               title=f"C: Layer {layer} — Original: {side}")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def temporal_swap_table(swap: dict, layers, groups, words):
    """The mirror swap's table as heatmaps: mean belief shift per token group x layer,
    a panel per read word, each cell's value written in it."""
    fig, axes = plt.subplots(1, len(words), figsize=(1.2 + 0.55 * len(layers) * len(words), 2.6),
                             squeeze=False)  # fmt: skip
    for ax, word in zip(axes[0], words):
        m = np.array([[swap[(L, g, word)]["mean"] for L in layers] for g in groups], float)
        ax.imshow(m, cmap="coolwarm", vmin=-1, vmax=1, aspect="auto")
        for (i, j), v in np.ndenumerate(m):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(layers)), [str(L) for L in layers], fontsize=7)
        ax.set_yticks(range(len(groups)), list(groups), fontsize=7)
        ax.set(xlabel="Layer", title=f"mirror swap, read '{word}'")
    fig.tight_layout()
    return fig
