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


def training_curves(curves: list[dict], path: str, title: str = "") -> str:
    """Accuracies against step, one thin line per model, mean in bold."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), sharey=True)
    models = sorted({r["model"] for r in curves})
    for ax, (key, label) in zip(axes, ACC_LABELS.items()):
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


def accuracy_vs(rows: list[dict], field: str, path: str, title: str = "") -> str:
    """Final accuracies against a swept field: mean with min-max band and seeds as dots."""
    xs = sorted({r[field] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label in ACC_LABELS.items():
        means, lo, hi = [], [], []
        for x in xs:
            v = np.asarray([r[key] for r in rows if r[field] == x], float)
            v = v[np.isfinite(v)]
            means.append(v.mean() if len(v) else np.nan)
            lo.append(v.min() if len(v) else np.nan)
            hi.append(v.max() if len(v) else np.nan)
            ax.scatter([x] * len(v), v, s=8, alpha=0.4)
        line = ax.plot(xs, means, marker="o", label=label)[0]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
    ax.axhline(0.5, color="gray", ls=":", lw=1)
    ax.set_xlabel(field)
    ax.set_ylabel("final accuracy (mean, min-max over seeds)")
    ax.set_ylim(0.4, 1.02)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or f"accuracy vs {field}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ensure_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
