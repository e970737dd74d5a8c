"""The VLM interface (`families.vlm_view`): a stand-in VLM family registered from a test
trains through the sweep, and the paper 003 / 004 reports (patching, spatial IDs, the
counterfactual table) run on its results folder with no change to `analysis/` or
`reports/`. The stand-in reads the question *before* the image, so every position the
methods use comes from its spans, none from the toy's layout."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quiet, tiny_vlm_config

from jaxmech.analysis import counterfactuals as cfa
from jaxmech.analysis.patching import GROUPS
from jaxmech.config import TransformerConfig
from jaxmech.data.spec import Grid
from jaxmech.data.tasks import scenes as sc
from jaxmech.families import FAMILIES, TrainedFamily, register
from jaxmech.families.vlm_view import Spans, VLMView, examples, margin, rows_at
from jaxmech.models.attention import block_forward
from jaxmech.models.edits import NO_EDITS
from jaxmech.sweep import expand, run_grid


@dataclasses.dataclass(frozen=True)
class BagConfig(TransformerConfig):
    """The stand-in's config: the transformer sizes, and the LM depth the shared tiny
    VLM config sets (the stand-in has one block whatever it says)."""

    lm_n_layers: int = 1


ANSWER_WORDS = np.asarray([[2, 3], [4, 5], [6, 7]], np.int32)  # left right, above below, ...

# ---------------------------------------------------------------------------
# the stand-in: a bag of cell tokens after the question, one bidirectional attention block


def _init(config, key):
    m, t = config.model, config.task
    D, H, Dh, V = m.d_model, m.n_heads, m.d_head, sc.vocab_size(t)
    keys = iter(jax.random.split(key, 12))
    normal = lambda *shape: 0.3 * jax.random.normal(next(keys), shape)  # noqa: E731
    block = {f"W_{w}": normal(H, D, Dh) for w in "QKV"} | {"W_O": normal(H, Dh, D)}
    block |= {f"b_{w}": jnp.zeros((H, Dh)) for w in "QKV"} | {"b_O": jnp.zeros(D)}
    embed = {"label": (t.n_labels + 1, D), "colour": (t.n_colours + 1, D), "facing": (3, D)}
    lm = {"E": normal(V, D), "pos": normal(t.image_len + sc.Q_LEN, D), "block_0": block}
    return {
        "cells": {n: normal(*s) for n, s in embed.items()}
        | {"row": normal(t.grid_h, D), "col": normal(t.grid_w, D)},
        "lm": lm | {"W_U": normal(D, V)},
    }


def _grid_of(params) -> Grid:
    return Grid(params["cells"]["row"].shape[0], params["cells"]["col"].shape[0])


def _spans(grid: Grid, b: int) -> Spans:
    L, Q = grid.cells, sc.Q_LEN
    S, cells = L + Q, np.arange(L, dtype=np.int32)
    full = lambda v: np.full(b, v, np.int32)  # noqa: E731
    trc = np.stack([0 * cells, cells // grid.w, cells % grid.w], 1)
    question = np.broadcast_to((np.arange(S) < Q - 1) | (np.arange(S) == S - 1), (b, S))
    image = np.broadcast_to(cells + Q - 1, (b, L))
    return Spans(image, trc, cells, full(sc.X_SLOT), full(sc.Y_SLOT), question, full(S - 1))


def _forward(params, inputs, edits=None, capture=False):
    """[question without `?`][cell tokens][`?`], read both ways (so the object words
    see the image); the cells' positions come from the edits."""
    edits = NO_EDITS if edits is None else edits
    c, grid = params["cells"], _grid_of(params)
    rows, cols = np.divmod(np.arange(grid.cells), grid.w)
    r = rows if edits.vit_rows is None else jnp.asarray(edits.vit_rows).astype(jnp.int32)
    k = cols if edits.vit_cols is None else jnp.asarray(edits.vit_cols).astype(jnp.int32)
    image = c["label"][inputs.labels_BxL] + c["colour"][inputs.colours_BxL]
    image = image + c["facing"][inputs.facings_BxL] + c["row"][r] + c["col"][k]
    if edits.image_order is not None:
        image = jnp.take(image, jnp.asarray(edits.image_order), axis=1)
    words = params["lm"]["E"][inputs.question_BxQ]
    x = jnp.concatenate([words[:, :-1], image, words[:, -1:]], axis=1)
    ids = jnp.arange(x.shape[1]) if edits.lm_pos_ids is None else edits.lm_pos_ids[0]
    x = edits("lm/resid_pre.0", x + params["lm"]["pos"][jnp.asarray(ids).astype(jnp.int32)])
    aux = {"lm/resid_pre.0": x}
    x, block_aux = block_forward(
        params["lm"]["block_0"], x, causal=False, edits=edits, prefix="lm/", suffix=".0"
    )
    aux.update(block_aux)
    logits = x[:, -1] @ params["lm"]["W_U"]
    return logits, (aux if capture else {})


def _view(config) -> VLMView:
    grid = sc.grid_of(config.task)
    rows, cols = (jnp.asarray(a, jnp.float32) for a in np.divmod(np.arange(grid.cells), grid.w))
    return VLMView(
        name="bag_vlm",
        grid=grid,
        n_labels=config.task.n_labels,
        n_colours=config.task.n_colours,
        # the twins' questions name no colour or cell here, so `ask` changes nothing
        render=lambda specs, ask=None: (
            sc.render(config.task, specs),
            _spans(grid, len(specs.relation_B)),
        ),
        forward=_forward,
        answer_words=ANSWER_WORDS,
        n_lm_blocks=lambda params: 1,
        lm_position_ids=lambda params, sp: jnp.broadcast_to(
            jnp.arange(sp.length, dtype=jnp.float32), (3, sp.length)
        ),
        vit_positions=lambda params: (rows, cols, (grid.h, grid.w)),
        vit_blocks=lambda params: 0,
        position_basis=lambda params: jnp.concatenate(
            [params["cells"]["row"][rows.astype(int)], params["cells"]["col"][cols.astype(int)]], 1
        ),
    )


def _margin(params, batch):
    answer = jnp.asarray(batch.answer_B)
    other = jnp.asarray(sc.TOKEN["left"] + sc.TOKEN["right"]) + 4 * batch.relation_B - answer
    return margin(_forward(params, batch)[0], answer, other)


def _loss(params, batch, tables, settings, config):
    logp = jax.nn.log_softmax(_forward(params, batch)[0])
    return -rows_at(logp, batch.answer_B).mean()


def _evaluate(params, evals, tables, settings, config):
    ex = jax.tree_util.tree_map(jnp.asarray, evals.unseen_pair.examples)
    return {"unseen_acc": (_margin(params, ex) > 0).astype(jnp.float32).mean()}


BAG = TrainedFamily(
    name="bag_vlm",
    init_params=_init,
    loss=_loss,
    evaluate=_evaluate,
    metrics=lambda config: ("unseen_acc",),
    task_kinds=("scenes",),
    reports=("patching", "spatial_ids", "counterfactuals"),
    vlm_view=_view,
    config=BagConfig,
)

# ---------------------------------------------------------------------------


def _check_spans(config):
    view = _view(config)
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    ex = examples(view, sc.eval_specs(config.task, s)["examples"])
    np.testing.assert_array_equal(ex.answer_B, s.examples.answer_B)  # the spec's answers
    params = _init(config, jax.random.PRNGKey(0))
    _, aux = jax.jit(lambda p: view.forward(p, ex.inputs, capture=True))(params)
    words = params["lm"]["E"][ex.inputs.question_BxQ[:, sc.X_SLOT]]
    pos = params["lm"]["pos"][ex.spans.x_B]
    np.testing.assert_allclose(rows_at(aux["lm/resid_pre.0"], ex.spans.x_B), words + pos)


@pytest.mark.slow  # ~19 s; test_trained_family keeps a new family through sweeps, test_toy_vlm_family the VLM reports
def test_paper_003_004_reports_run_on_a_stand_in_family(tmp_path):
    """~30 s: two stand-in models train through the sweep (one program) and three
    reports compile their one call each (one test, so that one worker trains)."""
    from jaxmech.reports import counterfactuals, patching, spatial_ids
    from jaxmech.reports.common import analyse
    from jaxmech.reports.spatial_ids import RANKS
    from jaxmech.reports.steering import steering_refusal

    register(BAG)
    try:
        config = tiny_vlm_config(model_kind="bag_vlm", steps=20, eval_every=20, lr=1e-2)
        _check_spans(config)
        out = str(tmp_path / "run")
        run_grid(expand(config, {}, seeds=2), out, log=quiet)
        pat = analyse(patching.REPORT, out, log=quiet)
        ids = analyse(spatial_ids.REPORT, out, log=quiet)
        cf = analyse(counterfactuals.REPORT, out, log=quiet)
        refused = steering_refusal(config, out)
    finally:
        FAMILIES.pop("bag_vlm")
    sh = pat["res"]["shifts"][("mirror", "both", "logp", "mean")]  # [K, Y, G]
    kept = pat["res"]["shifts"][("n", "both")] > 0  # an empty model's cells are NaN
    assert sh.shape == (2, 1, len(GROUPS)) and np.isfinite(sh[kept]).all()
    r2 = ids["tables"]["r2"]
    assert len(r2) == 2 * 2 * 2 * len(RANKS)  # label sets x models x sites (in, out of the block)
    assert {r["examples"] for r in r2} == {"seen", "unseen"}
    assert all(np.isfinite(r["r2"]) for r in r2 if r["site"] == 1)
    rows = {(r["model"], r["counterfactual"], r["relation"]): r for r in cf["tables"]["table"] if r["examples"] == "seen"}  # fmt: skip
    assert all(rows[(m, "plain", rel)]["changed"] == 0.0 for m in (0, 1) for rel in ("horizontal", "vertical"))  # fmt: skip
    # the stand-in's positions follow the edits: mirroring them moves its margins
    view, params = _view(config), _init(config, jax.random.PRNGKey(0))
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    ex = examples(view, sc.eval_specs(config.task, s)["examples"])
    cfs = cfa.build(view, params, ex.spans, ("plain", "vit_w"))
    versions = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], ex.inputs)
    m, plain = jax.jit(lambda p: (  # compiled: op by op costs seconds here
        cfa.margins(view, p, versions, ex.answer_B, ex.other_B, cfs),
        margin(view.forward(p, ex.inputs)[0], ex.answer_B, ex.other_B),
    ))(params)  # fmt: skip
    np.testing.assert_allclose(m[0], plain, atol=1e-5)
    assert np.abs(np.asarray(m[1] - m[0])).max() > 1e-3
    for folder in ("patching", "spatial_ids", "counterfactuals"):
        assert os.path.isfile(os.path.join(out, folder, "summary.json"))
    # the family declares no steering report: refused by name before any compute
    assert "model_kind = 'bag_vlm' has no steering report" in refused


def test_answer_ids_say_no_where_the_named_label_is_not_drawn():
    """A question about a label that is not drawn (cell -1) is answered "no" as the toy
    renders it (against "yes"), side questions included; the others by their side."""
    from jaxmech.data.spec import SceneSpec
    from jaxmech.families.toy_vlm.view import toy_view
    from jaxmech.families.vlm_view import answer_ids

    view = toy_view(tiny_vlm_config())
    # rows: absent X asked left/right, above/below and "shown?"; present X the same
    cells = [[-1, 0, 4], [-1, 0, 4], [-1, 0, 4], [0, 0, -1], [0, 0, -1], [0, 0, -1]]
    labels = [[2, 0, 1], [2, 0, 1], [2, 0, 1], [2, 0, 0], [2, 0, 0], [2, 0, 0]]
    ones = np.ones((6, 3), np.int32)
    spec = SceneSpec(np.int32(cells), np.int32(labels), ones, ones, np.int32([0, 1, 2] * 2))
    answer, other = (np.asarray(x) for x in answer_ids(view, spec))
    np.testing.assert_array_equal(answer, np.asarray(view.render(spec)[0].answer_B))
    yes, no = sc.TOKEN["yes"], sc.TOKEN["no"]
    assert (answer[:3] == no).all() and (other[:3] == yes).all()
    assert {int(a) for a in answer[3:]} == {sc.TOKEN["left"], sc.TOKEN["above"], yes}
