"""Paper 003's ID fine-tune as the authors run it (`spatial_finetuning/train.py` with
`run_vision_baseline.sh` / `run_vision_spatial_loss.sh`), on a checkpoint through its
VLM view (`families.vlm_view.VLMView`): the protocol `experiments.id_loss
--checkpoint=DIR --protocol=authors` runs, and `tests/test_authors_finetune.py` holds
equal to their script's per-step losses, gradients and trained weights.

* Their data (`data.datasets.authors_grid`): pictures named "obj1_x1-y1_obj2_x2-y2.png", their
  questions and answers, their object-pair split and batches.
* Their selection (`select`, `vision_mlp_lastk`): among the checkpoint's stored tensors
  (their rules read the names: "vision" / "visual" / "vit" in it, an MLP's name ending
  `.weight`, a block index `.blocks.N.` / `.layers.N.` within the last k), plus every
  tensor named like a projector (`multi_modal_projector`, ...; Qwen's `merger` is not),
  taken greedily by size, largest first, while within `budget_frac` of all parameters.
* Their batch (`render_batch`): the chat template's prompt (the view's, rows
  left-padded) with the assistant's turn appended (the family's `answer_turn`:
  llava-hf's " {answer} ", Qwen's "{answer}<|im_end|>" and a newline); labels every token from position P_i on, P_i row i's
  prompt tokens counted from the padded row's start, as their collator masks (so on a
  padded row the prompt's last pad-count tokens are labels too). Their LLaVA forward
  counts positions 0..S-1 over the padding (transformers' Llama, given no position
  ids), the view from each row's first real token: a shift per row, which rotary
  attention does not see, so the view's ids stay.
* Their loss (`losses`): the LM loss (mean cross-entropy over the labels) plus, with
  universal IDs, weight x (1 - mean cos) of the batch-centred state `hidden_states[layer]`
  (`lm/resid_pre.layer`; the LM's depth: `lm/final`) at the last occurrence of the
  token `tokenize(" " + obj2)[-1]` against the universal ID of obj2's cell, added only
  where below 2 (0 with fewer than 2 states or no cell in the table).
* Their update (`make_step`): gradients clipped to global norm 1 (torch's
  `clip_grad_norm_`: x min(1, 1 / (norm + 1e-6))), AdamW (betas 0.9 / 0.999, eps 1e-8,
  weight decay 0.01) at a linear schedule with int(3% of the steps) warm-up steps
  (`schedule`); a selected tensor outside the loss's graph (LLaVA's last ViT block,
  which its projector does not read) gets no update, as torch's None gradient skips it
  (here: a gradient that is exactly zero).

Axis names (`jaxmech.shapes`): B questions, S tokens, D LM width, V vocabulary.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmech.data.inputs.pixels import read_image
from jaxmech.families.vlm_view import rows_at, with_reply
from jaxmech.models import hub
from jaxmech.models.decoder import unembed
from jaxmech.train import param_paths

IGNORE = -100  # their (transformers') label that is not predicted


# ---- their parameter selection -----------------------------------------------------------

BLOCK = re.compile(r"\.(?:blocks|layers)\.(\d+)\.")
MLP_PARTS = ("mlp.", "up_proj", "down_proj", "gate_proj", "intermediate", "fc1", "fc2", ".ffn")
PROJECTOR_PARTS = ("mm_projector", "multi_modal_projector", "vision_proj", "visual_projector",
                   "image_projector", "resampler")  # fmt: skip


class Selection(NamedTuple):
    """Their chosen tensors (stored names, in their greedy order), all parameters, the
    budget, and the chosen ones' total size."""

    names: list
    total: int
    budget: int
    used: int


def _is_vision(n: str) -> bool:
    return "vision" in n or "visual" in n or "vit" in n


def select(sizes: dict, budget_frac: float = 0.3, last_k: int = 6,
           projector: bool = True) -> Selection:  # fmt: skip
    """Their `vision_mlp_lastk` selection over `sizes` {stored name: elements} (the
    checkpoint's tensors in its file order; module docstring). ValueError naming
    `budget_frac` outside (0, 1] or `last_k` below 0."""
    if not 0 < budget_frac <= 1:
        raise ValueError(f"budget_frac = {budget_frac}: expected a fraction in (0, 1]")
    if last_k < 0:
        raise ValueError(f"last_k = {last_k}: expected 0 or more blocks")
    total = int(sum(sizes.values()))
    budget = max(1, int(total * budget_frac))
    cands = [n for n in sizes if projector and any(k in n for k in PROJECTOR_PARTS)]
    pool = [n for n in sizes if _is_vision(n) and n.endswith(".weight")
            and any(k in n for k in MLP_PARTS)]  # fmt: skip
    block = {n: int(m[1]) if (m := BLOCK.search(n)) else -1 for n in pool}
    pool.sort(key=lambda n: block[n], reverse=True)
    if last_k > 0:
        pool = [n for n in pool if block[n] >= 0]
        if pool:
            keep = max(0, max(block[n] for n in pool) - last_k + 1)
            pool = [n for n in pool if block[n] >= keep]
    chosen, used = [], 0
    for n in sorted(cands + pool, key=lambda n: sizes[n], reverse=True):
        if used + sizes[n] <= budget:
            chosen.append(n)
            used += sizes[n]
        if used >= budget:
            break
    return Selection(chosen, total, budget, used)


def stored_sizes(folder: str) -> dict:
    """{stored name: elements} of the checkpoint's safetensors tensors (headers only)."""
    stored = hub.Stored(hub.weight_files(folder))
    return {k: int(np.prod(stored.shape(k), dtype=np.int64)) for k in stored.entries}


def leaf_map(family, config, names) -> dict:
    """{stored name: (our leaf path, transform to our layout)} of `names` through the
    checkpoint family's key map (`CheckpointFamily.stored_leaves`). ValueError naming a
    tensor that is not one whole leaf of ours."""
    out = family.stored_leaves(config, names)
    for n, entry in out.items():
        if entry is None or entry[0].endswith("]"):
            raise ValueError(f"{n}: not one whole parameter of jaxmech's {family.name} "
                             "layout (a fused or stacked tensor cannot train alone)")  # fmt: skip
    return out


def leaf_mask(params, paths) -> Any:
    """A pytree of Python bools like `params`: True at the leaves `paths`."""
    want = set(paths)
    keep = [p in want for p in param_paths(params)]
    missing = want - set(param_paths(params))
    if missing:
        raise ValueError(f"paths {sorted(missing)}: not leaves of the params")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), keep)


# ---- their batch --------------------------------------------------------------------------


class Batch(NamedTuple):
    """One of their batches, rendered (every leaf leads with B).

    inputs: the view's rendered prompts with the answer turn appended. labels_BxS: int32
    the token each position's previous logits predict, IGNORE where none. id_pos_B:
    int32 the last position of obj2's last piece (-1: absent). target_BxD: float32 the
    universal ID of obj2's cell (zeros where `has_target_B` is False)."""

    inputs: Any
    labels_BxS: Any
    id_pos_B: Any
    target_BxD: Any
    has_target_B: Any


def reply_ids(tokenizer, prompt: str, turn: str) -> list[int]:
    """The tokens `turn` adds after `prompt` (their full conversation's tail). ValueError
    where the prompt's own tokens change."""
    base = tokenizer.encode(prompt).ids
    full = tokenizer.encode(prompt + turn).ids
    if full[: len(base)] != base:
        raise ValueError(f"turn = {turn!r}: appended to the prompt it changes the prompt's "
                         "tokens (the assistant turn must start a new token)")  # fmt: skip
    return full[len(base) :]


def render_batch(view, proc, family, its, table: dict | None = None) -> Batch:
    """`its` (`authors_grid.Item`s) as their collator batches them (module docstring),
    through the view's `render_images` and the checkpoint family's `answer_turn`;
    `table` {(x, y): [D] universal ID} or None."""
    if family.answer_turn is None:
        raise ValueError(f"family = {family.name!r}: no assistant turn known (its "
                         "`answer_turn` is not offered)")  # fmt: skip
    inputs, _ = view.render_images([read_image(it.path) for it in its],
                                   [it.question for it in its], [(it.obj1, it.obj2) for it in its])  # fmt: skip
    replies = [reply_ids(proc.tokenizer, *family.answer_turn(it.question, it.answer))
               for it in its]  # fmt: skip
    if len({len(r) for r in replies}) != 1:
        raise ValueError("answers: their turns differ in length (rows would pad apart)")
    prompt_B = np.asarray(inputs.valid_BxS).sum(1)
    inputs = with_reply(inputs, np.array(replies, np.int32))
    ids = np.asarray(inputs.tokens_BxS)
    S = ids.shape[1]
    labels = np.where(np.arange(S)[None] >= prompt_B[:, None], ids, IGNORE).astype(np.int32)
    words = [proc.tokenizer.encode(" " + it.obj2, add_special_tokens=False).ids[-1] for it in its]
    pos = last_position(ids, words)
    return Batch(inputs, jnp.asarray(labels), jnp.asarray(pos), *_targets(its, table))


def last_position(ids_BxS, token_B) -> np.ndarray:
    """[B] int32 each row's last position holding its token, -1 where none (their
    `token_positions[-1]`: the word's last occurrence, the answer turn included)."""
    hit = np.asarray(ids_BxS) == np.asarray(token_B)[:, None]
    last = hit.shape[1] - 1 - np.argmax(hit[:, ::-1], 1)
    return np.where(hit.any(1), last, -1).astype(np.int32)


def _targets(its, table):
    if not table:
        return jnp.zeros((len(its), 1), jnp.float32), jnp.zeros(len(its), bool)
    D = len(next(iter(table.values())))
    got = [table.get(it.coords[2:]) for it in its]
    t = np.stack([np.zeros(D, np.float32) if g is None else np.asarray(g, np.float32) for g in got])
    return jnp.asarray(t), jnp.asarray([g is not None for g in got])


def id_table(universal_LxCxD, cells_Cx2, layers, layer: int) -> dict:
    """{(x, y): [D]} the universal IDs at `layer` (the derivation's arrays, as
    `spatial_ids*.npz` holds them). ValueError naming `layer` where it has none."""
    layers = [int(x) for x in layers]
    if layer not in layers:
        raise ValueError(f"layer = {layer}: the universal IDs hold layers {layers}")
    table = np.asarray(universal_LxCxD)[layers.index(layer)]
    return {tuple(int(v) for v in c): table[i] for i, c in enumerate(np.asarray(cells_Cx2))}


# ---- their loss and update ----------------------------------------------------------------


def hidden_site(layer: int, n_blocks: int) -> str:
    """Their `hidden_states[layer]`: the residual entering block `layer`, or the final
    norm's output at layer = n_blocks."""
    if not 0 <= layer <= n_blocks:
        raise ValueError(f"layer = {layer}: expected an LM layer in [0, {n_blocks}]")
    return f"lm/resid_pre.{layer}" if layer < n_blocks else "lm/final"


def lm_loss(logits_BxSxV, labels_BxS) -> jax.Array:
    """[] the mean next-token cross-entropy over the labelled positions (float32)."""
    logits, labels = logits_BxSxV[:, :-1].astype(jnp.float32), labels_BxS[:, 1:]
    keep = labels != IGNORE
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, jnp.where(keep, labels, 0)[..., None], -1)[..., 0]
    return jnp.sum(nll * keep) / jnp.maximum(keep.sum(), 1)


def id_loss(x_BxSxD, batch: Batch) -> jax.Array:
    """[] their spatial-ID loss: 1 - mean cos of the found states, centred over them,
    with their cells' universal IDs; 0 with fewer than 2 found or no cell known."""
    found = batch.id_pos_B >= 0
    s = rows_at(x_BxSxD, jnp.maximum(batch.id_pos_B, 0)).astype(jnp.float32)
    n = found.sum()
    centred = s - jnp.sum(s * found[:, None], 0) / jnp.maximum(n, 1)
    t = batch.target_BxD
    norms = jnp.linalg.norm(centred, axis=-1) * jnp.linalg.norm(t, axis=-1)
    cos = jnp.sum(centred * t, -1) / jnp.maximum(norms, 1e-8)
    valid = found & batch.has_target_B
    loss = 1.0 - jnp.sum(cos * valid) / jnp.maximum(valid.sum(), 1)
    return jnp.where((n < 2) | (valid.sum() == 0), 0.0, loss)


def losses(view, params, batch: Batch, layer: int | None, weight):
    """(total [], LM loss [], ID loss []) of one batch; `layer` None: no ID loss."""
    sites = ["lm/final"] + ([] if layer is None else [hidden_site(layer, view.n_lm_blocks(params))])
    _, aux = view.forward(params, batch.inputs, capture=sites)
    lm = lm_loss(unembed(params["lm"], aux["lm/final"]), batch.labels_BxS)
    if layer is None:
        return lm, lm, jnp.zeros(())
    i = id_loss(aux[sites[1]], batch)
    return lm + jnp.where(i < 2.0, weight * i, 0.0), lm, i


def schedule(lr: float, total: int):
    """Their learning rate at each optimizer step (transformers'
    `get_linear_schedule_with_warmup` with int(0.03 x total) warm-up steps)."""
    warm = int(0.03 * total)

    def at(count):
        t = jnp.asarray(count, jnp.float32)
        up = t / max(1, warm)
        down = jnp.maximum(0.0, (total - t) / max(1, total - warm))
        return lr * jnp.where(t < warm, up, down)

    return at


def optimizer(mask, lr: float, total: int):
    """Their AdamW (betas 0.9 / 0.999, eps 1e-8, weight decay 0.01) on the `mask` leaves."""
    return optax.masked(optax.adamw(schedule(lr, total), b1=0.9, b2=0.999, eps=1e-8,
                                    weight_decay=0.01), mask)  # fmt: skip


def clipped(g, mask):
    """(g scaled as torch's `clip_grad_norm_(max_norm=1)` scales it: x min(1, 1 /
    (norm + 1e-6)), the `mask` leaves' gradients, their global norm)."""
    leaves = [x for x, m in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(mask)) if m]
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
    return (
        jax.tree_util.tree_map(lambda x: x * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), g),
        leaves,
        norm,
    )


def make_step(view, mask, opt, layer: int | None):
    """A jitted `(params, opt state, batch, weight) -> (params, opt state, record)`: their
    step (module docstring); record {loss, lm, id, norm, grads: the `mask` leaves'
    gradients before clipping, in `tree_leaves` order}."""

    def total(q, batch, weight):
        # frozen leaves get no gradient, so XLA computes none for them
        q = jax.tree_util.tree_map(lambda x, m: x if m else jax.lax.stop_gradient(x), q, mask)
        t, lm, i = losses(view, q, batch, layer, weight)
        return t, (lm, i)

    def skip_unreached(new, old, g):
        # a tensor torch's backward never reached (None gradient) is skipped by AdamW
        return jnp.where(jnp.any(g != 0), new, old)

    @jax.jit
    def step(params, state, batch, weight):
        (loss, (lm, i)), g = jax.value_and_grad(total, has_aux=True)(params, batch, weight)
        g, leaves, norm = clipped(g, mask)
        updates, state = opt.update(g, state, params)
        new = jax.tree_util.tree_map(
            skip_unreached, optax.apply_updates(params, updates), params, g
        )
        return new, state, dict(loss=loss, lm=lm, id=i, norm=norm, grads=leaves)

    return step
