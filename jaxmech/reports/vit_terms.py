"""Paper 000's App. O on the toy VLM: the first ViT block's logit terms and their ablation.

Writes into `RUN/vit_terms/`:
  gradients.csv  model, term, head, h, v, h_abs, v_abs: the term's slope along the key
                 column (h) / row (v), signed and absolute means over object queries of
                 the unseen-pair images (`analysis.vit_terms.term_gradients`)
  ablations.csv  model, ablation, unseen_h_acc, unseen_v_acc, seen_h_acc, seen_v_acc:
                 accuracy with the named terms removed from every head's logits
  summary.json   per-term gradient means and per-ablation means over models, with 95%
                 intervals; figures gradients.png, ablations.png

Diverged models are left out and named (`reports.common.open_run`).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech import plots
from jaxmech.analysis.vit_terms import term_gradients
from jaxmech.data.tasks.scenes import RELATIONS, eval_masks
from jaxmech.families.toy_vlm.evaluate import masked_mean
from jaxmech.families.toy_vlm.loss import beliefs, logits
from jaxmech.models.edits import VIT_TERMS, Edits, term_mask
from jaxmech.reports.common import (
    LoadedRun,
    Report,
    ablation_rows,
    declared,
    fmt_ci,
)
from jaxmech.stats import mean_ci

# Removed together: the EP analogues (a content query reading a position key), each
# position key, and every term that involves a position code at all.
ABLATIONS = {
    "none": (),
    "CK": ("CK",),
    "CR": ("CR",),
    "KK": ("KK",),
    "RR": ("RR",),
    "KC+RC": ("KC", "RC"),
    "CC": ("CC",),
    "col keys": tuple(a + "K" for a in "CRKB"),
    "row keys": tuple(a + "R" for a in "CRKB"),
    "all position": tuple(t for t in VIT_TERMS if "R" in t or "K" in t),
}
ABL_METRICS = tuple(f"{s}_{r}_acc" for s in ("unseen", "seen") for r in RELATIONS)
SETS = {"unseen": "unseen_pair", "seen": "seen_pair"}


def vit_terms_refusal(config, path: str) -> str | None:
    """Why this report does not apply to a run (None when it does)."""
    why = declared("vit_terms")(config, path)
    if why:
        return why
    if config.model.vit_pos == "rope2d":
        return f"{path}: vit_pos = 'rope2d' has no additive row / column codes to split"
    return None


def ablation_table(params, settings, evals, masks_AxHxT) -> dict:
    """{metric: [K, A]} accuracies (`ABL_METRICS`) of K models under A term masks: one
    compiled call (vmap over models, lax.map over masks)."""

    def one_model(p, s):
        masks = eval_masks(evals, s)

        def one_mask(keep_HxT):
            out = {}
            for short, name in SETS.items():
                batch = getattr(evals, name).examples
                edits = Edits(term_keep={"vit": keep_HxT})
                correct = beliefs(logits(p, batch, edits), jnp.asarray(batch.answer_B))["correct"]
                for r, rel in enumerate(RELATIONS):
                    w = (masks[name] & (jnp.asarray(batch.relation_B) == r)).astype(jnp.float32)
                    out[f"{short}_{rel}_acc"] = masked_mean(correct, w)
            return out

        return jax.lax.map(one_mask, masks_AxHxT)

    return jax.jit(jax.vmap(one_model))(params, settings)


def compute(run: LoadedRun) -> dict:
    """The report's numbers: gradients {h, v, h_abs, v_abs: [K, 16, H]}, ablation table."""
    ex = run.data.evals.unseen_pair.examples
    grads = jax.lax.map(
        jax.jit(lambda p: term_gradients(p, ex.labels_BxL, ex.colours_BxL, ex.facings_BxL)),
        run.params,
    )
    n_heads = run.config.model.n_heads
    masks = jnp.stack([term_mask(n_heads, list(r), terms=VIT_TERMS) for r in ABLATIONS.values()])
    t0 = time.perf_counter()
    table = jax.block_until_ready(ablation_table(run.params, run.settings, run.data.evals, masks))
    return {
        "gradients": jax.device_get(grads),
        "table": jax.device_get(table),
        "wall_s": time.perf_counter() - t0,
    }


def gradient_rows(grads: dict, models) -> list[dict]:
    k, n_terms, n_heads = grads["h"].shape
    return [
        {"model": models[i], "term": VIT_TERMS[t], "head": h}
        | {key: float(grads[key][i, t, h]) for key in ("h", "v", "h_abs", "v_abs")}
        for i in range(k)
        for t in range(n_terms)
        for h in range(n_heads)
    ]


def _strength(grads: dict, axis: str) -> np.ndarray:
    """[K, 16] a term's gradient along an axis: |signed mean slope| summed over heads."""
    return np.abs(grads[axis]).sum(-1)


def _ci(values, lo, hi) -> dict:
    mean, a, b, n = mean_ci(values, lo, hi)
    return {"mean": mean, "ci_low": a, "ci_high": b, "n": n}


def summarise(res: dict, log) -> dict:
    """Logs and returns the per-term gradient strengths and per-ablation accuracies."""
    g = res["gradients"]
    out = {"gradients": {}, "ablations": {}}
    log("first ViT block, |signed slope| of each term's logit along the key column (h) /")
    log("row (v), summed over heads, mean over object queries (logit per cell); models:")
    log(f"{'term':>6} {'h':>34} {'v':>34}")
    for t, name in enumerate(VIT_TERMS):
        h, v = _strength(g, "h")[:, t], _strength(g, "v")[:, t]
        out["gradients"][name] = {"h": _ci(h, None, None), "v": _ci(v, None, None)}
        log(f"{name:>6} {fmt_ci(h, None, None):>34} {fmt_ci(v, None, None):>34}")
    log(f"\nterm ablations (accuracy; every head; {res['wall_s']:.1f} s, one compiled call):")
    log(f"{'ablation':>12} " + " ".join(f"{m:>34}" for m in ABL_METRICS))
    for j, name in enumerate(ABLATIONS):
        cells = [res["table"][m][:, j] for m in ABL_METRICS]
        out["ablations"][name] = {m: _ci(c, 0.0, 1.0) for m, c in zip(ABL_METRICS, cells)}
        log(f"{name:>12} " + " ".join(f"{fmt_ci(c, 0.0, 1.0):>34}" for c in cells))
    return out


def plot_gradients(g: dict, path: str, k: int) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    x = np.arange(len(VIT_TERMS))
    for j, (axis, label) in enumerate((("h", "along columns (h)"), ("v", "along rows (v)"))):
        s = _strength(g, axis)
        ax.bar(x + (j - 0.5) * 0.4, s.mean(0), 0.4, color=f"C{j}", alpha=0.7, label=label)
        for i in range(s.shape[0]):
            ax.scatter(x + (j - 0.5) * 0.4, s[i], s=5, color="k", zorder=3)
    ax.set_xticks(x, VIT_TERMS)
    ax.set_ylabel("|slope| (logit / cell), sum over heads")
    ax.set_title(f"first ViT block: where the horizontal and vertical gradients live ({k} models)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tables(res: dict, run: LoadedRun) -> dict:
    columns = [{"ablation": a} for a in ABLATIONS]
    return {
        "gradients": gradient_rows(res["gradients"], run.models),
        "ablations": ablation_rows(res["table"], columns, ABL_METRICS, run.models),
    }


def _plot(res: dict, tables: dict, run: LoadedRun, path: str) -> list[str]:
    folder = os.path.dirname(path)
    return [
        plot_gradients(res["gradients"], path, run.k),
        plots.ablation_bars(
            tables["ablations"],
            list(ABLATIONS),
            os.path.join(folder, "ablations.png"),
            f"first ViT block, terms removed in every head ({run.k} models)",
            keys=ABL_METRICS,
        ),
    ]


REPORT = Report(
    folder="vit_terms",
    refusal=vit_terms_refusal,
    compute=compute,
    tables=_tables,
    summarise=lambda res, tables, run, log: (
        summarise(res, log) | {"models": run.k, "excluded": list(run.excluded)}
    ),
    plot=_plot,
    figure="gradients.png",
)
