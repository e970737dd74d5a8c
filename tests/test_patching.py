"""Mirror-swap patching (`analysis.patching`): the belief-shift formula and
the invariants of the patch itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis.patching import GROUPS, belief_shift, patch_logp, token_groups
from jaxmech.data.spec import Grid
from jaxmech.data.tasks import scenes as sc
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.families.toy_vlm.view import spans, toy_view
from jaxmech.families.vlm_view import examples


def test_belief_shift_on_hand_made_log_probabilities():
    orig = jnp.asarray([-0.1, -0.1, -0.1, -0.5])
    twin = jnp.asarray([-2.1, -2.1, -2.1, -0.5])  # the last: no effect to explain
    patched = jnp.asarray([-1.1, -0.1, -2.1, -3.0])
    got = belief_shift(orig, patched, twin)
    np.testing.assert_allclose(got[:3], [0.5, 0.0, 1.0], rtol=1e-6)
    assert np.isnan(got[3])
    p = belief_shift(jnp.exp(orig), jnp.exp(patched), jnp.exp(twin))  # the paper's form
    expected = (np.exp(-0.1) - np.exp(-1.1)) / (np.exp(-0.1) - np.exp(-2.1))
    np.testing.assert_allclose(p[0], expected, rtol=1e-6)


def test_token_groups():
    g = token_groups(spans(Grid(3, 3), 2))
    assert g.shape == (len(GROUPS), 2, 17)
    group = dict(zip(GROUPS, g[:, 1]))
    assert group["image"][:9].all() and not group["image"][9:].any()
    assert group["question"][9:].all() and not group["question"][:9].any() and group["all"].all()
    assert np.flatnonzero(group["objects"]).tolist() == [10, 15]  # the X and Y words
    assert np.flatnonzero(group["last"]).tolist() == [16]  # the answer position
    # the authors' "text" group: every token after the image
    assert np.flatnonzero(group["text"]).tolist() == list(range(9, 17))


@pytest.fixture(scope="module")
def model_and_set():
    config = tiny_vlm_config(lm_n_layers=2)
    params = toy_vlm.init_params(config, jax.random.PRNGKey(3))
    tables = sc.build_tables(config.task)
    s = sc.build_eval_sets(config.task, tables).unseen_pair
    view = toy_view(config)
    specs = sc.eval_specs(config.task, s)
    return view, params, examples(view, specs["examples"]), view.render(specs["mirror"])[0]


def _patch(view, params, ex, twin_inputs):
    run = lambda p, a, b, g, x, y: patch_logp(view, p, a, b, g, x, y)  # noqa: E731
    groups = token_groups(ex.spans)
    return jax.jit(run)(params, ex.inputs, twin_inputs, groups, ex.answer_B, ex.other_B)


def test_patching_a_run_with_itself_is_a_no_op(model_and_set):
    view, params, ex, _ = model_and_set
    out = _patch(view, params, ex, ex.inputs)
    assert out["patched"].shape == (2, len(GROUPS), len(ex.answer_B))
    np.testing.assert_allclose(
        out["patched"], np.broadcast_to(out["orig"], out["patched"].shape), atol=1e-5
    )


def test_patching_every_token_at_layer_0_gives_the_twin_run(model_and_set):
    view, params, ex, mirror = model_and_set
    out = _patch(view, params, ex, mirror)
    np.testing.assert_allclose(out["patched"][0, GROUPS.index("all")], out["twin"], atol=1e-5)
    # and a patch of the question alone at layer 0 changes nothing: the question's
    # embeddings do not depend on the image
    np.testing.assert_allclose(out["patched"][0, GROUPS.index("question")], out["orig"], atol=1e-5)
    assert np.abs(np.asarray(out["orig"] - out["twin"])).max() > 1e-4  # the mirror matters


def _hand_made_shifts(k: int, n_layers: int, b: int, empty_twin: str | None = None) -> dict:
    """`reports.patching.shifts`'s per-example dict, made by hand: [K, Y, G, B] shifts
    per (twin, word, kind), NaN for every example of `empty_twin` (nothing counted)."""
    rng = np.random.default_rng(0)
    sh = {("n", w): np.full(k, b) for w in ("left", "right", "both")}
    for twin in ("mirror", "recolour"):
        for w in ("left", "right", "both"):
            for kind in ("logp", "p"):
                v = rng.normal(0.5, 0.3, (k, n_layers, len(GROUPS), b))
                sh[(twin, w, kind)] = np.full_like(v, np.nan) if twin == empty_twin else v
    return sh


def test_the_paper_figure_draws_a_curve_per_token_group_over_layers(tmp_path, saved_figures):
    """Fig. 4 beside the table: x "Layer", y "Belief Shift", one curve per token group
    with its 95% band; a twin with nothing counted says "n = 0"; the authors' protocol
    draws their three groups, a row per read word (Delta "left", Delta "right")."""
    from conftest import texts

    from jaxmech.reports import patching as report

    layers = [3, 4, 5]
    sh = _hand_made_shifts(1, len(layers), 6, empty_twin="recolour")
    path = report.plot_paper(sh, str(tmp_path / "shifts_paper.png"), 1, layers)
    assert path.endswith("shifts_paper.png") and (tmp_path / "shifts_paper.png").exists()
    fig = saved_figures[-1]
    mirror, recolour = fig.axes
    assert mirror.get_xlabel() == "Layer" and mirror.get_ylabel() == "Belief Shift"
    curves = [ln for ln in mirror.get_lines() if not ln.get_label().startswith("_")]
    assert [ln.get_label() for ln in curves] == [report.GROUP_WORDS[g] for g in GROUPS]
    np.testing.assert_array_equal(curves[0].get_xdata(), layers)
    assert len(mirror.collections) == len(GROUPS)  # a band per curve
    assert "(A) Mirror Swapping" in mirror.get_title()
    assert "n = 0" in texts(fig) and "n = 0" not in "".join(t.get_text() for t in mirror.texts)
    assert not [ln for ln in recolour.get_lines() if not ln.get_label().startswith("_")]
    report.plot_paper(sh, str(tmp_path / "authors.png"), 1, layers, "authors")
    axes = saved_figures[-1].axes
    assert len(axes) == 4 and '"left"' in axes[0].get_title() and '"right"' in axes[2].get_title()
    labels = [ln.get_label() for ln in axes[0].get_lines() if not ln.get_label().startswith("_")]
    assert labels == ["Swapped All Image", "Swapped Obj Tokens", "Swapped All Text"]
