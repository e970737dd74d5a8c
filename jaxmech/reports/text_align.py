"""Text-side report of a results folder: first-mention EOT heads and label alignment.

For every model of a 1D-task results folder and, as a control, the same models at their
initialisation:

* text heads (`jaxmech.analysis.text_heads`): per text layer and head, the EOT row's
  attention to the first- minus the second-mentioned label over every ordered label
  pair (seen, unseen and mixed pairs; each caption form), the fraction of captions
  where first > second, the logit difference's key-position part and the spread of its
  key-token part, and the head's role (first / second / none);
* alignment (`jaxmech.analysis.align`): Procrustes map fitted on labels
  1..n_labels - n_val_labels, tested on the validation labels, for raw token
  embeddings and for the towers' single-object output embeddings, against random
  orthogonal maps and shuffled-correspondence fits.

Prints the tables (mean +- std and 95% CI over models) and writes into `RUN/text_align/`
(the folder keeps the report's old name, so existing runs keep their outputs):
  text_heads.csv  params (trained / init), model, layer, head, role, group, n, STAT_KEYS
  align.csv       params, model, kind, ALIGN_COLS
  summary.json    head counts and strongest heads per model; alignment means; the
                  excluded (diverged) models
  figures: text_heads.png, align.png

Diverged models are left out and named (`reports.common.open_run`); `model` is a
model's index in the run.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from jaxmech import plots  # selects the Agg backend before any figure is made
from jaxmech.analysis.align import KINDS, alignment_study, control_maps
from jaxmech.analysis.text_heads import GROUPS, ROLES, pair_captions, text_head_table
from jaxmech.reports.common import (
    LoadedRun,
    check_run,
    declared,
    fmt_ci,
    open_run,
    write_csv,
    write_json,
)
from jaxmech.train import init_program

STAT_KEYS = ("mean_pref", "std_pref", "frac_first", "mean_first", "mean_second", "key_P")
STAT_KEYS += ("key_E_mean", "key_E_std")
ALIGN_COLS = (
    "cos_before",
    "cos_after",
    "cos_after_span",
    "cos_random_mean",
    "cos_random_p95",
    "cos_shuffled_mean",
    "cos_after_other",
    "cos_fit_after",
    "retrieval_before",
    "retrieval_after",
    "retrieval_random_mean",
    "retrieval_shuffled_mean",
    "span_img",
    "span_txt",
)


def _text_heads(params, cfg, n_pair, label, min_pref, min_frac, models):
    """Per-head EOT statistics of stacked models, and their CSV rows (`models` [K]:
    each model's index in the run)."""
    caps = pair_captions(cfg.task.n_labels, cfg.task.caption_mode)
    first_val = cfg.task.n_labels - cfg.task.n_val_labels + 1
    fn = jax.jit(
        lambda p, n: text_head_table(
            p,
            caps,
            n,
            first_val,
            min_pref=min_pref,
            min_frac=min_frac,
        )
    )
    out = jax.device_get(fn(params, jnp.asarray(n_pair)))
    K, G, Y, H = out["mean_pref"].shape
    rows = []
    for k in range(K):
        for y in range(Y):
            for h in range(H):
                for g in range(G):
                    if out["n"][k, g] == 0:
                        continue
                    rows.append(
                        {
                            "params": label,
                            "model": models[k],
                            "layer": y,
                            "head": h,
                            "role": ROLES[int(out["role"][k, y, h])],
                            "group": GROUPS[g],
                            "n": int(out["n"][k, g]),
                            **{s: float(out[s][k, g, y, h]) for s in STAT_KEYS},
                        }
                    )
    return out, rows


def _alignment(params, cfg, label, n_random, n_shuffled, seed, models):
    """Procrustes alignment study of stacked models per embedding kind, and its CSV rows
    (`models` [K]: each model's index in the run)."""
    t = cfg.task
    n_fit = t.n_labels - t.n_val_labels
    fit, test = jnp.arange(1, n_fit + 1), jnp.arange(n_fit + 1, t.n_labels + 1)
    text_caption = "label" if t.single_captions == "label" else "side"
    out, rows = {}, []
    for kind in KINDS:
        tower = params["vision"]
        d = tower["E"].shape[-1] if kind == "token" else tower["W_proj"].shape[-1]
        rot, perm = control_maps(jax.random.key(seed), n_random, n_shuffled, d, n_fit)
        fn = jax.jit(
            jax.vmap(
                lambda p, rot=rot, perm=perm, kind=kind: alignment_study(
                    p,
                    fit,
                    test,
                    rot,
                    perm,
                    n_labels=t.n_labels,
                    image_len=t.image_len,
                    kind=kind,
                    text_caption=text_caption,
                )
            )
        )
        r = jax.device_get(fn(params))
        r["cos_random_mean"] = r["cos_random"].mean(-1)
        r["cos_random_p95"] = np.percentile(r["cos_random"], 95, axis=-1)
        r["cos_shuffled_mean"] = r["cos_shuffled"].mean(-1)
        r["retrieval_random_mean"] = r["retrieval_random"].mean(-1)
        r["retrieval_shuffled_mean"] = r["retrieval_shuffled"].mean(-1)
        out[kind] = r
        for k in range(len(r["cos_after"])):
            rows.append(
                {"params": label, "model": models[k], "kind": kind}
                | {c: float(r[c][k]) for c in ALIGN_COLS}
            )
    return out, rows


def _print_heads(out, unseen_acc, models, log):
    """Logs the per-model, per-head table of the trained models (`models` [K]: each
    model's index in the run)."""
    K, G, Y, H = out["mean_pref"].shape
    gi = {g: GROUPS.index(g) for g in GROUPS}
    present = [g for g in GROUPS if g != "all" and out["n"][0, gi[g]] > 0]
    log(
        f"{'model':>5} {'unseen':>6} {'L':>1} {'head':>4} {'role':>6} {'pref(all)':>9} "
        f"{'std':>5} "
        + " ".join(f"{'P>0 ' + g:>12}" for g in present)
        + f" {'key_P':>7} {'sd key_E':>8}"
    )
    for k in range(K):
        for y in range(Y):
            for h in range(H):
                s = lambda n, g="all": out[n][k, gi[g], y, h]  # noqa: E731
                log(
                    f"{models[k]:>5} {unseen_acc[k]:>6.3f} {y:>1} {h:>4} "
                    f"{ROLES[int(out['role'][k, y, h])]:>6} {s('mean_pref'):>+9.3f} "
                    f"{s('std_pref'):>5.3f} "
                    + " ".join(f"{s('frac_first', g):>12.2f}" for g in present)
                    + f" {s('key_P'):>+7.3f} {s('key_E_std'):>8.3f}"
                )


def _head_summary(out, log, label):
    """Counts first/second-mention heads per model; logs and returns the summary."""
    role = out["role"]  # [K, Y, H]
    K = role.shape[0]
    pref = out["mean_pref"][:, GROUPS.index("all")].reshape(K, -1)
    frac_unseen = out["frac_first"][:, GROUPS.index("unseen")].reshape(K, -1)
    best = pref.argmax(1)
    strongest = np.abs(pref).argmax(1)
    n_first = (role == 1).reshape(K, -1).sum(1)
    n_second = (role == 2).reshape(K, -1).sum(1)
    summary = {
        "models": K,
        "models_with_first_head": int((n_first > 0).sum()),
        "models_with_order_head": int(((n_first + n_second) > 0).sum()),
        "first_heads_per_model": n_first.tolist(),
        "second_heads_per_model": n_second.tolist(),
        "max_pref": pref[np.arange(K), best].tolist(),
        "max_pref_frac_unseen": frac_unseen[np.arange(K), best].tolist(),
        "max_abs_pref": np.abs(pref[np.arange(K), strongest]).tolist(),
    }
    log(
        f"[{label}] models with a first-mention head: {summary['models_with_first_head']}/{K}; "
        f"with a first- or second-mention head: {summary['models_with_order_head']}/{K}; "
        f"first/second heads per model: {n_first.tolist()} / {n_second.tolist()}"
    )
    log(f"[{label}] most first-preferring head per model, pref:   {fmt_ci(summary['max_pref'])}")
    log(
        f"[{label}]   its fraction first > second on unseen pairs: "
        f"{fmt_ci(summary['max_pref_frac_unseen'], 0.0, 1.0)}"
    )
    log(f"[{label}] largest |pref| head per model:             {fmt_ci(summary['max_abs_pref'])}")
    return summary


def _print_align(res, log, label):
    """Logs one alignment table: a row per column of ALIGN_COLS, a column per kind."""
    log(f"{'':>24} " + " ".join(f"{k:>36}" for k in KINDS))
    for c in ALIGN_COLS:
        lo = 0.0 if c.startswith(("retrieval", "span")) else -1.0
        log(f"{label + ' ' + c:>30} " + " ".join(f"{fmt_ci(res[k][c], lo):>36}" for k in KINDS))


def _fig_heads(out, path, title, models):
    """Bars of each head's first-minus-second EOT mass per label-pair group, a panel
    per model (`models` [K]: each model's index in the run)."""
    K, G, Y, H = out["mean_pref"].shape
    groups = [g for g in ("seen", "mixed", "unseen") if out["n"][0, GROUPS.index(g)] > 0]
    cols = min(K, 4)
    rows = -(-K // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), squeeze=False)
    w = 0.8 / len(groups)
    for k in range(K):
        ax = axes[k // cols, k % cols]
        for j, g in enumerate(groups):
            gi = GROUPS.index(g)
            m = out["mean_pref"][k, gi].reshape(-1)
            sd = out["std_pref"][k, gi].reshape(-1)
            x = np.arange(Y * H) + (j - (len(groups) - 1) / 2) * w
            ax.bar(x, m, w, yerr=sd, capsize=2, color=f"C{j}", label=g if k == 0 else None)
        names = [
            f"L{y}H{h}" + {1: "*", 2: "'"}.get(int(out["role"][k, y, h]), "")
            for y in range(Y)
            for h in range(H)
        ]
        ax.set_xticks(range(Y * H), names, fontsize=7)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_ylim(-1, 1)
        ax.set_title(f"model {models[k]}", fontsize=9)
    for ax in axes.flat[K:]:
        ax.axis("off")
    axes[0, 0].set_ylabel("EOT mass: first - second label")
    axes[0, 0].legend(fontsize=7, title="label pairs", title_fontsize=7)
    fig.suptitle(title + "  (* first-mention head, ' second-mention head; bars: std over pairs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fig_align(res, res_init, path, title):
    """Held-out cosine and retrieval, trained vs init, against the controls."""
    fig, axes = plt.subplots(2, len(KINDS), figsize=(5.5 * len(KINDS), 7), squeeze=False)
    panels = (
        ("cosine of matching held-out labels",
         ("cos_before", "cos_after", "cos_random_mean", "cos_shuffled_mean", "cos_after_other"),
         ("before", "after R", "random R", "shuffled fit", "after R,\nother label")),
        ("retrieval among held-out labels",
         ("retrieval_before", "retrieval_after", "retrieval_random_mean",
          "retrieval_shuffled_mean"),
         ("before", "after R", "random R", "shuffled fit")),
    )  # fmt: skip
    for i, (ylabel, keys, names) in enumerate(panels):
        for j, kind in enumerate(KINDS):
            ax = axes[i, j]
            for s, (r, lab, off) in enumerate(((res, "trained", -0.2), (res_init, "init", 0.2))):
                vals = [np.asarray(r[kind][c], float) for c in keys]
                x = np.arange(len(keys)) + off
                ax.bar(x, [v.mean() for v in vals], 0.38, color=f"C{s}", alpha=0.7,
                       label=lab)  # fmt: skip
                for xi, v in zip(x, vals):
                    ax.scatter(np.full(len(v), xi), v, s=6, color="k", zorder=3)
            if i == 0:
                p95 = np.mean(res[kind]["cos_random_p95"])
                ax.axhline(p95, color="C3", ls=":", lw=1, label="random R, 95th pct")
            else:
                n_test = res[kind]["n_test"]
                ax.axhline(1 / n_test, color="gray", ls=":", lw=1, label="chance")
            ax.set_xticks(range(len(keys)), names, fontsize=8)
            ax.axhline(0, color="gray", lw=0.8)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{kind} embeddings", fontsize=10)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def text_refusal(config, path: str) -> str | None:
    """Why this report does not apply to a run (None when it does)."""
    # the pair captions and single-object images here are the 1D task's
    return declared("text")(config, path)


def compute_text(run: LoadedRun, n_random, n_shuffled, seed, min_pref, min_frac) -> dict:
    """Text heads and alignment of the trained models and of the same models at init.

    Returns {"heads", "head_rows", "heads0", "head_rows0", "align", "align_rows",
    "align0", "align_rows0"}: per-head EOT statistics ({name: [K, G, Y, H]}), alignment
    results per embedding kind ({kind: {name: [K] or [K, n]}}) and their CSV rows; the
    `0` entries are the init control.
    """
    cfg = run.config
    init = init_program(run.settings, cfg).params  # each model's step-0 params, as trained
    n_pair = run.settings.n_pair_labels
    res = {}
    for label, params, suffix in (("trained", run.params, ""), ("init", init, "0")):
        heads, rows = _text_heads(params, cfg, n_pair, label, min_pref, min_frac, run.models)
        res["heads" + suffix], res["head_rows" + suffix] = heads, rows
    for label, params, suffix in (("trained", run.params, ""), ("init", init, "0")):
        align, rows = _alignment(params, cfg, label, n_random, n_shuffled, seed, run.models)
        for kind in KINDS:
            align[kind]["n_test"] = cfg.task.n_val_labels
        res["align" + suffix], res["align_rows" + suffix] = align, rows
    return res


def _print_text(run: LoadedRun, res: dict, n_random: int, n_shuffled: int, log) -> dict:
    """Logs the head and alignment tables; returns the summary (summary.json)."""
    t = run.config.task
    log("\n-- text heads: EOT attention to the first- minus second-mentioned label")
    log(
        "   pref = mean over captions of (a_first - a_second); P>0 = fraction of captions "
        "with a_first > a_second; key_P = logit difference from the keys' position rows "
        "(label-independent), sd key_E = its spread from the keys' token rows"
    )
    _print_heads(res["heads"], run.unseen_acc(), run.models, log)
    summary = {"text_heads": {"trained": _head_summary(res["heads"], log, "trained")}}
    summary["text_heads"]["init"] = _head_summary(res["heads0"], log, "init")
    log(
        f"\n-- alignment: Procrustes R fitted on labels 1..{t.n_labels - t.n_val_labels}, "
        f"tested on {t.n_labels - t.n_val_labels + 1}..{t.n_labels} (mean +- std [95% CI] "
        f"over models; random R: {n_random} Haar maps; shuffled fit: "
        f"{n_shuffled} fits with permuted labels; retrieval chance "
        f"{1 / t.n_val_labels:.2f})"
    )
    _print_align(res["align"], log, "trained")
    _print_align(res["align0"], log, "init")
    summary["align"] = {
        lab: {k: {c: float(np.mean(r[k][c])) for c in ALIGN_COLS} for k in KINDS}
        for lab, r in (("trained", res["align"]), ("init", res["align0"]))
    }
    return summary


def analyse_text_run(
    path: str,
    *,
    n_random: int = 100,
    n_shuffled: int = 20,
    seed: int = 0,
    min_pref: float = 0.05,
    min_frac: float = 0.95,
    log=print,
) -> dict:
    """Computes, prints, writes and plots the text-side report of one results folder.

    Args:
      path: a finished results folder of the 1D task (config.json, results.csv, params)
        with at least one finite model; diverged models are left out and logged.
      n_random: random orthogonal (Haar) maps of the alignment control.
      n_shuffled: shuffled-correspondence Procrustes fits of the alignment control.
      seed: key of the random controls.
      min_pref: mean |first - second| EOT mass for a first/second-mention head.
      min_frac: fraction of captions in every label-pair group with that sign.
      log: where the tables go, one line a call.

    Returns:
      The summary written to summary.json: {"text_heads": {"trained", "init"},
      "align": {"trained", "init"}, "excluded": the diverged models' lines}, over the
      finite models.
    """
    refusal = text_refusal(check_run(path), path)
    if refusal:
        raise ValueError(refusal)
    run = open_run(path, with_data=False, log=log)
    cfg, t = run.config, run.config.task
    out_dir = plots.ensure_dir(os.path.join(path, "text_align"))
    log(
        f"{run.k} models; caption_mode {t.caption_mode}; text layers {cfg.model.text_layers}; "
        f"labels 1..{t.n_labels}, validation labels {t.n_labels - t.n_val_labels + 1}.."
        f"{t.n_labels}"
    )
    res = compute_text(run, n_random, n_shuffled, seed, min_pref, min_frac)
    write_csv(os.path.join(out_dir, "text_heads.csv"), res["head_rows"] + res["head_rows0"])
    write_csv(os.path.join(out_dir, "align.csv"), res["align_rows"] + res["align_rows0"])
    summary = _print_text(run, res, n_random, n_shuffled, log)
    summary["excluded"] = list(run.excluded)
    write_json(os.path.join(out_dir, "summary.json"), summary)
    name = os.path.basename(path.rstrip("/"))
    figs = [
        _fig_heads(res["heads"], os.path.join(out_dir, "text_heads.png"),
                   f"{name}: text EOT heads", run.models),
        _fig_align(
            res["align"], res["align0"], os.path.join(out_dir, "align.png"),
            f"{name}: image-text label alignment up to a rotation",
        ),
    ]  # fmt: skip
    log("results: " + "  ".join(os.path.join(out_dir, f) for f in ("text_heads.csv", "align.csv")))
    log("figures: " + "  ".join(figs))
    return summary
