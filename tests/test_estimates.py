"""A checkpoint report's one-program call logs its estimated compute and compile times
before it compiles (`reports.driver.compiled_call`, `estimate_line`), from the
program's products counted whole (`sizing.program_cost`: a loop's body times its
length, where XLA's cost analysis counts it once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.reports.driver import compiled_call
from jaxmech.sizing import COMPILE_S_PER_EQUATION, program_cost


def test_products_are_counted_whole_and_by_precision():
    a, w = jnp.ones((10, 64, 32)), jnp.ones((32, 16))
    dense = 2.0 * 10 * 64 * 32 * 16
    looped = program_cost(jax.make_jaxpr(lambda a, w: jax.lax.map(lambda x: x @ w, a))(a, w))
    assert looped["flops"] == dense and looped["flops_low"] == 0  # 10 x the body
    assert (
        jax.jit(lambda a, w: jax.lax.map(lambda x: x @ w, a)).lower(a, w).cost_analysis()["flops"]
        < dense
    )  # what XLA's count would have said
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    low = program_cost(jax.make_jaxpr(
        lambda a, w: jnp.dot(bf(a), bf(w), preferred_element_type=jnp.float32))(a, w))  # fmt: skip
    assert low["flops_low"] == dense and low["flops"] == 0
    branches = program_cost(jax.make_jaxpr(
        lambda p, a, w: jax.lax.cond(p, lambda: (a @ w).sum(), lambda: a.sum()))(True, a, w))  # fmt: skip
    assert branches["flops"] == dense  # the costliest branch


def test_the_estimate_is_logged_before_the_compile_and_the_compute():
    lines = []
    fn = lambda a, w: jax.lax.map(lambda x: x @ w, a)  # noqa: E731
    args = (jnp.ones((10, 64, 32)), jnp.ones((32, 16)))
    out = compiled_call(fn, args, "table", log=lines.append, estimate=True)
    assert out.shape == (10, 64, 16)
    assert lines[0].startswith("  table: estimate ~") and "0.0006554 GFLOP" in lines[0]
    assert f"x {COMPILE_S_PER_EQUATION * 1e3:.1f} ms" in lines[0]  # the compile, apart
    assert [ln.split(": ")[1].split()[0] for ln in lines[1:]] == [
        "compiling",
        "compiled",
        "computed",
    ]
    quiet = []
    compiled_call(fn, args, "table", log=quiet.append)  # a toy's call: no estimate
    assert not any("estimate" in ln for ln in quiet)
