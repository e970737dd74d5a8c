"""Paper 003's spatial-ID loss on a real checkpoint: fine-tuning with the LM frozen, per
ID-loss weight, against the plain fine-tune (weight 0).

The recipe is the authors' (spatial_finetuning/train.py with run_vision_spatial_loss.sh):
only the parameters matched by `train_only` train (default the checkpoint family's
`trainable`, its reading of the authors' selection, e.g. the MLP weights, no biases, of
the ViT's last 6 blocks, with the projector and the LM frozen), Adam at a small learning
rate (no weight decay), the ID loss at LM site `site` (default `authors_site`: their
layer 11 of 28, at the same relative depth in a smaller LM). The loss on a batch of pair
questions (`data.spec.pair_questions`, drawn as pictures) is

    -log p(answer word)  +  weight * mean(1 - cos(ID_pred, ID_true))

ID_pred: for one object pair per step, X drawn at every cell with Y where it was (at
the next cell when X lands on it), the state at X's word at LM site `site`, centred
over the cells (`analysis.spatial_ids.probe_specs` with one placement). ID_true: the
checkpoint's own universal ID at that site, extracted before fine-tuning from probes of
every shape (`targets`), as the toy's fine-tune does.

Each weight fine-tunes from the same params on the same batches (paired), so the
difference to weight 0 is the loss's effect. Evaluated before and after on held-out
pair questions: accuracy (the answer word's logit over the other word's), and the
ID cosine on held-out probe pairs.

Writes into OUT/id_loss/: curves.csv (weight, step, loss, answer, id), table.csv
(weight, when, accuracy, id_cos), summary.json; each weight's finished fine-tune (its
curve, evaluation and trained leaves) is kept in OUT/id_loss/chunks/ (`chunks`), so a
killed run resumes at the first weight it had not finished.

Axis names (`jaxmech.shapes`): B questions, P probe pairs, L cells, D LM width.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmech.analysis import spatial_ids as si
from jaxmech.data.spec import SceneSpec, take
from jaxmech.families.vlm_view import examples, margin, resid_site, rows_at
from jaxmech.models.id_loss import id_cos  # the same cosine as the toy's loss
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


def targets(view, params, site: int, batch: int) -> jax.Array:
    """[L, D] the checkpoint's universal ID at LM site `site` (every shape probed)."""
    pr = si.probe(view, range(1, view.n_labels + 1))
    states = si.word_states(view, params, pr.inputs, pr.spans.x_B, batch)
    return si.spatial_ids(states[site : site + 1], pr.label_N, pr.cell_N, view.grid.cells)[0]


def pair_probes(view, n_pairs: int, seed: int):
    """(inputs, X's word [n_pairs L]): n_pairs object pairs (two different shapes, each
    with a colour and a facing), X at every cell in turn, Y where it was (at the next
    cell when X lands on it), rendered once."""
    rng = np.random.default_rng([seed, 31])
    L = view.grid.cells
    labels = np.stack([rng.permutation(view.n_labels)[:2] + 1 for _ in range(n_pairs)])
    y_cell = rng.integers(0, L, n_pairs)
    cells = np.arange(L)
    x = np.tile(cells, n_pairs)
    y = np.repeat(y_cell, L)
    y = np.where(y == x, (y + 1) % L, y)
    each = lambda a: np.repeat(a, L, axis=0)  # noqa: E731
    spec = SceneSpec(
        np.stack([x, y], 1).astype(np.int32),
        each(labels).astype(np.int32),
        each(rng.integers(1, view.n_colours + 1, (n_pairs, 2))).astype(np.int32),
        each(rng.integers(1, 3, (n_pairs, 2))).astype(np.int32),
        np.zeros(n_pairs * L, np.int32),
    )
    inputs, spans = view.render(spec)
    return inputs, np.asarray(spans.x_B)


def probe_cos(view, params, probe, site: int, target) -> jax.Array:
    """[P, L] cos(ID_pred, ID_true) of probe pairs (`pair_probes`: inputs and X's word)."""
    inputs, x_N = probe
    name = resid_site(site, view.n_lm_blocks(params))
    _, aux = view.forward(params, inputs, capture=[name])
    states = rows_at(aux[name], x_N)
    return id_cos(states.reshape(-1, view.grid.cells, states.shape[-1]), target)


def losses(view, params, inputs, answer_B, probe, site: int, target):
    """(answer loss [], ID loss []) on a batch of questions and one probe pair."""
    logits = view.forward(params, inputs)[0]
    answer = -(rows_at(jax.nn.log_softmax(logits, -1), answer_B)).mean()
    return answer, (1.0 - probe_cos(view, params, probe, site, target)).mean()


def make_finetune(view, params, site: int, target, cfg: dict):
    """A jitted `(params, train inputs, answers, probes, batches, pairs, weight) ->
    (params, (loss, answer, id) per step)`: `cfg["steps"]` Adam steps on the leaves
    `cfg["train_only"]` matches in one `lax.scan`, each step's questions and probe pair
    gathered on the device from the index arrays; the ID-loss weight an argument (one
    program for every weight)."""
    mask = path_mask(params, cfg["train_only"])
    opt = optax.masked(optax.adam(cfg["lr"]), mask)
    L = view.grid.cells

    def step(carry, rows, data, weight):
        p, state = carry
        inputs, answer_B, probes = data
        b, pair = rows
        probe = si.take_rows(probes, pair * L + jnp.arange(L))

        def total(q):
            # frozen leaves get no gradient, so XLA computes none for them
            q = jax.tree_util.tree_map(lambda x, m: x if m else jax.lax.stop_gradient(x), q, mask)
            a, i = losses(view, q, si.take_rows(inputs, b), answer_B[b], probe, site, target)
            return a + weight * i, (a, i)

        (loss, (a, i)), g = jax.value_and_grad(total, has_aux=True)(p)
        updates, state = opt.update(g, state, p)
        return (optax.apply_updates(p, updates), state), (loss, a, i)

    @jax.jit
    def run(p, inputs, answer_B, probes, batches, pairs, weight):
        data = (inputs, answer_B, probes)
        (p, _), out = jax.lax.scan(lambda c, r: step(c, r, data, weight), (p, opt.init(p)),
                                   (batches, pairs))  # fmt: skip
        return p, out

    return run


def finetune(view, params, weight: float, train, probes, run, cfg: dict):
    """(params after `cfg["steps"]` steps of `make_finetune`'s `run`, {loss, answer, id}
    per step): each step a batch of `cfg["batch"]` training questions and one probe
    pair, both drawn from `cfg["seed"]` alone (every weight sees the same)."""
    rng = np.random.default_rng([cfg["seed"], 37])
    n_pairs = len(probes[1]) // view.grid.cells
    batches, pairs = [], []
    for _ in range(cfg["steps"]):
        batches.append(rng.choice(len(train.answer_B), cfg["batch"], replace=False))
        pairs.append(rng.integers(n_pairs))
    params, (loss, a, i) = run(params, train.inputs, train.answer_B, probes,
                               np.asarray(batches), np.asarray(pairs), jnp.float32(weight))  # fmt: skip
    return params, dict(zip(("loss", "answer", "id"), jax.device_get((loss, a, i))))


def curve_rows(weight: float, curve: dict) -> list[dict]:
    """curves.csv's rows of one fine-tune's per-step {loss, answer, id}."""
    return [{"weight": weight, "step": t + 1, "loss": float(x), "answer": float(y), "id": float(z)}
            for t, (x, y, z) in enumerate(zip(curve["loss"], curve["answer"], curve["id"]))]  # fmt: skip


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
                lr: float = 5e-5, train_only: str | None = None, log=print) -> dict:  # fmt: skip
    """The ID-loss fine-tunes of a checkpoint (`common.open_checkpoint`), one per weight,
    evaluated before and after; files in `out/id_loss/` (module docstring). `site` None:
    the authors' (`authors_site`); `train_only` None: theirs (the family's `trainable`).
    Returns the tables, the summary and each weight's fine-tuned params."""
    from jaxmech.reports.common import plots_dir

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
    run_steps = make_finetune(view, params, site, target, cfg)
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


def trained_leaves(params, mask: list) -> dict:
    """{leaf index: leaf} of the leaves that train (`mask`: `path_mask`'s leaves): what a
    fine-tune changes, kept so that a resumed run returns the same params."""
    leaves = jax.tree_util.tree_leaves(params)
    return {str(i): np.asarray(x) for i, (x, m) in enumerate(zip(leaves, mask)) if m}


def with_leaves(params, trained: dict):
    """`params` with the leaves of `trained_leaves` put back."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    leaves = [
        jnp.asarray(trained[str(i)]) if str(i) in trained else x for i, x in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(tree, leaves)
