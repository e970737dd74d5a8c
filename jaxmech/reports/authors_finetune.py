"""Paper 003's ID fine-tune of a checkpoint under the authors' protocol
(`experiments.id_loss --checkpoint=DIR --protocol=authors --train_dir=THEIRS`): their
`spatial_finetuning/train.py` as `jaxmech.finetune_authors` reproduces it, once per
ID-loss weight, from the same checkpoint.

Weight 0 is their `run_vision_baseline.sh` (no ID loss; their DataLoader's batches of
the training questions); a weight w > 0 their `run_vision_spatial_loss.sh` with
`--spatial_id_weight=w` (their grouped batches, the ID loss at `Recipe.layer` towards
the universal IDs `universal`: an npz of the derivation's arrays `layers`, `cells_Cx2`,
`universal_LxCxD`, as `tests/fixtures/authors/spatial_ids*.npz` and the authors'
`.pt` hold them; their cell keys (x, y) at their `--spatial_id_image_size` 224).

Writes OUT/authors_finetune/summary.json (the recipe, their selection: names, total,
budget; the held-out pairs; per weight and step: loss, LM loss, ID loss, learning
rate, gradient norm before clipping) and trained_w{weight}.npz (the trained tensors
under the checkpoint's names, in jaxmech's layout). Their evaluations (COCO-Spatial
and the held-out pairs, by generation) are not run here. Each step rematerialises the
scanned ViT / LM blocks in its backward (`remat`, default "on": `finetune.with_remat`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech import finetune_authors as fa
from jaxmech.data.datasets import authors_grid
from jaxmech.finetune import remat_setting, with_remat
from jaxmech.train import param_paths


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Their train.py's flags (defaults: their scripts'; lr and epochs: train.py's)."""

    epochs: int = 1
    batch_size: int = 15
    lr: float = 5e-5
    budget_frac: float = 0.3
    last_k: int = 6
    layer: int = 11
    holdout_frac: float = 0.15
    holdout_seed: int = 42

    def __post_init__(self):
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: expected at least 1")
        if self.lr <= 0:
            raise ValueError(f"lr = {self.lr}: expected a positive learning rate")
        if not 0 < self.budget_frac <= 1:
            raise ValueError(f"budget_frac = {self.budget_frac}: expected a fraction in (0, 1]")
        if not 0 <= self.holdout_frac < 1:
            raise ValueError(f"holdout_frac = {self.holdout_frac}: expected a fraction in [0, 1)")


def prepare(model, recipe: Recipe):
    """(selection, {stored name: (our path, transform)}, mask) of their selection on
    `model` (a `jaxmech.load`ed checkpoint)."""
    sel = fa.select(fa.stored_sizes(model.folder), recipe.budget_frac, recipe.last_k)
    leaves = fa.leaf_map(model.family, model.config, sel.names)
    return sel, leaves, fa.leaf_mask(model.params, [p for p, _ in leaves.values()])


def finetune(model, its, recipe: Recipe, weight: float, table=None, order_seed=None,
             keep_grads: bool = False, remat: str = "on", log=print):  # fmt: skip
    """(trained params, per-step records) of one run of their fine-tune on `its`
    (`authors_grid.items`): weight 0 their baseline, else with the ID loss towards
    `table` ({(x, y): [D]}, `finetune_authors.id_table`). `order_seed`: the batches'
    order (None: the listing's; theirs is unseeded). `keep_grads`: each step's record
    holds the trained leaves' gradients (numpy, `tree_leaves` order). `remat`: the
    step's scanned blocks rematerialised (`finetune.remat_setting`: "on", "off")."""
    if weight > 0 and not table:
        raise ValueError(f"weight = {weight}: the ID loss needs universal IDs (table)")
    view = with_remat(model, remat, log).view(wording="authors")
    _, _, mask = prepare(model, recipe)
    train, _, _ = authors_grid.split_pairs(its, recipe.holdout_frac, recipe.holdout_seed)
    grouped = weight > 0
    per_epoch = len(authors_grid.batches(its, train, recipe.batch_size, grouped))
    if per_epoch == 0:
        raise ValueError("train_dir: no training batch (a grouped batch needs 2 questions "
                         "with obj1 at one cell)")  # fmt: skip
    total = per_epoch * recipe.epochs
    opt = fa.optimizer(mask, recipe.lr, total)
    step = fa.make_step(view, mask, opt, recipe.layer if grouped else None)
    lr_at, params, records = fa.schedule(recipe.lr, total), model.params, []
    state = opt.init(params)
    for epoch in range(recipe.epochs):
        seed = None if order_seed is None else [order_seed, epoch]
        for b in authors_grid.batches(its, train, recipe.batch_size, grouped, seed):
            batch = fa.render_batch(view, model.processor, model.family,
                                    [its[i] for i in b], table if grouped else None)  # fmt: skip
            lr = float(lr_at(len(records)))
            params, state, rec = step(params, state, batch, jnp.float32(weight))
            rec = jax.device_get(rec)
            grads = rec.pop("grads")
            rec = {k: float(v) for k, v in rec.items()} | {"lr": lr}
            records.append(rec | ({"grads": grads} if keep_grads else {}))
            log(f"weight {weight} step {len(records)}/{total}: " + ", ".join(
                f"{k} {rec[k]:.4f}" for k in ("loss", "lm", "id", "norm")))  # fmt: skip
    return params, records


def run_authors_finetune(model, out: str, train_dir: str, weights, recipe: Recipe,
                         universal: str | None = None, remat: str = "on",
                         log=print) -> dict:  # fmt: skip
    """Their fine-tune of `model` once per weight of `weights` (module docstring), files
    in `out/authors_finetune/`; `remat` as `finetune`'s. ValueError naming `weights`
    below 0, `universal` where a weight > 0 has none, or a bad `remat`, before any
    compute."""
    from jaxmech.results import write_json

    remat_setting(remat)
    if any(w < 0 for w in weights):
        raise ValueError(f"weights = {list(weights)}: expected 0 (their baseline) or above")
    if any(w > 0 for w in weights) and not universal:
        raise ValueError("universal: a weight above 0 needs universal IDs (--universal_ids)")
    its = authors_grid.read_folder(train_dir)
    table = None
    if universal:
        ids = np.load(universal)
        table = fa.id_table(ids["universal_LxCxD"], ids["cells_Cx2"], ids["layers"], recipe.layer)
    sel, leaves, _ = prepare(model, recipe)
    _, _, held = authors_grid.split_pairs(its, recipe.holdout_frac, recipe.holdout_seed)
    folder = os.path.join(out, "authors_finetune")
    os.makedirs(folder, exist_ok=True)
    summary = {"recipe": dataclasses.asdict(recipe), "selection": sel._asdict(),
               "holdout": [list(p) for p in held], "runs": {}}  # fmt: skip
    paths = {p: n for n, (p, _) in leaves.items()}
    for w in weights:
        params, records = finetune(model, its, recipe, w, table, remat=remat, log=log)
        summary["runs"][str(w)] = records
        flat = dict(zip(param_paths(params), jax.tree_util.tree_leaves(params)))
        np.savez(os.path.join(folder, f"trained_w{w}.npz"),
                 **{paths[p]: np.asarray(flat[p]) for p in paths})  # fmt: skip
    write_json(os.path.join(folder, "summary.json"), summary)
    return summary
