"""Paper 003's spatial-ID loss on a real checkpoint: fine-tuning with the LM frozen, per
ID-loss weight, against the plain fine-tune (weight 0).

The recipe is the authors' (spatial_finetuning/train.py with run_vision_spatial_loss.sh):
only the parameters matched by `train_only` train (default the checkpoint family's
`trainable`, its reading of the authors' selection, e.g. the MLP weights, no biases, of
the ViT's last 6 blocks, with the projector and the LM frozen), Adam at a small learning
rate (no weight decay), the ID loss at LM site `site` (default `authors_site`: their
layer 11 of 28, at the same relative depth in a smaller LM). The loss, its probe pairs,
its target and the training loop are `jaxmech.finetune`'s.

Each weight fine-tunes from the same params on the same batches (paired), so the
difference to weight 0 is the loss's effect. Evaluated before and after on held-out
pair questions: accuracy (the answer word's logit over the other word's), and the
ID cosine on held-out probe pairs. The training step rematerialises each scanned ViT /
LM block in its backward (`remat`, default "on": `finetune.with_remat`; a lower peak,
the same numbers within float rounding).

Writes into OUT/id_loss/: curves.csv (weight, step, loss, answer, id), table.csv
(weight, when, accuracy, id_cos), summary.json; each weight's finished fine-tune (its
curve, evaluation and trained leaves) is kept in OUT/id_loss/chunks/ (`chunks`), so a
killed run resumes at the first weight it had not finished.

Axis names (`jaxmech.shapes`): B questions, P probe pairs, L cells, D LM width.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxmech.data.spec import take
from jaxmech.families.vlm_view import examples, margin
from jaxmech.finetune import (
    finetune,
    make_finetune,
    pair_probes,
    probe_cos,
    remat_setting,
    targets,
    trained_leaves,
    with_leaves,
    with_remat,
)
from jaxmech.reports.common import LoadedRun, probe_rows, write_csv, write_json
from jaxmech.train import path_mask

# spatial_finetuning/train.py: --spatial_id_layer 11 (hidden_states[11], the residual
# after 11 of their model's 28 LM blocks: lm/resid_pre.11), --last_k_blocks 6
AUTHORS_SITE, AUTHORS_LM_BLOCKS = 11, 28


def authors_site(n_blocks: int) -> int:
    """The authors' ID-loss site in an LM of `n_blocks` blocks: layer 11 of 28, at the
    same relative depth elsewhere (round(11 n / 28), halves up, at least 1)."""
    return max(1, (2 * AUTHORS_SITE * n_blocks + AUTHORS_LM_BLOCKS) // (2 * AUTHORS_LM_BLOCKS))


def site_of(n_blocks: int, site: int | None, log=print) -> int:
    """The ID loss's LM site: `site`, or None for the authors' (`authors_site`, logged);
    ValueError outside [1, n_blocks]."""
    if site is None:
        site = authors_site(n_blocks)
        scaled = f" (scaled to {n_blocks} blocks: round(11 x {n_blocks} / 28))"
        log(f"ID loss at LM layer {site} (lm/resid_pre.{site}): the authors' layer 11 of "
            f"their LM's 28" + ("" if n_blocks == AUTHORS_LM_BLOCKS else scaled))  # fmt: skip
    if not 1 <= site <= n_blocks:
        raise ValueError(f"id_site = {site}: expected an LM site in [1, {n_blocks}]")
    return site


def curve_rows(weight: float, curve: dict) -> list[dict]:
    """curves.csv's rows of one fine-tune's per-step {loss, answer, id}."""
    return [{"weight": weight, "step": t + 1, "loss": float(x), "answer": float(y), "id": float(z)}
            for t, (x, y, z) in enumerate(zip(curve["loss"], curve["answer"], curve["id"]))]  # fmt: skip


def remat_view(subject, view, remat: str, log=print):
    """The checkpoint subject's `view` again (its grid, size, wording, pictures or
    video) from its model's config with `remat` set (`finetune.with_remat`, logged)."""
    model = with_remat(subject.model, remat, log)
    video = view.video_clock is not None
    return model.view(tuple(view.grid), view.size, video=video, wording=subject.protocol)


def make_eval(view, test, probes, site: int, target):
    """`params -> {accuracy, id_cos}`, compiled once: accuracy on held-out questions
    (margin > 0) and the mean ID cosine on held-out probe pairs."""

    @jax.jit
    def run(p):
        m = margin(view.forward(p, test.inputs)[0], test.answer_B, test.other_B)
        return (m > 0).mean(), probe_cos(view, p, probes, site, target).mean()

    def evaluate(p) -> dict:
        acc, cos = run(p)
        return {"accuracy": float(acc), "id_cos": float(cos)}

    return evaluate


def run_id_loss(run: LoadedRun, out: str, weights=(0.0, 1.0), site: int | None = None, steps: int = 200,
                lr: float = 5e-5, train_only: str | None = None, remat: str = "on",
                log=print) -> dict:  # fmt: skip
    """The ID-loss fine-tunes of a checkpoint (`common.open_checkpoint`), one per weight,
    evaluated before and after; files in `out/id_loss/` (module docstring). `site` None:
    the authors' (`authors_site`); `train_only` None: theirs (the family's `trainable`);
    `remat`: the training step's scanned blocks rematerialised (`finetune.remat_setting`:
    "on", "off"; a ValueError naming it before any compute). Returns the tables, the
    summary and each weight's fine-tuned params."""
    from jaxmech.reports.common import plots_dir

    remat_setting(remat)
    folder = plots_dir(out, "id_loss")
    subject = run.subject.with_chunks(os.path.join(folder, "chunks"))
    if subject.store("id_loss") is None or getattr(run.family, "trainable", None) is None:
        raise ValueError("run_id_loss: expected a checkpoint (common.open_checkpoint): "
                         "its family's `trainable` leaves, each weight's run kept in its "
                         "chunk store")  # fmt: skip
    view, questions = subject.view(run), subject.question_specs(run)["examples"]
    params = jax.tree_util.tree_map(lambda x: x[0], run.params)
    site = site_of(view.n_lm_blocks(params), site, log)
    spec = train_only or run.family.trainable(params)
    mask = jax.tree_util.tree_leaves(path_mask(params, spec))  # a bad pattern fails here
    split = np.arange(len(questions.relation_B)) % 4 == 0  # a quarter of them held out
    batch = min(subject.batch or 8, 8, int((~split).sum()))
    cfg = {"steps": steps, "lr": lr, "train_only": spec, "batch": batch, "seed": 0}
    test, train = examples(view, take(questions, split)), examples(view, take(questions, ~split))
    probes, held = pair_probes(view, 4, 1), pair_probes(view, 2, 2)
    target = targets(view, params, site, probe_rows(run, log))
    evaluate = make_eval(view, test, held, site, target)
    # only the training step differentiates; evaluation and targets keep the plain view
    run_steps = make_finetune(remat_view(subject, view, remat, log), params, site, target, cfg)
    table = [{"weight": w, "when": "before", **evaluate(params)} for w in weights[:1]]
    table = [{**table[0], "weight": w} for w in weights]  # one start for every weight
    curves, tuned_by_weight = [], {}
    for w in weights:
        store = subject.store("id_loss", **cfg, site=site, weight=w)
        done = store.get(0)
        if done is None:
            tuned, curve = finetune(view, params, w, train, probes, run_steps, cfg)
            done = {"curve": curve, "after": evaluate(tuned), "tuned": trained_leaves(tuned, mask)}
            store.put(0, done)
        else:
            log(f"weight {w:g}: resumed from {store.folder}")
        tuned = with_leaves(params, done["tuned"])
        curves += curve_rows(w, done["curve"])
        tuned_by_weight[w] = tuned
        table.append(
            {"weight": w, "when": "after", **{k: float(v) for k, v in done["after"].items()}}
        )
        log(f"weight {w:g}: {table[-1]}")
    write_csv(os.path.join(folder, "curves.csv"), curves)
    write_csv(os.path.join(folder, "table.csv"), table)
    summary = {"config": cfg, "site": site, "table": table}
    write_json(os.path.join(folder, "summary.json"), summary)
    return {"table": table, "curves": curves, "summary": summary, "params": tuned_by_weight}
