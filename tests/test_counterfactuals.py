"""Seed 004's counterfactuals (`analysis.counterfactuals`, issue 15): mirrors are
involutions, a no-op counterfactual is a no-op, mirrored ViT codes equal a mirrored
image token for token, and the binding-failure rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis import counterfactuals as cfa
from jaxmech.data import scenes as sc
from jaxmech.models import answer, vit2d
from jaxmech.models.edits import VLMEdits


def _setup(**overrides):
    config = tiny_vlm_config(grid_h=3, grid_w=4, **overrides)
    from jaxmech.models import ar_vlm

    params = ar_vlm.init_params(config, jax.random.PRNGKey(2))
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    return config, params, s


def _pick(cfs, name):
    return jax.tree_util.tree_map(lambda x: x[cfa.COUNTERFACTUALS.index(name)], cfs)


def test_mirrors_are_involutions_and_the_image_mirror_is_the_scene_mirror():
    config, params, s = _setup()
    cfs = cfa.build(params, config.task)
    for name in ("image_w", "image_h", "order_w", "order_h", "lm_ids_w", "vit_w", "vit_h"):
        cf = _pick(cfs, name)
        twice, _ = cfa.apply(cfa.apply(s.examples, cf)[0], cf)
        for a, b in zip(twice, s.examples):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(cf.order[cf.order], np.arange(config.task.image_len))
    vc = _pick(cfs, "vit_w").vit_cols
    np.testing.assert_array_equal(config.task.grid_w - 1 - vc, vit2d.read(params, "cell_cols"))
    ids = _pick(cfs, "lm_ids_h").lm_ids
    L = config.task.image_len
    np.testing.assert_array_equal(ids[:, :L][:, sc.height_mirror_cells(config.task)], _pick(cfs, "plain").lm_ids[:, :L])  # fmt: skip
    moved, _ = cfa.apply(s.examples, _pick(cfs, "image_w"))
    mirrored = sc.mirror(s.examples, config.task)
    for f in ("labels_BxL", "colours_BxL", "facings_BxL"):
        np.testing.assert_array_equal(getattr(moved, f), getattr(mirrored, f))


def test_the_plain_counterfactual_is_a_no_op():
    config, params, s = _setup()
    # column codes 100x their init scale, so that mirroring them visibly matters
    params = {**params, "vit": {**params["vit"], "col_P": 100 * params["vit"]["col_P"]}}
    cfs = cfa.build(params, config.task, ("plain", "vit_w"))
    m = cfa.margins(params, s.examples, cfs)
    plain = answer.margin(answer.logits(params, s.examples), jnp.asarray(s.examples.answer_B))
    np.testing.assert_allclose(m[0], plain, atol=1e-5)
    assert np.abs(np.asarray(m[1] - plain)).max() > 1e-4  # the mirror does something


@pytest.mark.parametrize("vit_pos", ["learned2d", "rope2d"])
def test_mirrored_codes_equal_the_position_mirrored_image_token_for_token(vit_pos):
    config, params, s = _setup(vit_pos=vit_pos, n_layers=2, lm_n_layers=2)
    perm = sc.mirror_cells(config.task)
    cols = vit2d.read(params, "cell_cols")
    ex = s.examples
    moved = sc.mirror_pos(ex, config.task)  # positions mirrored, facings kept
    edits = VLMEdits(vit_cols=config.task.grid_w - 1 - cols)
    out, _ = vit2d.vit_forward(params, ex.labels_BxL, ex.colours_BxL, ex.facings_BxL, edits)
    ref, _ = vit2d.vit_forward(
        params, moved.labels_BxL, moved.colours_BxL, moved.facings_BxL, VLMEdits()
    )
    np.testing.assert_allclose(out[:, perm], ref, atol=1e-5)
    # and with the image tokens entering the LM in mirrored order, the whole model
    # answers as it does on the position-mirrored image
    both = VLMEdits(vit_cols=config.task.grid_w - 1 - cols, image_order=jnp.asarray(perm))
    np.testing.assert_allclose(
        answer.logits(params, ex, both), answer.logits(params, moved), atol=1e-5
    )


def test_binding_failures_name_the_same_word_for_both_orders():
    # margins of each question's own answer word: X-Y says the truth iff > 0; Y-X
    # (answer: the other word) says its truth iff > 0
    m = jnp.asarray([1.0, 1.0, -1.0, -1.0])
    swapped = jnp.asarray([1.0, -1.0, 1.0, -1.0])
    # right both ways; same word (the X-Y truth) twice; same word (the other) twice;
    # wrong both ways (a consistently swapped layout, not a binding failure)
    assert cfa.binding_failures(m, swapped).tolist() == [False, True, True, False]
    config, params, s = _setup()
    sw = cfa.swap_objects(s.examples)
    q, q2 = np.asarray(s.examples.question_BxQ), np.asarray(sw.question_BxQ)
    np.testing.assert_array_equal(q2[:, 1], q[:, 6])
    np.testing.assert_array_equal(q2[:, 6], q[:, 1])
    np.testing.assert_array_equal(sw.answer_B, answer.partner(jnp.asarray(s.examples.answer_B)))


def test_unknown_counterfactual_names_are_refused():
    config, params, _ = _setup()
    with pytest.raises(ValueError, match="unknown counterfactuals"):
        cfa.build(params, config.task, ("plain", "vit_mirror"))


def test_a_rope_mirror_in_every_block_is_the_whole_mirror_and_blocks_split_it():
    config, params, s = _setup(vit_pos="rope2d", n_layers=2, lm_n_layers=2)
    names = cfa.names_for(params)
    assert {"vit_w@0", "vit_w@1", "vit_h@1"} <= set(names)
    cfs = cfa.build(params, config.task, ("vit_w", "vit_w@0", "vit_w@1", "plain"))
    assert cfs.vit_cols.shape == (4, 2, config.task.image_len)  # per block
    m = cfa.margins(params, s.examples, cfs)
    full = jnp.asarray(config.task.grid_w - 1 - vit2d.read(params, "cell_cols"))
    ref = answer.margin(
        answer.logits(params, s.examples, VLMEdits(vit_cols=full)),
        jnp.asarray(s.examples.answer_B),
    )
    np.testing.assert_allclose(m[0], ref, atol=1e-5)  # [n_blocks, L] == [L] everywhere
    assert np.abs(np.asarray(m[1] - m[0])).max() > 1e-6  # one block is not all blocks
    # the learned table has no per-block positions: refused, naming the field
    learned_config, learned, _ = _setup()
    per_block = jnp.zeros((1, learned_config.task.image_len))
    with pytest.raises(ValueError, match="vit_cols"):
        answer.logits(learned, s.examples, VLMEdits(vit_cols=per_block))


def test_the_table_counts_agreement_with_the_mirror_and_changes():
    from jaxmech.reports import counterfactuals as report

    names = cfa.COUNTERFACTUALS
    B = 4
    m = np.ones((1, len(names), B))  # every counterfactual answers like the plain run...
    m[0, names.index("image_w")] = [-1, -1, 1, 1]  # ...but the width mirror flips two
    m[0, names.index("vit_w")] = [-1, 1, 1, 1]  # the code mirror flips one of them
    res = {
        "margins": m,
        "swapped": np.ones((1, B)),
        "relation": np.array([0, 0, 1, 1]),
        "names": names,
    }
    rows = {(r["counterfactual"], r["relation"]): r for r in report.table_rows(res, (0,))}
    assert rows[("vit_w", "horizontal")]["agree_mirror"] == 0.5
    assert rows[("vit_w", "horizontal")]["changed"] == 0.5
    assert rows[("plain", "horizontal")]["agree_mirror"] == 0.0
    assert rows[("image_w", "horizontal")]["agree_mirror"] == 1.0
    assert rows[("vit_w", "vertical")]["changed"] == 0.0
    errors = report.error_rows(res, (0,))
    assert [e["errors"] for e in errors] == [0, 0]  # no plain errors: nothing to share
    from jaxmech.config import Config

    assert "ar_vlm" in report.counterfactuals_refusal(Config(), "RUN")
