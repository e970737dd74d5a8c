"""Ordering XLA's work without changing its values: `tie(tree, x)` makes every leaf of
`tree` depend on `x`, so XLA cannot start on it before `x` exists.

Why: XLA schedules independent work freely, and on CPU it has two habits that cost
memory at a real model's size. It computes a bfloat16 / float16 dot in float32 and
converts the weights to do so; those conversions depend on the params alone, so it
runs them all at the start and holds every block's float32 copy at once. And a table's
independent runs (patched forwards) may be interleaved, each holding its own
intermediates. Optimization barriers do not help: the CPU pipeline removes them before
it schedules. Adding a zero computed from `x` to the leaves' bits does (`zero_after`),
so the values are unchanged, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def zero_after(x) -> jax.Array:
    """A scalar uint32 0 that depends on `x` (no gradient flows into x): the bits of
    1 + 0 x[0] (exactly 1.0 for a finite x[0]; 1.0 by choice otherwise) less those of
    1.0, so no simplification can see that it is 0."""
    v = jax.lax.stop_gradient(jnp.asarray(x).reshape(-1)[0]).astype(jnp.float32)
    one = jnp.where(jnp.isfinite(v), 1 + 0 * v, jnp.float32(1))
    return jax.lax.bitcast_convert_type(one, jnp.uint32) - jnp.uint32(0x3F800000)


@jax.custom_jvp
def _tied(w, zero):
    """w with `zero` added to its bits (the same value)."""
    u = _UINT[jnp.dtype(w.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(w, u) + zero.astype(u)
    return jax.lax.bitcast_convert_type(bits, w.dtype)


@_tied.defjvp
def _tied_jvp(primals, tangents):
    return _tied(*primals), tangents[0]  # the identity: its derivative passes through


def tie(tree, x):
    """`tree` with every inexact leaf's bits plus `zero_after(x)`: the same values, bit
    for bit, computed after `x`, with the identity's derivative. Bits, not a product
    with a one: XLA rewrites a conversion of `w * one` as a product of conversions and
    hoists the conversion of `w` out of a loop again."""
    zero = zero_after(x)
    inexact = lambda w: jnp.issubdtype(w.dtype, jnp.inexact)  # noqa: E731
    return jax.tree_util.tree_map(lambda w: _tied(w, zero) if inexact(w) else w, tree)


def low_precision(tree) -> bool:
    """Whether any inexact leaf of `tree` is narrower than float32."""
    return any(jnp.issubdtype(w.dtype, jnp.inexact) and jnp.dtype(w.dtype).itemsize < 4
               for w in jax.tree_util.tree_leaves(tree))  # fmt: skip
