"""The attention core of a checkpoint block (scores, mask, softmax, the values' sum), one
key / value head at a time on a CPU.

Why: XLA's CPU backend runs the batched products of `models.decoder.attention` ([B, H,
N, K] scores, a head axis beside the rows) far below its matrix rate, and the float32
scores of every head ([H, N, K]: 64 MB at a 448 px Qwen2-VL ViT) leave the cache
between the softmax's passes. Under a `lax.map` over the key / value heads, each head's
product is a plain [B, G N, E] x [B, K, E] one and its scores stay in cache. Measured on
a 2-core Zen 4, one Qwen2-VL-2B ViT block's core (N = K = 1024, 16 heads of 80): bf16
89 -> 31 ms (the reference's sdpa: 36 ms), float32 161 -> 94 ms; an LM block's (290
rows, 2 x 6 heads of 128) about the same either way.

The same operations in the same dtypes as the batched core (scores in the operands'
dtype with float32 accumulation, softmax in float32); XLA's kernels for the two product
shapes may round apart (float32: ~1 ulp), so on a CPU every block of a shape runs one
core: this one where a head's scores are many (`MIN_SCORES`: a 448 px ViT's). Where
an edit or a capture names a block's `attn_scores` or `pattern`, the core runs in
stages, each stage the same per-head map, the whole [B, H, N, K] array handed to the
site between them: an edit acts on the arrays it names, and a no-op edit or a capture
leaves every value as it was, bit for bit (tested). On an accelerator the batched
kernels are the fast ones: the batched core runs.

Axis names (`jaxmech.shapes`): B sequences, N query rows, K key rows, C key / value
heads, G query heads per key / value head, H = C G heads, E head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.models.precision import einsum
from jaxmech.models.scan import captured_at, edited_at

STAGED_POINTS = ("attn_scores", "pattern")  # the core's sites inside it (z is its output)
SCOPE = "attention_by_head"  # the name scope of the maps over heads (tests count scans)


# the fewest scores a head (N K) for which a CPU runs the core by head: below it the
# batched core is as fast (an LM block's 290 x 290 at 2B: 3.3 vs 3.5 ms, measured) and
# compiles smaller (the tests' tiny fixtures: no loop per block)
MIN_SCORES = 1 << 17


def by_head(n_scores: int) -> bool:
    """Whether a block whose heads each score `n_scores` = N K pairs runs its core one
    head at a time (`core_by_head`): on a CPU, from `MIN_SCORES` on."""
    return jax.default_backend() == "cpu" and n_scores >= MIN_SCORES


def staged(site, part: str, i) -> bool:
    """Whether block `i` of `part` has an edit or a capture at a `STAGED_POINTS` site."""
    names = [f"{part}/{p}.{i}" for p in STAGED_POINTS]
    return any(edited_at(site, n) or captured_at(site, n) for n in names)


def _map(fn, *xs):
    with jax.named_scope(SCOPE):  # a scan over heads, not blocks
        return jax.lax.map(lambda a: fn(*a), xs)


def core_by_head(q_BxNxCxGxE, k_BxKxCxE, v_BxKxCxE, mask_BxNxK, scale: float, at=None):
    """z [B, N, H, E]: softmax(mask(q k^T scale)) v for each query head (head c G + g
    reads key / value head c), over the key / value heads by `lax.map`: one map, or with
    `at(point, value)` (the block's site for `STAGED_POINTS`, values [B, H, N, K]) one
    map per stage, each stage's output handed to `at`."""
    B, N, C, G, E = q_BxNxCxGxE.shape
    K = k_BxKxCxE.shape[1]

    def scores(q, k):  # [B, G N, E], [B, K, E] -> [B, G, N, K]
        return (einsum("bqe,bke->bqk", q, k) * scale).reshape(B, G, N, K)

    def pattern(s):
        logits = jnp.where(mask_BxNxK[:, None], s.astype(jnp.float32), -jnp.inf)
        return jax.nn.softmax(logits, -1).astype(v_BxKxCxE.dtype)

    def values(p, v):  # [B, G, N, K], [B, K, E] -> [B, G N, E]
        return einsum("bqk,bke->bqe", p.reshape(B, G * N, K), v)

    qs = q_BxNxCxGxE.transpose(2, 0, 3, 1, 4).reshape(C, B, G * N, E)
    ks, vs = jnp.moveaxis(k_BxKxCxE, 2, 0), jnp.moveaxis(v_BxKxCxE, 2, 0)
    if at is None:
        z = _map(lambda q, k, v: values(pattern(scores(q, k)), v), qs, ks, vs)
    else:
        whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, C * G, N, K)  # noqa: E731
        heads = lambda x: jnp.moveaxis(x.reshape(B, C, G, N, K), 1, 0)  # noqa: E731
        s = heads(at("attn_scores", whole(_map(scores, qs, ks))))
        p = heads(at("pattern", whole(_map(pattern, s))))
        z = _map(values, p, vs)
    return z.reshape(C, B, G, N, E).transpose(1, 3, 0, 2, 4).reshape(B, N, C * G, E)
