"""The spatial-ID loss against the plain loss (seed 003, issue 14, part 1).

Two ways in, one report:

* From scratch: one sweep trains plain (`id_weight` 0) and ID-loss models side by side
  in one program, e.g. `python -m experiments.sweep --preset=vlm --id_site=1
  --id_weight=0,1 --seeds=8`. The target is the planted linear grid ID
  (`models.ar_vlm.planted_id_target`): a fresh model has no ID to extract.
* Fine-tuning (`finetune`; `python -m experiments.id_loss --base=RUN --out=DIR`): each
  trained model of RUN continues once per weight, towards the universal ID extracted
  from itself beforehand (`extract_targets`: mean-centred object-word states at the
  site, averaged over the training-pair labels, at X's true cell; the paper's recipe).

The report (`analyse_id_loss_run`): per weight, learning curves (unseen-pair accuracy,
the ID loss on training-pair and validation labels), final accuracies with 95%
intervals over seeds, and the paired difference to weight 0: models with the same
seed start alike and see the same batches, so the difference is the loss's effect.

Files (in RUN/id_loss/): table.csv (weight, metric, mean and interval, the paired
difference to weight 0), curves.csv (weight, step, metric, mean and interval),
summary.json, curves.png.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxmech import outdir, plots
from jaxmech.analysis import spatial_ids as sid
from jaxmech.config import Settings
from jaxmech.evaluate_answers import relations
from jaxmech.reports.common import LoadedRun, check_run, needs_ar_vlm, open_run, write_json
from jaxmech.results import load_run, write_csv, write_files
from jaxmech.stats import mean_ci
from jaxmech.train import restart_state, train_models

FOLDER = "id_loss"


def id_loss_refusal(config, path: str) -> str | None:
    """Why the report does not apply to a run (None: it does)."""
    return needs_ar_vlm(config, path) or (
        None
        if config.model.id_site > 0
        else f"{path}: id_site = 0: the run trained no spatial-ID loss (see experiments.id_loss)"
    )


def extract_targets(run: LoadedRun, site: int, placements: int = 4) -> np.ndarray:
    """[K, L, D] each model's universal spatial ID at LM site `site`: X's word over the
    probe scenes of every training-pair label (`analysis.spatial_ids`)."""
    task = run.config.task
    batch, label, cell = sid.probe_scenes(task, range(1, task.max_pair_labels + 1), placements)

    def one(params):
        states = sid.object_word_states(params, batch)[site : site + 1]
        return sid.spatial_ids(states, label, cell, task.image_len)[0]

    return np.asarray(jax.jit(jax.vmap(one))(run.params))


def finetune_models(run: LoadedRun, weights, targets) -> tuple[Settings, dict]:
    """(settings, params) [K W]: base model i with weight j at i W + j, its seed, its
    target ID in `static/id_target`."""
    W = len(weights)
    rep = lambda x: np.repeat(np.asarray(x), W, axis=0)  # noqa: E731
    settings = Settings(*(rep(v) for v in run.settings))
    settings = settings._replace(id_weight=np.tile(np.asarray(weights, np.float32), run.k))
    static = {**run.params["static"], "id_target": targets}
    return settings, jax.tree_util.tree_map(rep, {**run.params, "static": static})


def finetune(base: str, out: str, weights, overrides: dict, overwrite: bool = False, log=print):
    """Fine-tunes every model of run `base` once per weight (`overrides`: config fields
    for the fine-tuning, `id_site` among them) and writes a results folder `out`.

    Everything is checked before any compute; `out` is replaced only when the new run
    is whole (`outdir`)."""
    config = check_run(base)
    why = needs_ar_vlm(config, base)
    if why:
        raise ValueError(why)
    if not weights or min(weights) < 0 or 0.0 not in weights:
        raise ValueError(
            f"weights = {weights}: expected weights >= 0, 0 (the plain loss) among them"
        )
    config = config.replace(**overrides)
    if config.model.id_site == 0:
        raise ValueError("id_site = 0: fine-tuning with the ID loss needs an LM site (>= 1)")
    with outdir.locked(out, log=log):
        work, _ = outdir.prepare(out, lambda f: "another run", overwrite)
        run = open_run(base, log=log)
        targets = extract_targets(run, config.model.id_site)
        settings, params = finetune_models(run, weights, targets)
        settings = settings._replace(lr=np.full_like(settings.lr, config.train.lr))
        log(f"fine-tuning {len(settings.seed)} models ({run.k} x weights {list(weights)}) "
            f"for {config.train.steps} steps at site {config.model.id_site}")  # fmt: skip
        state, curves = train_models(
            config, settings, state=restart_state(config, settings, params)
        )
        write_files(work, config, settings, state.params, curves, state.diverged_step,
                    extra={"base": os.path.abspath(base)})  # fmt: skip
        outdir.publish(work, out)
    return out


def metrics_of(config) -> tuple[str, ...]:
    return (
        "unseen_min_acc",
        *(f"unseen_{rel}_acc" for rel, _ in relations(config)),
        "id_loss_train",
        "id_loss_unseen",
    )


def _bounds(metric: str) -> tuple[float, float]:
    """Where a metric's interval is clipped: accuracies in [0, 1], 1 - cos in [0, 2]."""
    return (0.0, 1.0) if metric.endswith("acc") else (0.0, 2.0)


def _by_weight(rows: list[dict]) -> dict[float, dict[int, dict]]:
    """{weight: {seed: row}}: the models of each weight keyed by seed (the pairing)."""
    out: dict[float, dict[int, dict]] = {}
    for r in rows:
        out.setdefault(float(r["id_weight"]), {})[int(r["seed"])] = r
    return out


def compute(config, results: list[dict], curves: list[dict]) -> dict:
    """Final metrics and curves per weight (module docstring) from a run's results.csv
    rows of the kept models and its curves.csv rows."""
    metrics = metrics_of(config)
    groups = _by_weight(results)
    table, curve_table = [], []
    plain = groups.get(0.0, {})
    for w, models in sorted(groups.items()):
        for m in metrics:
            vals = [models[s][m] for s in sorted(models)]
            mean, lo, hi, n = mean_ci(vals, *_bounds(m))
            pairs = [models[s][m] - plain[s][m] for s in sorted(models) if s in plain]
            d, dlo, dhi, dn = mean_ci(pairs, None, None) if w != 0.0 else (np.nan,) * 4
            table.append(dict(weight=w, metric=m, mean=mean, lo=lo, hi=hi, n=n,
                              diff=d, diff_lo=dlo, diff_hi=dhi, pairs=dn))  # fmt: skip
        ids = {int(models[s]["model"]) for s in models}
        for step in sorted({int(c["step"]) for c in curves}):
            at = [c for c in curves if int(c["step"]) == step and int(c["model"]) in ids]
            for m in metrics:
                mean, lo, hi, n = mean_ci([c[m] for c in at], *_bounds(m))
                curve_table.append(dict(weight=w, step=step, metric=m, mean=mean, lo=lo, hi=hi))
    return {"table": table, "curves": curve_table, "weights": sorted(groups)}


def summarise(res: dict, log) -> dict:
    log(f"{'weight':>7} {'metric':>15} {'mean [95% CI]':>24} {'paired diff to weight 0':>30}")
    for r in res["table"]:
        diff = (
            ""
            if r["weight"] == 0
            else f"{r['diff']:+.3f} [{r['diff_lo']:+.3f}, {r['diff_hi']:+.3f}] n={r['pairs']}"
        )
        log(f"{r['weight']:>7.3g} {r['metric']:>15} {r['mean']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] {diff:>30}")  # fmt: skip
    return {f"{r['metric']}@{r['weight']:g}": r for r in res["table"]}


def plot(res: dict, path: str) -> str:
    import matplotlib.pyplot as plt

    panels = (("unseen_min_acc", "unseen-pair accuracy (smaller relation)"),
              ("id_loss_unseen", "ID loss, validation labels"),
              ("id_loss_train", "ID loss, training-pair labels"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (metric, title) in zip(axes, panels):
        for w in res["weights"]:
            rows = [c for c in res["curves"] if c["weight"] == w and c["metric"] == metric]
            step = [c["step"] for c in rows]
            line = ax.plot(step, [c["mean"] for c in rows], label=f"id_weight {w:g}")[0]
            ax.fill_between(step, [c["lo"] for c in rows], [c["hi"] for c in rows],
                            color=line.get_color(), alpha=0.2)  # fmt: skip
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.suptitle("spatial-ID loss vs plain loss: mean and 95% interval over seeds", fontsize=10)
    return plots.save(fig, path)


def analyse_id_loss_run(path: str, log=print) -> dict:
    """The report on a run with an ID-loss site (module docstring)."""
    why = id_loss_refusal(check_run(path), path)
    if why:
        raise ValueError(why)
    out = plots.ensure_dir(os.path.join(path, FOLDER))
    run = open_run(path, with_data=False, log=log)
    res = compute(run.config, run.results, load_run(path).curves)
    write_csv(os.path.join(out, "table.csv"), res["table"])
    write_csv(os.path.join(out, "curves.csv"), res["curves"])
    summary = summarise(res, log)
    write_json(os.path.join(out, "summary.json"), summary)
    log(f"figure: {plot(res, os.path.join(out, 'curves.png'))}")
    return summary
