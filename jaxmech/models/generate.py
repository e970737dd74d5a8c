"""Greedy generation for the checkpoint families, with a key / value cache of fixed size.

    prefill   the family's forward on the prompts (one compiled program): the logits of
              the first new token and every LM block's rotated keys and values, stacked
              per block and padded to S + max_new_tokens rows
    step      one generated token through the LM blocks against the cache (one compiled
              program, the same for every step: the token's slot and position are data;
              its blocks under one `lax.scan`, the cache their per-block inputs)

A family supplies what is its own through `decoding(config) -> Decoding`: its forward, the
LM's block count, norm eps and activation, and the rotary angles of generated token k.
Every family here places generated token k at position id max(prompt's ids) + 1 + k in
each row (Qwen's M-RoPE: all three ids; what the reference's `rope_deltas` give; LLaVA
and InternVL: the row's real tokens counted on, as `generate`'s attention-mask
cumsum), `continued_ids`. Qwen3-VL's DeepStack features are added at image tokens only,
all in the prompt, so the step has no injection.

Rows are left-padded (`encoded.inputs.valid_BxS` False at padding; padding is never
attended). A row stops at its first end-of-sequence token; the tokens after it are
`pad_token_id`, as the reference's `generate` pads them, and the loop ends once every
row has stopped.

Numerics as the family's forward (`models.decoder`); the step's attention reads the
cache's L slots (those not yet written masked) and then the new row, the same keys as a
full forward in another order.

Axis names (`jaxmech.shapes`): B sequences, S prompt tokens, N new tokens, L = S + N cache
slots, Y LM blocks, D width, Hkv key / value heads, Dh head width, R rotary pairs, V
vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.models import layout
from jaxmech.models.decoder import (
    ACT,
    RESUME_SITES,
    Sites,
    block_after,
    block_forward,
    rms_norm,
    unembed,
)
from jaxmech.models.edits import NO_EDITS
from jaxmech.models.scan import LAYER, block_row, in_place

__all__ = ["Decoding", "Generation", "cached_blocks", "continued_ids", "decode_step", "generate",
           "generation_ids", "judge_reply", "reply_text", "sequences", "text_verdict"]  # fmt: skip


class Decoding(NamedTuple):
    """What generation needs of a family's LM (a family's `decoding(config)`).

    forward: the family model's forward(params, inputs, edits, *, config, capture,
      last_row) (`families.*.model.forward`).
    n_layers, eps, act: the LM's block count, RMSNorm eps and MLP activation
      (`models.decoder.ACT`'s name).
    angles(inputs, step) -> [B, 1, R] float32: the rotary angles of generated token
      `step` (0: the first new token; a traced int32 scalar) of each row of `inputs`.
    step: optional, a family's own `decode_step(params, inputs, token_B, cache, valid_BxL,
      step)` (same contract) where its LM blocks are not `models.decoder`'s (Gemma-3's:
      post norms, sliding-window layers; its blocks through `cached_blocks` too); None:
      `decode_step`'s blocks.
    """

    forward: Callable
    n_layers: int
    eps: float
    act: str
    angles: Callable
    step: Callable | None = None


class Generation(NamedTuple):
    """`generate`'s output.

    tokens_BxN: int32 the new tokens of each row; after a row's end-of-sequence token,
      `pad_token_id` (also past the step where every row had stopped).
    n_B: int32 each row's new tokens up to and with its end-of-sequence token (N where
      it has none).
    logits_BxNxV: float32 the logits each new token was chosen from (NaN past the step
      where every row had stopped), or None (`logits=False`).
    """

    tokens_BxN: np.ndarray
    n_B: np.ndarray
    logits_BxNxV: np.ndarray | None


def continued_ids(pos, step):
    """[B] int32 the position id of generated token `step` in each row: one past the
    largest of the prompt's ids `pos` ([B, S] or [B, 3, S]; padding 0) and `step` on."""
    pos = jnp.asarray(pos)
    return jnp.max(pos.reshape(pos.shape[0], -1), 1).astype(jnp.int32) + 1 + step


def _model_of(params, model: int | None):
    """`params` (model None), or model `model`'s of params stacked over models: sliced
    inside a compiled call, where it copies nothing."""
    return params if model is None else jax.tree_util.tree_map(lambda x: x[model], params)


@functools.partial(jax.jit, static_argnames=("family_decoding", "config", "n_new", "model"))
def _prefill(params, inputs, edits, family_decoding, config, n_new: int, model=None):
    """(logits [B, V] float32 of the first new token, the cache: (keys, values) each
    [Y, B, S + n_new, Hkv, Dh], block i's at index i, the rows past S zero; valid_BxL,
    the prompt's real tokens)."""
    d = family_decoding(config)
    params = _model_of(params, model)
    logits, aux = d.forward(params, inputs, edits, config=config, capture=RESUME_SITES,
                            last_row=True)  # fmt: skip
    # stacked per block: the step's blocks scan over them (`cached_blocks`)
    cache = tuple(
        jnp.pad(jnp.stack([aux[f"{name}.{i}"] for i in range(d.n_layers)]),
                ((0, 0), (0, 0), (0, n_new), (0, 0), (0, 0)))
        for name in RESUME_SITES
    )  # fmt: skip
    valid = jnp.pad(jnp.asarray(inputs.valid_BxS, bool), ((0, 0), (0, n_new)))
    # made here, not on the host, so the step's inputs are alike at every step (committed
    # arrays, one compiled step)
    return logits.astype(jnp.float32), cache, valid


def cached_blocks(lm, x, cache, slot, n_layers: int, block):
    """(x [B, 1, D] after the LM's blocks, the cache with each block's keys and values
    of this row written at `slot`): one generated row through stacked blocks
    `lm["blocks"]` against `cache` = (keys, values) each [Y, B, S + N, Hkv, Dh].
    `block(weights, x, site, i, cache_i, layer)` runs one block (i its index in site
    names: an int, or `models.scan.LAYER` under the scan; `layer` an int or traced)
    reading (keys, values) `cache_i` [B, S + N, Hkv, Dh] and recording `RESUME_SITES`.

    One `lax.scan` over the blocks with the cache as its per-block inputs and the new
    row's keys and values as its outputs (one compiled block, as the forward's
    `models.decoder.stack`); stacked low-precision weights on a CPU run unrolled
    (`models.scan.in_place`), rows (`layout.Rows`) scan, each block's read by a switch."""
    blocks = lm[layout.BLOCKS]
    if in_place(blocks):
        # the step has no edits: a plain `Sites` records a scanned block's keys and values
        # under their `LAYER` names, returned as the scan's outputs [Y, B, 1, Hkv, Dh]
        def step(x, inp):
            i, cache_i = inp
            site = Sites(NO_EDITS, RESUME_SITES)
            y = block(block_row(blocks, i), x, site, LAYER, cache_i, i)
            return y.astype(x.dtype), tuple(site.aux[f"{n}.{LAYER}"] for n in RESUME_SITES)

        x, new = jax.lax.scan(step, x, (jnp.arange(n_layers, dtype=jnp.int32), cache))
    else:
        site = Sites(NO_EDITS, RESUME_SITES)
        for i in range(n_layers):
            x = block(block_after(lm, i, x), x, site, i, tuple(c[i] for c in cache), i)
        new = [jnp.stack([site.aux[f"{n}.{i}"] for i in range(n_layers)]) for n in RESUME_SITES]
    return x, tuple(
        jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), slot, 2)
        for c, n in zip(cache, new)
    )


def decode_step(params, inputs, token_B, cache, valid_BxL, step, d: Decoding):
    """One generated token through the LM: (logits [B, V] float32 of the next token, the
    cache with this token's keys and values written at slot S + step, valid_BxL with
    that slot set). `token_B` is generated token `step` (a traced int32 scalar);
    `cache` (keys, values) each [Y, B, S + N, Hkv, Dh] (`_prefill`'s); `valid_BxL`
    marks the slots a new token attends to (the prompt's real tokens and the tokens
    generated before it)."""
    if d.step is not None:  # the family's own blocks (`Decoding.step`)
        return d.step(params, inputs, token_B, cache, valid_BxL, step)
    lm = params["lm"]
    S = inputs.tokens_BxS.shape[1]
    x = lm["E"][token_B][:, None]
    angles = d.angles(inputs, step)
    B = x.shape[0]
    mask = jnp.concatenate([valid_BxL, jnp.ones((B, 1), bool)], 1)[:, None, :]  # cache, self

    def block(w, x, site, i, cache_i, layer):
        return block_forward(w, x, angles, mask, site, "lm", i, d.eps, ACT[d.act], cache=cache_i)

    slot = S + step
    x, cache = cached_blocks(lm, x, cache, slot, d.n_layers, block)
    logits = unembed(lm, rms_norm(x, lm["lnf_w"], d.eps)[:, 0]).astype(jnp.float32)
    return logits, cache, valid_BxL.at[:, slot].set(True)


def _choose(logits_BxV, done_B, eos_E, pad):
    """(the greedy token of each row, pad where the row had stopped; the rows stopped)."""
    token = jnp.where(done_B, pad, jnp.argmax(logits_BxV, -1).astype(jnp.int32))
    return token, done_B | (token[:, None] == eos_E[None, :]).any(1)


@functools.partial(jax.jit, static_argnames=("family_decoding", "config", "model"))
def _step(params, inputs, token_B, done_B, cache, valid_BxL, step, eos_E, pad,
          family_decoding, config, model=None):  # fmt: skip
    d = family_decoding(config)
    params = _model_of(params, model)
    logits, cache, valid_BxL = decode_step(params, inputs, token_B, cache, valid_BxL, step, d)
    token_B, done_B = _choose(logits, done_B, eos_E, pad)
    return token_B, done_B, logits, cache, valid_BxL


@jax.jit
def _first(logits_BxV, eos_E, pad):
    return _choose(logits_BxV, jnp.zeros(logits_BxV.shape[0], bool), eos_E, pad)


def _ids(value, name: str) -> list[int]:
    values = [value] if isinstance(value, (int, np.integer)) else list(value)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0
               for v in values):  # fmt: skip
        raise ValueError(f"{name} = {value!r}: expected a token id (int >= 0) or a list of them")
    return [int(v) for v in values]


def generation_ids(folder: str) -> tuple[list[int], int]:
    """(the end-of-sequence ids, the pad id) the reference's `generate` reads from a
    checkpoint folder: generation_config.json's where it has them, else config.json's
    (its own fields, then its text_config's). No end-of-sequence id: [] (no row stops
    early); no pad id: the first end-of-sequence id, else 0."""
    sources = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                c = json.load(f)
            sources += [c, c.get("text_config") or {}]
    eos = next((s["eos_token_id"] for s in sources if s.get("eos_token_id") is not None), None)
    eos = [] if eos is None else _ids(eos, f"{folder}: eos_token_id")
    pad = next((s["pad_token_id"] for s in sources if s.get("pad_token_id") is not None), None)
    return eos, int(pad) if pad is not None else (eos[0] if eos else 0)


def _check(encoded, max_new_tokens, greedy, edits):
    inputs = getattr(encoded, "inputs", None)
    if not all(hasattr(inputs, f) for f in ("tokens_BxS", "valid_BxS")):
        raise ValueError(f"encoded: expected a processor's output (model.encode(images, "
                         f"questions), with .inputs), got {type(encoded).__name__}")  # fmt: skip
    if (
        not isinstance(max_new_tokens, (int, np.integer))
        or isinstance(max_new_tokens, bool)
        or (max_new_tokens < 1)
    ):
        raise ValueError(f"max_new_tokens = {max_new_tokens!r}: expected an int >= 1")
    if greedy is not True:
        raise ValueError(f"greedy = {greedy!r}: only greedy decoding (greedy=True) is "
                         "implemented")  # fmt: skip
    if edits is not None and getattr(edits, "lm_pos_ids", None) is not None:
        raise ValueError("edits.lm_pos_ids: generation places new tokens after the prompt's "
                         "own position ids; an edit of them is not supported")  # fmt: skip
    valid = np.asarray(inputs.valid_BxS, bool)
    if valid.ndim != 2 or not valid[:, -1].all():
        raise ValueError("encoded: expected left-padded prompts (every row's last token "
                         "real: inputs.valid_BxS[:, -1] all True)")  # fmt: skip
    return inputs


def _check_model(params, model) -> None:
    if model is None:
        return
    K = jax.tree_util.tree_leaves(params)[0].shape[0]
    if not isinstance(model, (int, np.integer)) or isinstance(model, bool) or not 0 <= model < K:
        raise ValueError(f"model = {model!r}: expected None (one model's params) or the index "
                         f"of a model of the params stacked over {K}")  # fmt: skip


def generate(family_decoding, config, params, encoded, *, max_new_tokens: int,
             greedy: bool = True, eos_token_id=None, pad_token_id=None, edits=None,
             logits: bool = False, folder: str | None = None,
             model: int | None = None) -> Generation:  # fmt: skip
    """Greedy generation after each prompt of `encoded`, as the reference's `generate`
    with do_sample=False (module docstring): the family's `FAMILY.generate` with its
    `decoding` bound, `jaxmech.Model.generate`.

    Args:
      family_decoding: the family's `decoding(config) -> Decoding` (a module-level
        function: it and `config` key the compiled programs).
      config, params: the model's (params in any dtype; the step computes in it).
      encoded: the family processor's output (`model.encode`), rows left-padded.
      max_new_tokens: N >= 1, the most tokens generated per row (the cache holds S + N).
      greedy: True (the only mode: the highest logit, the first on ties as argmax).
      eos_token_id: an id or ids that end a row (None: `generation_ids(folder)`, or
        none without a folder).
      pad_token_id: what follows a row's end (None: `generation_ids(folder)`'s, or 0).
      edits: `Edits` applied to the prompts' forward only (the prefill; the new tokens
        read its keys and values, as the authors' steering hooks act on the prompt
        only); `lm_pos_ids` refused.
      logits: also return each step's logits [B, N, V] (host memory B N V floats).
      folder: the checkpoint folder the default ids are read from.
      model: None (`params` one model's), or an index k: `params` stacked over models
        ([K, ...] leaves, a report's `LoadedRun.params`), model k's read inside the
        compiled prefill and step (an eager `x[k]` copies every weight: 4.1 GB at
        Qwen2-VL-2B's size).

    Returns a `Generation`. Raises ValueError naming the argument for an `encoded` that
    is not a processor's output or not left-padded, max_new_tokens < 1, greedy=False,
    bad ids, a `model` outside the stacked models.
    """
    inputs = _check(encoded, max_new_tokens, greedy, edits)
    _check_model(params, model)
    default_eos, default_pad = generation_ids(folder) if folder else ([], 0)
    eos = default_eos if eos_token_id is None else _ids(eos_token_id, "eos_token_id")
    if pad_token_id is not None and len(_ids(pad_token_id, "pad_token_id")) != 1:
        raise ValueError(f"pad_token_id = {pad_token_id!r}: expected one token id")
    pad = default_pad if pad_token_id is None else _ids(pad_token_id, "pad_token_id")[0]
    N = int(max_new_tokens)
    inputs = jax.tree.map(jnp.asarray, inputs)
    B, S = inputs.tokens_BxS.shape
    eos_E, pad_ = jnp.asarray(eos, jnp.int32).reshape(-1), jnp.int32(pad)
    out = np.full((B, N), pad, np.int32)
    model = None if model is None else int(model)  # a static argument: one per index
    first_logits, cache, valid = _prefill(params, inputs, NO_EDITS if edits is None else edits,
                                          family_decoding, config, N, model)  # fmt: skip
    token, done = _first(first_logits, eos_E, pad_)
    step_logits = [first_logits]
    out[:, 0] = np.asarray(token)
    for k in range(1, N):
        if bool(np.asarray(done).all()):
            break
        token, done, lg, cache, valid = _step(params, inputs, token, done, cache, valid,
                                              jnp.int32(k - 1), eos_E, pad_, family_decoding,
                                              config, model)  # fmt: skip
        out[:, k] = np.asarray(token)
        if logits:
            step_logits.append(lg)
    kept = None
    if logits:
        got = np.stack([np.asarray(x) for x in step_logits], 1)
        kept = np.full((B, N, got.shape[-1]), np.nan, np.float32)
        kept[:, : got.shape[1]] = got
    stops = np.isin(out, eos)
    n_B = np.where(stops.any(1), stops.argmax(1) + 1, N).astype(np.int32)
    return Generation(out, n_B, kept)


# the markers the authors split a decoded sequence at (`compute_coco_stats.py`): the reply
# is what follows the last of each, in this order
REPLY_MARKERS = ("assistant", "ASSISTANT", "<start_of_turn>model")


def reply_text(tokenizer, ids) -> str:
    """The lower-cased reply in `ids` (a prompt's real tokens and its generated ones, or
    the generated ones alone) as the authors read it: decoded with special tokens kept
    (`tokenizers.Tokenizer.decode(..., skip_special_tokens=False)`, as transformers'
    `decode` by default), the text after the last "assistant", then after the last
    "ASSISTANT", then after the last "<start_of_turn>model", lower-cased."""
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    for marker in REPLY_MARKERS:
        text = text.split(marker)[-1]
    return text.lower()


def judge_reply(tokenizer, ids, correct: str, wrong: str) -> str:
    """The authors' verdict on a generated reply (`compute_coco_stats.py`'s
    `compute_verdict`): "correct" where the reply (`reply_text`) contains the word
    `correct` and not `wrong`, "wrong" where the reverse, else "nonsense". Containment
    is of the substring, as theirs ("leftmost" contains "left"); words lower-case."""
    return text_verdict(reply_text(tokenizer, ids), correct, wrong)


def text_verdict(text: str, correct: str, wrong: str) -> str:
    """`judge_reply`'s verdict on a reply already read (`reply_text`, lower-case)."""
    has_c, has_w = correct.lower() in text, wrong.lower() in text
    if has_c and not has_w:
        return "correct"
    if has_w and not has_c:
        return "wrong"
    return "nonsense"


def sequences(encoded, generation: Generation) -> list[np.ndarray]:
    """Each row's prompt (its real tokens) followed by its new tokens up to and with its
    end-of-sequence token: what the authors' `generate(...).sequences[0]` holds for a
    batch of one, the input `judge_reply` reads."""
    tokens = np.asarray(encoded.inputs.tokens_BxS)
    valid = np.asarray(encoded.inputs.valid_BxS, bool)
    return [np.concatenate([t[v], g[:n]]) for t, v, g, n in
            zip(tokens, valid, generation.tokens_BxN, generation.n_B)]  # fmt: skip
