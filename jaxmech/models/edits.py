"""Interventions as data.

An `Edits` value is a pytree handed to the one forward pass (`models.dual_encoder`).
Every field is optional, and a field that is absent costs nothing. A batch of
interventions is a batch of `Edits` (vmap over it), so an ablation table or a patching
sweep is one compiled call.

* `term_keep[tower]`  `[H, 9]` float, per head a keep-weight for each term of the
  first layer's pre-softmax attention logits, in `TERMS` order (rows: the query side
  E / P / B, columns: the key side E / P / B). 1 keeps, 0 removes. The forward
  subtracts `sum_t (1 - keep_t) * term_t` from the logits it computes anyway, so an
  all-ones mask is exactly the plain forward.
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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import struct

# Query-side component x key-side component, row-major over (E, P, B).
TERMS = ("EE", "EP", "EB", "PE", "PP", "PB", "BE", "BP", "BB")
TOWERS = ("vision", "text")


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
        if name in self.replace:
            where, value = self.replace[name]
            x = jnp.where(where, value, x)
        if name in self.add:
            x = x + self.add[name]
        return x


NO_EDITS = Edits()


def term_mask(n_heads: int, remove: tuple[str, ...] | list[str] = (), heads=None) -> jnp.ndarray:
    """A `[H, 9]` keep-mask removing the named terms (in `heads`, default all).

    `remove` holds names from `TERMS`; unknown names raise a ValueError.
    """
    unknown = [t for t in remove if t not in TERMS]
    if unknown:
        raise ValueError(f"unknown attention terms {unknown}; known: {', '.join(TERMS)}")
    keep = jnp.ones((n_heads, len(TERMS)), jnp.float32)
    cols = jnp.asarray([TERMS.index(t) for t in remove], jnp.int32)
    rows = jnp.arange(n_heads) if heads is None else jnp.asarray(heads, jnp.int32)
    if len(remove):
        keep = keep.at[rows[:, None], cols[None, :]].set(0.0)
    return keep
