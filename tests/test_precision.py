"""Low-precision products (`models.precision`): the chooser's branches, each forced by
`$JAXMECH_BF16_PRODUCTS`; the products each branch writes; a bfloat16 forward near the
float32 one on a fixture under bfloat16 products; float32 programs the same under
either choice (so float32's exact identities stay exact)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.models import precision

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
IMAGE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "single0.png")
# max |bf16 - f32| over the fixture's logits (up to 2.5): seen 0.046 under either
# choice (a bf16 rounding of 8 bits per product, through 2 + 2 blocks)
BF16_BOUND = 0.1


@pytest.fixture
def products(monkeypatch):
    """Sets `$JAXMECH_BF16_PRODUCTS` for the test (restored after)."""
    return lambda mode: monkeypatch.setenv(precision.ENV, mode)


def test_the_chooser_follows_the_hardware_and_the_override(products):
    bf16, f16 = jnp.bfloat16, jnp.float16
    products("auto")
    low, why = precision.choose(bf16, "cpu", {"avx512f", "avx512_bf16"})
    assert low and "avx512_bf16" in why
    assert precision.choose(bf16, "cpu", {"amx_bf16"})[0]
    low, why = precision.choose(bf16, "cpu", {"avx2", "fma"})
    assert not low and "neither avx512_bf16 nor amx_bf16" in why
    assert precision.choose(bf16, "gpu", set()) == (
        True,
        "the gpu backend multiplies in bfloat16 / float16",
    )
    assert (
        precision.choose(f16, "tpu", set())[0] and not precision.choose(f16, "cpu", {"amx_bf16"})[0]
    )
    assert not precision.choose(jnp.float32, "gpu")[0]  # float32 is never narrowed
    products("on")  # both branches forced, whatever this machine has
    assert precision.choose(bf16, "cpu", set()) == (True, f"{precision.ENV}=on")
    products("off")
    assert precision.choose(bf16, "gpu", {"amx_bf16"}) == (False, f"{precision.ENV}=off")
    assert "float32 products" in precision.describe(bf16) and "=on" in precision.describe(bf16)
    products("fast")
    with pytest.raises(ValueError, match=precision.ENV):
        precision.choose(bf16)


def test_cpu_flags_are_read_from_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert precision.cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert precision.cpu_flags(str(tmp_path / "absent")) == frozenset()


def _dot_params(fn, *args) -> list:
    """(operand dtypes, preferred_element_type) of each dot_general `fn` traces to."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [(tuple(str(v.aval.dtype) for v in e.invars), str(e.params["preferred_element_type"]))
            for e in jaxpr.eqns if e.primitive.name == "dot_general"]  # fmt: skip


def test_each_choice_writes_its_products(products):
    """On: bf16 operands with float32 accumulation, the result back in bf16. Off: the
    product in bf16 as written (XLA's CPU backend converts it to float32). Float32
    operands: the same product either way."""
    x = jnp.ones((3, 8), jnp.bfloat16)
    w = jnp.ones((8, 4), jnp.bfloat16)
    seen = {}
    for mode in ("on", "off"):
        products(mode)
        seen[mode] = _dot_params(lambda x, w: precision.matmul(x, w), x, w)
        seen[mode] += _dot_params(lambda x, w: precision.einsum("nd,de->ne", x, w), x, w)
        assert precision.matmul(x, w).dtype == jnp.bfloat16
        f32 = (x.astype(jnp.float32), w.astype(jnp.float32))
        seen[mode + "32"] = _dot_params(lambda x, w: precision.einsum("nd,de->ne", x, w), *f32)
    assert seen["on"] == [(("bfloat16", "bfloat16"), "float32")] * 2
    assert seen["off"] == [(("bfloat16", "bfloat16"), "bfloat16")] * 2
    assert seen["on32"] == seen["off32"] == [(("float32", "float32"), "float32")]


def test_a_one_row_product_runs_as_two_rows(products):
    """Under bf16 products a one-row product against a weight is computed as two rows
    (XLA's CPU backend converts the matrix of a matrix-vector product to float32), the
    same values as the plain product; a batched one is left as it is."""
    products("on")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(8, 4)), jnp.bfloat16)
    E = jnp.asarray(rng.normal(size=(5, 8)), jnp.bfloat16)
    for fn, args in (
        (precision.matmul, (x, w)),
        (lambda x, E: precision.einsum("...d,vd->...v", x, E), (x, E)),
    ):
        (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "dot_general"]
        assert eqn.invars[0].aval.shape[0] == 2  # the row and a zero row
        products("off")
        plain = np.asarray(fn(*args), np.float32)
        products("on")
        np.testing.assert_allclose(np.asarray(fn(*args), np.float32), plain, rtol=2**-7)
    q, k = (jnp.ones((2, 1, 2, 8), jnp.bfloat16),) * 2
    scores = jax.make_jaxpr(lambda q, k: precision.einsum("bqhe,bkhe->bhqk", q, k))(q, k)
    assert [e.invars[0].aval.shape for e in scores.eqns if e.primitive.name == "dot_general"] == [
        (2, 1, 2, 8)
    ]


def _forward(model):
    """A fresh jit per call: a compiled program keeps the choice it was traced with."""
    return jax.jit(lambda p, x: model.family.forward(p, x, config=model.config)[0])


def test_bf16_products_stay_near_float32_and_float32_is_untouched(products):
    """The Qwen2-VL fixture's logits in bfloat16 with bf16 products within BF16_BOUND of
    float32's (and not equal: bf16 rounding happened); its float32 forward traces to the
    same program under either choice, so float32 outputs (and the exact no-op / mirror
    identities the contract tests check) do not depend on it."""
    import jaxmech

    q = ["Is the red square left of the blue circle?"]
    m32 = jaxmech.load(FIXTURE)
    enc = m32.encode([IMAGE], q)
    programs = {}
    for mode in ("on", "off"):
        products(mode)
        fn = lambda p, x: m32.family.forward(p, x, config=m32.config)[0]  # noqa: E731
        programs[mode] = str(jax.make_jaxpr(fn)(m32.params, enc.inputs))
    assert programs["on"] == programs["off"]
    f32 = np.asarray(_forward(m32)(m32.params, enc.inputs))
    products("on")
    m16 = jaxmech.load(FIXTURE, dtype=jnp.bfloat16)
    fn = _forward(m16)
    assert "preferred_element_type=float32" in str(jax.make_jaxpr(fn)(m16.params, enc.inputs))
    bf16 = np.asarray(fn(m16.params, enc.inputs), np.float32)
    err = np.abs(bf16 - f32).max()
    assert 1e-4 < err < BF16_BOUND, err
    assert (bf16[:, -1].argmax(-1) == f32[:, -1].argmax(-1)).all()
