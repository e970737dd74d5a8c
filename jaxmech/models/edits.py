"""Interventions as data: one `Edits` type for every model family.

An `Edits` value is a pytree handed to a family's one forward pass. Every field is
optional, and a field that is absent costs nothing. A batch of interventions is a batch
of `Edits` (vmap over it, the absent fields stay absent), so an ablation table or a
patching sweep is one compiled call. A family reads the fields that name its parts and
refuses the others by name (its input checks), so a misspelt part or a field the family
does not have is a ValueError, not an edit of nothing.

Every family:

* `replace[name]`     `(where, value)`: the named intermediate becomes
  `where(where, value, x)` (broadcasting), e.g. activation patching.
* `add[name]`         an additive array on the named intermediate (steering).

  Names of intermediates: `"{part}/{point}.{layer}"` in TransformerLens's words, points
  `resid_pre, q, k, v, attn_scores, pattern, z, attn_out, resid_mid, mlp_out,
  resid_post` (plus `rot_q, rot_k` where q and k are rotated), with parts and extra
  sites of the family's own (a VLM's `vit`, `lm`, and e.g. `proj/out`, `lm/final`).
  Each family lists its names: `sites(config, params)` in its contract
  (`families.contract`), `Model.sites()` on a handle.
* `term_keep[part]`   `[H, T]` float, per head a keep-weight for each term of the first
  block's pre-softmax attention logits: the dual encoder's towers take `TERMS` (query
  side E / P / B x key side E / P / B), the toy VLM's `vit` takes `VIT_TERMS` (content,
  row, column, bias). 1 keeps, 0 removes. The forward subtracts `sum_t (1 - keep_t)
  term_t` from the logits it computes anyway, so an all-ones mask subtracts zeros.

Dual encoder (per tower):

* `vp_keep[tower]`    `[H]`, keep-weight on `P W_V` in the first layer's values.
* `rope_keep[tower]`  `[H]` (every block) or `[n_layers, H]` (per block): scales each
  head's rotary angles (towers with rotary positions only). 1 keeps the rotation, 0
  switches it off: that head's logits are then the unrotated `q . k`.

VLMs, any family (the position overrides of paper 004 and the image tokens' order; a
family that has no use for a field, e.g. a checkpoint for the term and per-head rotary
fields above, refuses it by name). A new family's own kind of edit is a `replace` or
`add` at one of its sites, so this record does not grow with the families:

* `vit_rows`, `vit_cols` float `[P]`: the row / column position each ViT token sees
  (default: its own; `W - 1 - col` mirrors; fractional values interpolate a learned
  table linearly and are evaluated as they are by sin-cos and rotary codes). Windows
  stay those of the physical tokens. A rotary ViT also takes `[n_blocks, P]`: per block
  (one that also reads a learned table at its input, `[1 + n_blocks, P]`: row 0 the
  table's, so each mechanism can be edited alone).
* `lm_pos_ids` `[S]` (one id per LM token, for every rotary section) or `[3, S]` (time,
  row, column ids per token): the LM's rotary position ids.
* `image_order` int `[I]`: the LM reads image token `image_order[i]` at image slot i (a
  permutation; position ids stay with the slots).

No-op edits (all-ones keep-weights, a zero `add`, identity positions / order): run
eagerly, each op is dispatched on its own and the result equals the plain forward bit
for bit (tested per family). Under `jax.jit` the edited and the plain forward are two
different XLA programs: XLA may fuse and order their ops differently, so they agree to
float rounding; bit-identity is observed on CPU but not promised. Within one compiled
program (e.g. `analysis.ablate`'s `lax.map` over stacked edits, where "none" is an
all-ones row) every row runs the same code, so the "none" row is the value the plain
evaluation under that program gives.

Axis names (`jaxmech.shapes`): H heads, Y blocks, A stacked edits, P ViT tokens, S LM
tokens, I image tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct

# Query-side component x key-side component, row-major over (E, P, B).
TERMS = ("EE", "EP", "EB", "PE", "PP", "PB", "BE", "BP", "BB")
TOWERS = ("vision", "text")


def apply_named(replace: dict, add: dict, name: str, x):
    """`x` after the `replace[name] = (where, value)` and `add[name]` edits, if any."""
    if name in replace:
        where, value = replace[name]
        x = jnp.where(where, value, x)
    if name in add:
        x = x + add[name]
    return x


@struct.dataclass
class Edits:
    """Named interventions; see the module docstring."""

    replace: dict[str, Any] = dataclasses.field(default_factory=dict)
    add: dict[str, Any] = dataclasses.field(default_factory=dict)
    term_keep: dict[str, Any] = dataclasses.field(default_factory=dict)
    vp_keep: dict[str, Any] = dataclasses.field(default_factory=dict)
    rope_keep: dict[str, Any] = dataclasses.field(default_factory=dict)
    vit_rows: Any = None
    vit_cols: Any = None
    lm_pos_ids: Any = None
    image_order: Any = None

    def __call__(self, name: str, x):
        """Applies the replace / add edits registered for intermediate `name`."""
        return apply_named(self.replace, self.add, name, x)


NO_EDITS = Edits()


def term_mask(n_heads: int, remove: tuple[str, ...] | list[str] = (), heads=None, terms=None):
    """A `[H, T]` keep-mask removing the named terms (in `heads`, default all).

    Args:
      n_heads: H, the part's heads (a positive int).
      remove: names from `terms` (a list or tuple; a bare string is refused, since
        "EP" would read as the terms "E" and "P").
      heads: head indices in [0, H) (default: all heads).
      terms: the part's term names: `TERMS` (default: a dual-encoder tower) or
        `VIT_TERMS` (the toy VLM's ViT), e.g. `remove=["CK", "RK", "KK", "BK"]` removes
        every ViT term whose key side is the column position.

    Raises:
      ValueError naming the argument for an unknown term, a bad `n_heads` or a head
      out of range.
    """
    terms = TERMS if terms is None else tuple(terms)
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads = {n_heads!r}: expected a positive int")
    if isinstance(remove, str):
        raise ValueError(f"remove = {remove!r}: expected a list of term names, e.g. [{remove!r}]")
    unknown = [t for t in remove if t not in terms]
    if unknown:
        raise ValueError(f"unknown attention terms {unknown}; known: {', '.join(terms)}")
    rows = np.arange(n_heads) if heads is None else np.asarray(heads)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"heads = {heads!r}: expected a list of int head indices")
    if rows.size and (rows.min() < 0 or rows.max() >= n_heads):
        raise ValueError(f"heads = {rows.tolist()}: expected indices in [0, {n_heads - 1}]")
    keep = np.ones((n_heads, len(terms)), np.float32)
    for t in remove:
        keep[rows, terms.index(t)] = 0.0
    return jnp.asarray(keep)


# The first ViT block's logit terms of the toy VLM: query-side component x key-side
# component, row-major over content C, row position R, column position K and bias B.
VIT_TERMS = tuple(a + b for a in "CRKB" for b in "CRKB")
