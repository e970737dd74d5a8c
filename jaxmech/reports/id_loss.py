"""The spatial-ID loss against the plain loss (paper 003).

Two ways in, one report:

* From scratch: one sweep trains plain (`id_weight` 0) and ID-loss models side by side
  in one program, e.g. `python -m experiments.sweep --preset=vlm --id_site=1
  --id_weight=0,1 --seeds=8`. The target is the planted linear grid ID
  (`families.toy_vlm.model.planted_id_target`): a fresh model has no ID to extract.
* Fine-tuning (`finetune`; `python -m experiments.id_loss --base=RUN --out=DIR`): each
  trained model of RUN continues once per weight, towards the universal ID extracted
  from itself beforehand (`extract_targets`: mean-centred object-word states at the
  site, averaged over the training-pair labels, at X's true cell; the paper's recipe).
  The fine-tuning is a sweep from RUN's params (`finetune_grid`, then
  `sweep.run_grid(..., init_from=...)`): chunked, saved, resumable after a kill
  and locked like any sweep; a resume against a changed RUN is refused.

The report (`REPORT`, run by `reports.driver`): per weight, learning curves
(unseen-pair accuracy, the ID loss on training-pair and validation labels), final
accuracies on seen and unseen pairs with 95% intervals over seeds, and the paired
difference to weight 0: models with the same seed start alike and see the same
batches, so the difference is the loss's effect. A fine-tuned run is summarised per group of its base models
(`base_groups`: generalising before fine-tuning, then the others), generalising first.

The authors' recipe (spatial_finetuning/train.py with run_vision_spatial_loss.sh: the
MLP weights, no biases, of the ViT's last 6 blocks train, the projector and the LM are
frozen, lr 5e-5, weight 1, the ID loss at layer 11 of 28), scaled to the 2-block `vlm`
preset (both ViT blocks' MLP weights, the only middle LM site 1):

    python -m experiments.id_loss --base=runs/vlm --out=runs/id_authors --weights=0,1 \
        --id_site=1 --lr=5e-5 --train_only='vit/block_*/W_in+vit/block_*/W_out'

(Their ID arm also trains on grouped batches and the plain arm not, a confound they
leave; here both arms see the same batches.)

Files (in RUN/id_loss/): table.csv (model_group, weight, metric, mean and interval, the paired
difference to weight 0), curves.csv (weight, step, metric, mean and interval),
summary.json, curves.png.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from jaxmech import outdir, plots
from jaxmech.analysis import spatial_ids as sid
from jaxmech.config import SWEEPABLE, Config, Settings
from jaxmech.families.toy_vlm.evaluate import relations
from jaxmech.reports.common import (
    GENERALISING,
    LoadedRun,
    Report,
    check_run,
    declared,
    open_run,
    view_of,
)
from jaxmech.results import read_csv
from jaxmech.stats import mean_ci
from jaxmech.sweep import Grid, InitFrom, check_init_from, run_grid
from jaxmech.train import check_train_only

FOLDER = "id_loss"


def id_loss_refusal(config, path: str) -> str | None:
    """Why the report does not apply to a run (None: it does)."""
    return declared(FOLDER)(config, path) or (
        None
        if config.model.id_site > 0
        else f"{path}: id_site = 0: the run trained no spatial-ID loss (see experiments.id_loss)"
    )


def extract_targets(run: LoadedRun, site: int, placements: int = 4) -> np.ndarray:
    """[K, L, D] each model's universal spatial ID at LM site `site`: X's word over the
    probe scenes of every training-pair label (`analysis.spatial_ids`)."""
    view = view_of(run)
    pr = sid.probe(view, range(1, run.config.task.max_pair_labels + 1), placements)

    def one(params):
        states = sid.word_states(view, params, pr.inputs, pr.spans.x_B)[site : site + 1]
        return sid.spatial_ids(states, pr.label_N, pr.cell_N, view.grid.cells)[0]

    return np.asarray(jax.jit(jax.vmap(one))(run.params))


def finetune_grid(run: LoadedRun, config: Config, weights, targets=None) -> tuple[Grid, InitFrom]:
    """The fine-tuning sweep of `run`'s models (`config`: the base's with the
    fine-tuning's fields): base model i with weight j at i W + j, with its settings and
    seed, the lr of `config`, starting from its params with its target ID `targets[i]`
    ([K, L, D]) in `static/id_target`. `targets` None: a placeholder of their shape,
    for `sweep.check_init_from` before the targets are extracted."""
    W = len(weights)
    settings = []
    for i in range(run.k):
        own = Settings(*(np.asarray(col)[i].item() for col in run.settings))
        for w in weights:
            settings.append(own._replace(id_weight=float(w), lr=config.train.lr))
    swept = tuple(
        n for n in SWEEPABLE[1:] if n == "id_weight" or len({getattr(s, n) for s in settings}) > 1
    )
    shape = (run.k * W, config.task.image_len, config.model.d_model)
    if targets is None:
        id_target = jax.ShapeDtypeStruct(shape, np.float32)
    else:
        id_target = np.repeat(np.asarray(targets, np.float32), W, axis=0)
    models = tuple(m for m in run.models for _ in range(W))
    init = InitFrom(os.path.abspath(run.path), models, {"id_target": id_target})
    return Grid(config, swept, tuple(settings)), init


def finetune(
    base: str,
    out: str,
    weights,
    overrides: dict,
    overwrite: bool = False,
    log=print,
    chunk_size: int | None = None,
):
    """Fine-tunes every model of run `base` once per weight (`overrides`: config fields
    for the fine-tuning, `id_site` among them) into the results folder `out`: a sweep
    from `base`'s params (`finetune_grid`, `sweep.run_grid` with `init_from`), so it
    resumes after an interruption, and a finished one is not trained again.

    Everything is checked before any compute; with `overwrite`, `out` is replaced only
    when the new run is whole (`outdir`). Returns `out`."""
    config = check_run(base)
    why = declared(FOLDER)(config, base)
    if why:
        raise ValueError(why)
    if not weights or min(weights) < 0 or 0.0 not in weights:
        raise ValueError(
            f"weights = {weights}: expected weights >= 0, 0 (the plain loss) among them"
        )
    config = config.replace(**overrides)
    if config.model.id_site == 0:
        raise ValueError("id_site = 0: fine-tuning with the ID loss needs an LM site (>= 1)")
    for w in weights:
        config.replace(id_weight=float(w))  # a weight out of range fails here, by name
    check_train_only(config)  # a pattern that matches no parameter fails here, by name
    outdir.check_usable(out)
    run = open_run(base, with_data=False, log=log)
    check_init_from(*finetune_grid(run, config, weights))  # before the targets' compute
    targets = extract_targets(run, config.model.id_site)
    grid, init = finetune_grid(run, config, weights, targets)
    log(f"fine-tuning {len(grid.settings)} models ({run.k} x weights {list(weights)}) "
        f"for {config.train.steps} steps at site {config.model.id_site}")  # fmt: skip
    run_grid(grid, out, overwrite=overwrite, chunk_size=chunk_size, init_from=init, log=log)
    return out


def metrics_of(config) -> tuple[str, ...]:
    return (
        "unseen_min_acc",
        *(f"unseen_{rel}_acc" for rel, _ in relations(config)),
        *(f"seen_{rel}_acc" for rel, _ in relations(config)),
        "id_loss_train",
        "id_loss_unseen",
    )


def base_groups(run: LoadedRun) -> list[str]:
    """[K] each model's group by its base model's unseen_min_acc before fine-tuning
    ("generalising" at >= `common.GENERALISING`, else "others"), so that a mean never
    mixes the two kinds; ["all", ...] for a run trained from scratch or whose base's
    results are gone."""
    start = None
    if os.path.isfile(path := os.path.join(run.path, "sweep.json")):
        with open(path) as f:
            start = json.load(f).get("init_from")
    rows = os.path.join(start["run"], "results.csv") if start else ""
    if not os.path.isfile(rows):
        return ["all"] * run.k
    base = {int(r["model"]): float(r.get("unseen_min_acc", np.nan)) for r in read_csv(rows)}
    own = [base.get(start["models"][m], np.nan) for m in run.models]
    return ["generalising" if u >= GENERALISING else "others" for u in own]


def _bounds(metric: str) -> tuple[float, float]:
    """Where a metric's interval is clipped: accuracies in [0, 1], 1 - cos in [0, 2]."""
    return (0.0, 1.0) if metric.endswith("acc") else (0.0, 2.0)


def _by_weight(rows: list[dict]) -> dict[float, dict[int, dict]]:
    """{weight: {seed: row}}: the models of each weight keyed by seed (the pairing)."""
    out: dict[float, dict[int, dict]] = {}
    for r in rows:
        out.setdefault(float(r["id_weight"]), {})[int(r["seed"])] = r
    return out


def compute(config, results: list[dict], curves: list[dict], groups=None) -> dict:
    """Final metrics and curves per weight (module docstring) from a run's results.csv
    rows of the kept models and its curves.csv rows, per model group (`groups` [K],
    `base_groups`; default one group "all"), generalising first."""
    groups = ["all"] * len(results) if groups is None else groups
    out = {"table": [], "curves": [], "weights": sorted({float(r["id_weight"]) for r in results})}
    for g in ("generalising", "others", "all"):
        rows = [r for r, own in zip(results, groups) if own == g]
        if rows:
            part = _group_tables(metrics_of(config), rows, curves)
            out["table"] += [{"model_group": g, **r} for r in part["table"]]
            out["curves"] += [{"model_group": g, **r} for r in part["curves"]]
    return out


def _group_tables(metrics, results: list[dict], curves: list[dict]) -> dict:
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
    return {"table": table, "curves": curve_table}


def summarise(res: dict, log) -> dict:
    group = None
    for r in res["table"]:
        if r["model_group"] != group:
            group = r["model_group"]
            n = max(x["n"] for x in res["table"] if x["model_group"] == group)
            log(f"\n--- {'all' if group == 'all' else group} models ({n} per weight"
                + ("" if group == "all" else f"; by the base model's unseen_min_acc vs {GENERALISING:g}") + ")")  # fmt: skip
            log(
                f"{'weight':>7} {'metric':>15} {'mean [95% CI]':>24} {'paired diff to weight 0':>30}"
            )
        diff = (
            ""
            if r["weight"] == 0
            else f"{r['diff']:+.3f} [{r['diff_lo']:+.3f}, {r['diff_hi']:+.3f}] n={r['pairs']}"
        )
        log(f"{r['weight']:>7.3g} {r['metric']:>15} {r['mean']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] {diff:>30}")  # fmt: skip
    return {f"{r['model_group']}/{r['metric']}@{r['weight']:g}": r for r in res["table"]}


def plot(res: dict, path: str) -> str:
    import matplotlib.pyplot as plt

    panels = (("unseen_min_acc", "unseen-pair accuracy (smaller relation)"),
              ("id_loss_unseen", "ID loss, validation labels"),
              ("id_loss_train", "ID loss, training-pair labels"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (metric, title) in zip(axes, panels):
        for w in res["weights"]:
            main = res["curves"][0]["model_group"]  # generalising where there are any
            rows = [c for c in res["curves"] if (c["weight"], c["metric"], c["model_group"]) == (w, metric, main)]  # fmt: skip
            step = [c["step"] for c in rows]
            line = ax.plot(step, [c["mean"] for c in rows], label=f"id_weight {w:g}")[0]
            ax.fill_between(step, [c["lo"] for c in rows], [c["hi"] for c in rows],
                            color=line.get_color(), alpha=0.2)  # fmt: skip
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.suptitle("spatial-ID loss vs plain loss: mean and 95% interval over seeds", fontsize=10)
    return plots.save(fig, path)


REPORT = Report(
    folder=FOLDER,
    refusal=id_loss_refusal,
    compute=lambda run: compute(run.config, run.results, run.curves, base_groups(run)),
    tables=lambda res, run: {"table": res["table"], "curves": res["curves"]},
    summarise=lambda res, tables, run, log: summarise(res, log),
    plot=lambda res, tables, run, path: plot(res, path),
    figure="curves.png",
    with_data=False,
)
