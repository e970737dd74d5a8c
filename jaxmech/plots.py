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
