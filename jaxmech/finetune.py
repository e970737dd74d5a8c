"""Fine-tuning a VLM's params with paper 003's spatial-ID loss, through its view
(`families.vlm_view.VLMView`): any family with a view, a loaded checkpoint included.

Only the parameters matched by a `train_only` pattern train (`train.path_mask`), with
Adam (no weight decay), one `lax.scan` over the steps. The loss on a batch of pair
questions (`data.spec.pair_questions`, drawn as pictures) is

    -log p(answer word)  +  weight * mean(1 - cos(ID_pred, ID_true))

ID_pred: for one object pair per step, X drawn at every cell with Y where it was (at
the next cell when X lands on it; `pair_probes`), the state at X's word at LM site
`site`, centred over the cells (`models.id_loss.id_cos`). ID_true: the model's own
universal ID at that site, extracted before fine-tuning from probes of every shape
(`targets`), as the toy's fine-tune does. The ID-loss weight is an argument of the
compiled program, so every weight shares one compile; `trained_leaves` /
`with_leaves` keep and restore what a fine-tune changed (a resumable store's entry).
`with_remat` gives a model whose scanned blocks are rematerialised under a gradient
(both fine-tunes' `remat` option: "on" is `REMAT_ON`).

The report that runs it (per weight, evaluated before and after, resumable):
`reports.id_finetune`.

Axis names (`jaxmech.shapes`): B questions, P probe pairs, L cells, D LM width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmech.analysis import spatial_ids as si
from jaxmech.data.spec import SceneSpec
from jaxmech.families.vlm_view import resid_site, rows_at
from jaxmech.models.id_loss import id_cos  # the same cosine as the toy's loss
from jaxmech.models.scan import REMAT
from jaxmech.train import path_mask

# the scanned blocks' remat policy `remat="on"` means (`models.scan.REMAT`), chosen by
# measurement (BUILD_NOTES, section 8, "Remat")
REMAT_ON = "full"
REMAT_OPTIONS = ("on", "off") + tuple(k for k in REMAT if k != "off")


def remat_setting(remat: str) -> str:
    """The `models.scan.REMAT` policy name of a fine-tune's `remat` option: "on" (`REMAT_ON`),
    "off", or a policy's own name; a ValueError naming `remat` otherwise."""
    if remat not in REMAT_OPTIONS:
        raise ValueError(f"remat = {remat!r}: expected one of "
                         + ", ".join(map(repr, REMAT_OPTIONS)))  # fmt: skip
    return REMAT_ON if remat == "on" else remat


def with_remat(model, remat: str, log=print):
    """`model` (a `model.Model` with a family config) whose forward rematerialises each
    scanned block under a gradient as `remat` asks (`remat_setting`; the config's
    `remat` field), the choice logged."""
    policy = remat_setting(remat)
    kept = "keeps its activations for" if policy == "off" else "runs again in"
    log(f"remat: {remat} ({policy}): each scanned ViT / LM block {kept} the backward")
    return dataclasses.replace(model, config=dataclasses.replace(model.config, remat=policy))


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
