"""Interventions as data.

An `Edits` value is a pytree handed to the one forward pass (`models.dual_encoder`).
Every field is optional, and a field that is absent costs nothing. A batch of
interventions is a batch of `Edits` (vmap over it), so an ablation table or a patching
sweep is one compiled call.

* `term_keep[tower]`  `[H, 9]` float, per head a keep-weight for each term of the
  first layer's pre-softmax attention logits, in `TERMS` order (rows: the query side
  E / P / B, columns: the key side E / P / B). 1 keeps, 0 removes. The forward
  subtracts `sum_t (1 - keep_t) * term_t` from the logits it computes anyway, so an
  all-ones mask subtracts exact zeros (see "No-op edits" below).
* `vp_keep[tower]`    `[H]`, keep-weight on `P W_V` in the first layer's values.
* `rope_keep[tower]`  `[H]` (every block) or `[n_layers, H]` (per block): scales each
  head's rotary angles (towers with rotary positions only). 1 keeps the rotation (and
  multiplies the angles by exactly 1), 0 switches it off: that head's logits are then
  the unrotated `q . k`, i.e. the head is position-blind.
* `replace[name]`     `(where, value)`: the named intermediate becomes
  `where(where, value, x)` (broadcasting), e.g. activation patching.
* `add[name]`         an additive vector / array on the named intermediate (steering).

Names of intermediates: `"{tower}/{point}.{layer}"` with tower `vision` or `text` and
point one of `resid_pre, q, k, v, attn_scores, pattern, z, attn_out, resid_mid,
mlp_out, resid_post`, plus `rot_q, rot_k` in towers with rotary positions (`q`, `k` are
before the rotation, `rot_q`, `rot_k` after it), plus `"{tower}/e_part"` and
`"{tower}/p_part"` (the token and position parts of the input; read-only; `p_part` is
zero in a rotary tower), `"{tower}/readout"` (the CLS/EOT vector before the final
LayerNorm and projection) and `"{tower}/embed"` (the normalised output embedding).
The forward checks every name against the params (`models.checks`): a misspelt name
is a ValueError, not an edit of nothing; term_keep / vp_keep / rope_keep shapes are
checked against the tower's heads and blocks.

No-op edits (all-ones term_keep / vp_keep / rope_keep, a zero `add`): run eagerly,
each op is dispatched on its own and the result equals the plain forward bit for bit
(tested). Under `jax.jit` the edited and the plain forward are two different XLA
programs: XLA may fuse and order their ops differently, so they agree to float
rounding; bit-identity is observed on CPU but not promised. Within one compiled
program (e.g. `analysis.ablate`'s `lax.map` over stacked edits, where "none" is an
all-ones row) every row runs the same code, so the "none" row is the value the
plain evaluation under that program gives.

Axis names (`jaxmech.shapes`): H heads, Y blocks, A stacked edits.
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

    term_keep: dict[str, Any] = dataclasses.field(default_factory=dict)
    vp_keep: dict[str, Any] = dataclasses.field(default_factory=dict)
    rope_keep: dict[str, Any] = dataclasses.field(default_factory=dict)
    replace: dict[str, Any] = dataclasses.field(default_factory=dict)
    add: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __call__(self, name: str, x):
        """Applies the replace / add edits registered for intermediate `name`."""
        return apply_named(self.replace, self.add, name, x)


NO_EDITS = Edits()


def term_mask(n_heads: int, remove: tuple[str, ...] | list[str] = (), heads=None) -> jnp.ndarray:
    """A `[H, 9]` keep-mask removing the named terms (in `heads`, default all).

    Args:
      n_heads: H, the tower's heads (a positive int).
      remove: names from `TERMS` (a list or tuple; a bare string is refused, since
        "EP" would read as the terms "E" and "P").
      heads: head indices in [0, H) (default: all heads).

    Raises:
      ValueError naming the argument for an unknown term, a bad `n_heads` or a head
      out of range.
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads = {n_heads!r}: expected a positive int")
    if isinstance(remove, str):
        raise ValueError(f"remove = {remove!r}: expected a list of term names, e.g. [{remove!r}]")
    unknown = [t for t in remove if t not in TERMS]
    if unknown:
        raise ValueError(f"unknown attention terms {unknown}; known: {', '.join(TERMS)}")
    if heads is not None:
        h = np.asarray(heads)
        if h.ndim != 1 or not np.issubdtype(h.dtype, np.integer):
            raise ValueError(f"heads = {heads!r}: expected a list of int head indices")
        if h.size and (h.min() < 0 or h.max() >= n_heads):
            raise ValueError(f"heads = {h.tolist()}: expected indices in [0, {n_heads - 1}]")
    keep = jnp.ones((n_heads, len(TERMS)), jnp.float32)
    cols = jnp.asarray([TERMS.index(t) for t in remove], jnp.int32)
    rows = jnp.arange(n_heads) if heads is None else jnp.asarray(heads, jnp.int32)
    if len(remove):
        keep = keep.at[rows[:, None], cols[None, :]].set(0.0)
    return keep


# ---------------------------------------------------------------------------
# Edits of the autoregressive VLM (`models.ar_vlm`).

# The first ViT block's logit terms: query-side component x key-side component,
# row-major over content C, row position R, column position K and bias B.
VIT_TERMS = tuple(a + b for a in "CRKB" for b in "CRKB")


@struct.dataclass
class VLMEdits:
    """Interventions on `models.ar_vlm.forward`, as data; every field optional.

    A field left at None (or an empty dict) costs nothing. A batch of edits is a vmap
    over a `VLMEdits` whose array fields are stacked (the None fields stay None).

    * `replace[name]` `(where, value)`: the named intermediate becomes
      `where(where, value, x)` (e.g. patch `"lm/resid_post.1"` at chosen token rows).
    * `add[name]` an array added to the named intermediate (steering).
      Names: `models.ar_vlm.edit_names(params)` (the forward's intermediates).
    * `vit_term_keep` `[H, 16]` keep-weights on the first ViT block's pre-softmax logit
      terms in `VIT_TERMS` order (learned2d / sincos2d only). 1 keeps, 0 removes.
    * `vit_rows`, `vit_cols` float `[L]`: the row / column position of each cell seen by
      the ViT (default: the cell's own; `W - 1 - col` mirrors; fractional values
      interpolate a learned table linearly, and are evaluated as they are by sin-cos
      and rotary codes). Windows stay those of the physical cells. A rope2d ViT also
      takes `[n_layers, L]`: per block (its rotation is applied in every block), e.g.
      a mirror in one block only.
    * `lm_pos_ids` `[S]` (one id per LM token, used for every rotary section) or
      `[3, S]` (time, row, column ids per token): the LM's rotary position ids.
    * `image_order` int `[L]`: the LM reads image token `image_order[i]` at image slot
      i (a permutation; position ids stay with the slots).

    No-op values (all-ones keep, zero add, identity positions / order) give the plain
    forward's output bit for bit when run eagerly (tested).
    """

    replace: dict[str, Any] = dataclasses.field(default_factory=dict)
    add: dict[str, Any] = dataclasses.field(default_factory=dict)
    vit_term_keep: Any = None
    vit_rows: Any = None
    vit_cols: Any = None
    lm_pos_ids: Any = None
    image_order: Any = None

    def __call__(self, name: str, x):
        """Applies the replace / add edits registered for intermediate `name`."""
        return apply_named(self.replace, self.add, name, x)


NO_VLM_EDITS = VLMEdits()


def vit_term_mask(n_heads: int, remove=(), heads=None) -> jnp.ndarray:
    """A `[H, 16]` keep-mask removing the named `VIT_TERMS` (in `heads`, default all).

    Arguments as `term_mask`; e.g. `remove=["CK", "RK", "KK", "BK"]` removes every term
    whose key side is the column position.
    """
    if isinstance(remove, str):
        raise ValueError(f"remove = {remove!r}: expected a list of term names, e.g. [{remove!r}]")
    unknown = [t for t in remove if t not in VIT_TERMS]
    if unknown:
        raise ValueError(f"unknown ViT attention terms {unknown}; known: {', '.join(VIT_TERMS)}")
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads = {n_heads!r}: expected a positive int")
    rows = np.arange(n_heads) if heads is None else np.asarray(heads)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"heads = {heads!r}: expected a list of int head indices")
    if rows.size and (rows.min() < 0 or rows.max() >= n_heads):
        raise ValueError(f"heads = {rows.tolist()}: expected indices in [0, {n_heads - 1}]")
    keep = np.ones((n_heads, len(VIT_TERMS)), np.float32)
    for t in remove:
        keep[rows, VIT_TERMS.index(t)] = 0.0
    return jnp.asarray(keep)
