"""Rematerialised scanned blocks (`models.scan.REMAT`, a config's `remat`): every
family's ViT and LM scans take the policy from the config, values and gradients stay
those of the plain scan (within float32 rounding: another compiled program), and the
fine-tunes' `remat` option is validated by name before any compute."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import block_scan

import jaxmech
from jaxmech.config import ConfigError
from jaxmech.models import scan
from jaxmech.models.decoder import Sites
from jaxmech.models.edits import NO_EDITS, Edits

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
FAMILIES = {  # fixture folder, its picture
    "qwen2_vl": (os.path.join(FIX, "qwen2_vl", "qwen2_vl"), "single0.png"),
    "qwen3_vl": (os.path.join(FIX, "qwen3_vl", "qwen3_vl"), "single0.png"),
    "llava": (os.path.join(FIX, "llava", "llava"), "single0.png"),
    "gemma3": (os.path.join(FIX, "gemma3", "gemma3"), "single0.png"),
    "internvl": (os.path.join(FIX, "internvl", "internvl"), "batch0.png"),
    "mllama": (os.path.join(FIX, "mllama", "mllama"), "single0.png"),
}
QUESTION = "Is the red circle left of the blue square?"
REMAT_EQN = ("checkpoint", "remat2")  # jax.checkpoint's primitive (its name by version)


def _count(jaxpr, names) -> int:
    """How many equations of a primitive in `names` a jaxpr holds at any depth (of
    scans, those over blocks: `conftest.block_scan`)."""
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name in names and (e.primitive.name != "scan" or block_scan(e))
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                n += _count(inner, names) if hasattr(inner, "eqns") else 0
    return n


def _loaded(family: str):
    folder, image = FAMILIES[family]
    m = jaxmech.load(folder)
    enc = m.encode([os.path.join(os.path.dirname(folder), image)], [QUESTION])
    return m, enc.inputs


def _forward(m, inputs, remat: str, capture=()):
    c = dataclasses.replace(m.config, remat=remat)
    return lambda p: m.family.forward(p, inputs, capture=list(capture), config=c)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_scan_takes_the_config_policy(family):
    """Traced only: with `remat` "full" every scan of the forward (the ViT's, the LM's
    where it scans) runs its step under `jax.checkpoint`; "off" (the default) none."""
    m, inputs = _loaded(family)
    assert m.config.remat == "off"
    jaxprs = {r: jax.make_jaxpr(_forward(m, inputs, r))(m.params).jaxpr for r in ("off", "full")}
    n_scans = _count(jaxprs["full"], ("scan",))
    assert n_scans >= 1 and _count(jaxprs["off"], ("scan",)) == n_scans
    assert _count(jaxprs["full"], REMAT_EQN) == n_scans
    assert _count(jaxprs["off"], REMAT_EQN) == 0


def _rel_close(got, want, tol):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        scale = max(float(np.abs(np.asarray(w)).max()), 1e-30)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol * scale, rtol=0)


# slow (~8 s: two gradient compiles of a whole fixture); in the suite remat's values,
# captures and gradients through `scan_blocks` are the toy stack's test below, and every
# family's scans taking the policy the traced test above
@pytest.mark.slow
def test_fixture_gradients_with_remat_equal_without():
    """Qwen2-VL's fixture (ViT and LM both scanned): the gradient of a loss over the
    logits and a captured residual, for every parameter, with remat "full" (what "on"
    means) equals the plain scan's within float32 rounding (another program: seen <=
    1.9e-5 absolute, gradients ~ 1); the value too. ~7 s: two gradient compiles."""
    m, inputs = _loaded("qwen2_vl")

    def loss_of(remat):
        f = _forward(m, inputs, remat, ["lm/resid_pre.1"])

        def loss(p):
            logits, aux = f(p)
            return jnp.sum(jnp.sin(logits)) + 1e-3 * jnp.sum(aux["lm/resid_pre.1"] ** 2)

        return jax.jit(jax.value_and_grad(loss))(m.params)

    value, want = loss_of("off")
    assert np.abs(np.asarray(want["vit"]["block_0"]["W_in"])).max() > 0  # through the ViT
    v, got = loss_of("full")  # "dots": the toy scan's test (one compile less here)
    np.testing.assert_allclose(float(v), float(value), rtol=1e-6)
    _rel_close(got, want, 1e-4)


def _toy_blocks(key, n: int = 4, width: int = 8):
    """A toy stack of n residual MLP blocks ({name: [n, ...]}) and its scan body, which
    names two sites per block."""
    k1, k2 = jax.random.split(key)
    w = {"W_in": jax.random.normal(k1, (n, width, 2 * width)) / width**0.5,
         "W_out": jax.random.normal(k2, (n, 2 * width, width)) / width**0.5}  # fmt: skip

    def body(b, x, site, i, e):
        h = site(f"toy/hidden.{scan.LAYER}", jnp.tanh(x @ b["W_in"]))
        return site(f"toy/resid_post.{scan.LAYER}", x + h @ b["W_out"])

    return w, body


@pytest.mark.parametrize("skip", [None, 1])
def test_toy_scan_under_remat_equals_the_plain_scan(skip):
    """`scan_blocks` over a toy stack with an edit at one layer, captures of every layer
    and of some, and blocks skipped before a traced layer: each policy gives the plain
    scan's output, captures and gradients (the step's values are recomputed, not
    changed)."""
    w, body = _toy_blocks(jax.random.key(0))
    x0 = jax.random.normal(jax.random.key(1), (2, 3, 8))
    edits = Edits(add={"toy/resid_post.2": jnp.ones(8)})
    capture = ["toy/hidden", "toy/resid_post.1"]
    first = None if skip is None else jnp.int32(skip)

    def run(remat):
        def f(w, x):
            site = Sites(edits, capture, remat)
            y = scan.scan_blocks(w, x, range(4), body, site, skip_before=first,
                                 remat=scan.remat_of(site))  # fmt: skip
            return jnp.sum(y**2) + jnp.sum(site.aux["toy/resid_post.1"]), site.aux

        (v, aux), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(w, x0)
        return v, aux, g, _count(jax.make_jaxpr(f)(w, x0).jaxpr, REMAT_EQN)

    v0, aux0, g0, n0 = run("off")
    assert n0 == 0 and set(aux0) == {f"toy/hidden.{i}" for i in range(4)} | {"toy/resid_post.1"}
    for remat in ("full", "dots"):
        v, aux, g, n = run(remat)
        assert n == 1
        np.testing.assert_allclose(float(v), float(v0), rtol=1e-6)
        _rel_close(aux, aux0, 1e-6)
        _rel_close(g, g0, 1e-5)


def test_a_bad_policy_is_refused_by_name():
    """The scan, the config field and the fine-tunes' option each name `remat`."""
    w, body = _toy_blocks(jax.random.key(0))
    with pytest.raises(ValueError, match="^remat = 'some': expected one of 'off', 'full'"):
        scan.scan_blocks(w, jnp.zeros((1, 2, 8)), range(4), body, Sites(NO_EDITS, False),
                         remat="some")  # fmt: skip
    from jaxmech.families.qwen2_vl.config import QwenVLConfig

    with pytest.raises(ConfigError, match="^remat = 'on' is invalid: allowed one of 'off'"):
        QwenVLConfig(remat="on")  # the config holds a policy; "on" is the reports' word


def test_the_fine_tune_reports_refuse_a_bad_remat_before_any_compute(tmp_path):
    """Both reports' `remat` option: refused by name before the run or model is read
    (None stands for them here); "on" means the measured policy."""
    from jaxmech import finetune
    from jaxmech.reports.authors_finetune import Recipe, run_authors_finetune
    from jaxmech.reports.id_finetune import run_id_loss

    refused = "^remat = 'yes': expected one of 'on', 'off', 'full', 'dots'$"
    with pytest.raises(ValueError, match=refused):
        run_id_loss(None, str(tmp_path), remat="yes")
    with pytest.raises(ValueError, match=refused):
        run_authors_finetune(None, str(tmp_path), "nowhere", [0.0], Recipe(), remat="yes")
    assert finetune.remat_setting("on") == finetune.REMAT_ON in scan.REMAT
    assert finetune.remat_setting("off") == "off"
    assert not list(tmp_path.iterdir())  # nothing written


# slow (~8 s: two fine-tune compiles); in the suite, remat through a real family's ViT and
# LM is `test_fixture_gradients_with_remat_equal_without`, and the checkpoint ID fine-tune
# (`test_qwen2_vl_view`) runs with remat on
@pytest.mark.slow
def test_a_tiny_authors_fine_tune_is_the_same_with_remat_on_and_off():
    """Their fine-tune (one step with the ID loss, Qwen2-VL's 28-block fixture) with
    remat on and off: the LM loss equal to the bit (the same forward values), the ID
    loss, gradient norm, every selected gradient and the trained weights within float32
    rounding (another program; seen: 1.5e-7 relative, weights within 1.5e-8)."""
    from jaxmech import finetune_authors as fa
    from jaxmech.data.datasets import authors_grid
    from jaxmech.reports.authors_finetune import Recipe, finetune

    authors = os.path.join(FIX, "authors")
    model = jaxmech.load(os.path.join(authors, "qwen2vl_28"), dtype=jnp.float32)
    ids = np.load(os.path.join(authors, "spatial_ids_qwen2.npz"))
    table = fa.id_table(ids["universal_LxCxD"], ids["cells_Cx2"], ids["layers"], 11)
    its = authors_grid.read_folder(os.path.join(authors, "finetune_train"))
    runs = {}
    for remat in ("off", "on"):
        lines = []
        runs[remat] = finetune(model, its, Recipe(lr=1e-3), 1.0, table, keep_grads=True,
                               remat=remat, log=lines.append)  # fmt: skip
        assert any(line.startswith(f"remat: {remat}") for line in lines)
    (p_off, r_off), (p_on, r_on) = runs["off"], runs["on"]
    assert len(r_on) == len(r_off) >= 1
    for a, b in zip(r_off, r_on):
        assert a["lm"] == b["lm"]
        for k in ("loss", "id", "norm"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5)
        _rel_close(b["grads"], a["grads"], 1e-4)
    _rel_close(p_on, p_off, 1e-6)
