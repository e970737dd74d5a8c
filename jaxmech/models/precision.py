"""Which arithmetic a low-precision (bfloat16 / float16) model's products run in.

Two paths, the same values but for the accumulation order:

* low-precision products: the operands in their own dtype, float32 accumulation
  (`preferred_element_type=float32`), the result rounded back to the operands' dtype,
  as a bfloat16 `torch.nn.Linear` computes it. Chosen on a GPU or TPU, and for bfloat16
  on an x86 CPU with bfloat16 units (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo),
  where XLA's CPU backend multiplies bfloat16 directly: a [1024, 1536] x [1536, 8960]
  product ran ~2x its float32 rate on such a CPU (BUILD_NOTES.md, Speed).
* float32 products: the product written in the operands' dtype, which XLA's CPU
  backend computes by converting both operands to float32 (`models.order.tie` makes
  each block's converted weights wait for their block). Chosen on CPUs without those
  units, where a bfloat16 product has nothing faster to run on.

Either way norms, the rotary rotation and the softmax are in float32 and every site
holds the params' dtype (`models.decoder`); float32 models are untouched (their products
are float32 whatever is chosen, so their outputs are the same bit for bit).

The choice: `$JAXMECH_BF16_PRODUCTS` = "auto" (the default: as above), "on" or "off".
It is read when a forward is traced: a compiled program keeps the choice it was traced
with, so set it before the process's first trace.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

ENV = "JAXMECH_BF16_PRODUCTS"
MODES = ("auto", "on", "off")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPU flags of bfloat16 dot units


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The CPU's feature flags from `path` (the first "flags" line); empty where there is
    none (not Linux, not x86)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bf16_units(backend: str | None = None, flags=None) -> tuple[bool, str]:
    """(whether `backend` (None: JAX's default) multiplies bfloat16 natively, why): any
    accelerator does; a CPU where it has `BF16_FLAGS` (`flags`: None reads
    /proc/cpuinfo)."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return True, f"the {backend} backend multiplies in bfloat16 / float16"
    have = [f for f in BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if have:
        return True, f"this CPU has {' and '.join(have)}"
    return False, f"this CPU has neither {' nor '.join(BF16_FLAGS)} (/proc/cpuinfo)"


def mode() -> str:
    """`$JAXMECH_BF16_PRODUCTS` ("auto" where unset); ValueError naming it otherwise."""
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(MODES)}")
    return m


def choose(dtype, backend: str | None = None, flags=None) -> tuple[bool, str]:
    """(whether products of `dtype` operands run in `dtype` with float32 accumulation,
    why). Never for float32 or wider; `$JAXMECH_BF16_PRODUCTS` on / off decides where
    set; else `bf16_units` (float16 on a CPU: no, XLA's CPU backend converts it)."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return False, f"{dtype.name} products are computed as they are"
    m = mode()
    if m != "auto":
        return m == "on", f"{ENV}={m}"
    if dtype == jnp.float16 and (backend or jax.default_backend()) == "cpu":
        return False, "XLA's CPU backend computes float16 products in float32"
    return bf16_units(backend, flags)


def describe(dtype) -> str:
    """One log line: which arithmetic a model of `dtype` params runs, and why."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return f"{dtype.name}: float32 weights and products"
    low, why = choose(dtype)
    other = "off" if low else "on"
    if low:
        return (f"{dtype.name}: {dtype.name} weights and products, float32 accumulation, "
                f"norms and softmax ({why}; {ENV}={other} for float32 products)")  # fmt: skip
    return (f"{dtype.name}: {dtype.name} weights, float32 products ({why}; {ENV}={other} "
            f"for {dtype.name} products)")  # fmt: skip


def _low(operands) -> jnp.dtype | None:
    """The operands' common dtype where products of it run in it (`choose`), else None."""
    dtype = jnp.result_type(*operands)
    return dtype if choose(dtype)[0] else None


def einsum(spec: str, *operands):
    """`jnp.einsum(spec, *operands)`, in the operands' low-precision dtype with float32
    accumulation where `choose` says so (the result in the operands' dtype either way).
    A one-row product against a weight (the first operand's free size 1, no batch axes)
    runs as two rows, the second zero: as a matrix-vector product XLA's CPU backend
    converts the matrix to float32 (the whole unembedding, 0.3 s of a forward at
    151936 x 512, measured), as a two-row one it does not."""
    dtype = _low(operands)
    if dtype is None:
        return jnp.einsum(spec, *operands)
    low = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    if len(operands) == 2 and _one_row(spec, *operands):
        ins, out = spec.replace(" ", "").split("->")
        new = next(c for c in "ZYXWUT" if c not in spec)
        x = operands[0]
        two = jnp.stack([x, jnp.zeros_like(x)])
        return low(f"{new}{ins}->{new}{out}", two, operands[1])[0].astype(dtype)
    return low(spec, *operands).astype(dtype)


def matmul(x, w):
    """`x @ w`, as `einsum` chooses (a one-row `x` as two rows, as there)."""
    dtype = _low((x, w))
    if dtype is None:
        return x @ w
    if w.ndim == 2 and x.size == x.shape[-1]:
        two = jnp.stack([x, jnp.zeros_like(x)])
        return jnp.matmul(two, w, preferred_element_type=jnp.float32)[0].astype(dtype)
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(dtype)


def _one_row(spec: str, x, w) -> bool:
    """Whether `spec`'s first operand `x` is one row: every axis it shares with `w` is
    contracted (no batch axes), and its other axes have size 1."""
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    letters = a.replace("...", "")
    sizes = dict(zip(letters, x.shape[x.ndim - len(letters) :] if a.startswith("...")
                     else x.shape[: len(letters)]))  # fmt: skip
    shared = [c for c in letters if c in b]
    if any(c in out for c in shared):
        return False
    return x.size == int(np.prod([sizes[c] for c in shared]))
