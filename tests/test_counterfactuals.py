"""Paper 004's counterfactuals (`analysis.counterfactuals`): mirrors are
involutions, a no-op counterfactual is a no-op, mirrored ViT codes equal a mirrored
image token for token, and the binding-failure rule; on the tiny Qwen2-VL fixture: the offset mirror is the mirror under rotary codes, what each order mirror
moves, a checkpoint's per-question intervals, the report under the authors' protocol."""

import os

import batch_twins as bt
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis import counterfactuals as cfa
from jaxmech.data import spec as sp
from jaxmech.data.tasks import scenes as sc
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.families.toy_vlm import vit as vit2d
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import examples, margin
from jaxmech.models.edits import Edits


def _setup(**overrides):
    config = tiny_vlm_config(grid_h=3, grid_w=4, **overrides)
    params = toy_vlm.init_params(config, jax.random.PRNGKey(2))
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    view = toy_view(config)
    return config, params, view, examples(view, sc.eval_specs(config.task, s)["examples"])


def _pick(cfs, name, names=cfa.COUNTERFACTUALS):
    return jax.tree_util.tree_map(lambda x: x[names.index(name)], cfs)


def _versions(view, ex):
    rendered = [view.render(v)[0] for v in cfa.scene_versions(view.grid, ex.spec)]
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *rendered)


def _plain_margin(view, params, ex, edits=None):
    return margin(view.forward(params, ex.inputs, edits)[0], ex.answer_B, ex.other_B)


def test_mirrors_are_involutions_and_the_image_mirror_is_the_scene_mirror():
    config, params, view, ex = _setup()
    cfs = cfa.build(view, params, ex.spans)
    L = config.task.image_len
    for name in ("order_w", "order_h"):
        order = _pick(cfs, name).order
        np.testing.assert_array_equal(order[order], np.arange(L))
    for mirror in (sp.mirror, sp.mirror_height):
        twice = mirror(view.grid, mirror(view.grid, ex.spec))
        for a, b in zip(twice, ex.spec):
            np.testing.assert_array_equal(a, b)
    vc = _pick(cfs, "vit_w").vit_cols
    np.testing.assert_array_equal(config.task.grid_w - 1 - vc, vit2d.read(params, "cell_cols"))
    ids = _pick(cfs, "lm_ids_h").lm_ids
    np.testing.assert_array_equal(ids[:, :L][:, sp.height_mirror_cells(view.grid)], _pick(cfs, "plain").lm_ids[:, :L])  # fmt: skip
    versions = _versions(view, ex)
    mirrored = bt.mirror(ex.inputs, config.task)
    image_w = cfa.SCENES.index(("w", True))  # positions mirrored and facings flipped
    for f in ("labels_BxL", "colours_BxL", "facings_BxL"):
        np.testing.assert_array_equal(getattr(versions, f)[image_w], getattr(mirrored, f))
    assert int(_pick(cfs, "image_w").scene) == image_w


def test_the_plain_counterfactual_is_a_no_op():
    config, params, view, ex = _setup()
    # column codes 100x their init scale, so that mirroring them visibly matters
    params = {**params, "vit": {**params["vit"], "col_P": 100 * params["vit"]["col_P"]}}
    cfs = cfa.build(view, params, ex.spans, ("plain", "vit_w"))
    versions = _versions(view, ex)
    m, plain = jax.jit(lambda p: (  # compiled: op by op costs ~10 s here
        cfa.margins(view, p, versions, ex.answer_B, ex.other_B, cfs),
        _plain_margin(view, p, ex),
    ))(params)  # fmt: skip
    np.testing.assert_allclose(m[0], plain, atol=1e-5)
    assert np.abs(np.asarray(m[1] - plain)).max() > 1e-4  # the mirror does something


@pytest.mark.parametrize("vit_pos", ["learned2d", "rope2d"])
def test_mirrored_codes_equal_the_position_mirrored_image_token_for_token(vit_pos):
    config, params, view, e = _setup(vit_pos=vit_pos, n_layers=2, lm_n_layers=2)
    perm = bt.mirror_cells(config.task)
    cols = vit2d.read(params, "cell_cols")
    ex = e.inputs
    moved = bt.mirror_pos(ex, config.task)  # positions mirrored, facings kept
    edits = Edits(vit_cols=config.task.grid_w - 1 - cols)
    out, _ = vit2d.vit_forward(params, ex.labels_BxL, ex.colours_BxL, ex.facings_BxL, edits)
    ref, _ = vit2d.vit_forward(
        params, moved.labels_BxL, moved.colours_BxL, moved.facings_BxL, Edits()
    )
    np.testing.assert_allclose(out[:, perm], ref, atol=1e-5)
    # and with the image tokens entering the LM in mirrored order, the whole model
    # answers as it does on the position-mirrored image
    both = Edits(vit_cols=config.task.grid_w - 1 - cols, image_order=jnp.asarray(perm))
    np.testing.assert_allclose(
        view.forward(params, ex, both)[0], view.forward(params, moved)[0], atol=1e-5
    )


def test_a_photographs_content_and_order_flip_is_the_drawn_scenes_facing_order():
    """A photograph's "content and order flipped, codes not" (the flipped image, the
    ViT's codes mirrored back: `PHOTO_CHANGES`) answers on a drawn scene as the drawn
    scene's own condition does, margin for margin: facing_order_w across the width,
    order_h across the height (nothing drawn turns upside down), so the name is shared
    and facing_order_h is a photograph's row only."""
    config, params, view, ex = _setup()
    # position codes 100x their init scale, so that where they go visibly matters
    vit = {k: 100 * v if k in ("row_P", "col_P") else v for k, v in params["vit"].items()}
    params = {**params, "vit": vit}
    # one stack of both (one compile): the photograph's two, the drawn's two, the plain run
    names = ("facing_order_w", "facing_order_h", "plain")
    photo = cfa.build(view, params, ex.spans, names, photo=True)
    drawn = cfa.build(view, params, ex.spans, ("facing_order_w", "order_h", "plain"))
    assert [int(x) for x in photo.scene[:2]] == [cfa.SCENES.index(("w", True)), cfa.SCENES.index(("h", False))]  # fmt: skip
    assert [int(x) for x in drawn.scene[:2]] == [cfa.SCENES.index((None, True)), 0]
    both = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a[:2], b]), photo, drawn)
    versions = _versions(view, ex)
    m = jax.jit(lambda cfs: cfa.margins(view, params, versions, ex.answer_B, ex.other_B, cfs))
    got, want = np.split(np.asarray(m(both)), [2])
    np.testing.assert_allclose(got, want[:2], atol=1e-4)
    assert np.abs(want[:2] - want[2]).max() > 1e-3  # and both conditions do something
    assert "facing_order_h" not in cfa.names_for(view, params)
    assert cfa.names_for(view, params, photo=True)[len(cfa.COUNTERFACTUALS)] == "facing_order_h"


def test_binding_failures_name_the_same_word_for_both_orders():
    # margins of each question's own answer word: X-Y says the truth iff > 0; Y-X
    # (answer: the other word) says its truth iff > 0
    m = jnp.asarray([1.0, 1.0, -1.0, -1.0])
    swapped = jnp.asarray([1.0, -1.0, 1.0, -1.0])
    # right both ways; same word (the X-Y truth) twice; same word (the other) twice;
    # wrong both ways (a consistently swapped layout, not a binding failure)
    assert cfa.binding_failures(m, swapped).tolist() == [False, True, True, False]
    config, params, view, ex = _setup()
    sw = examples(view, sp.swap_named(ex.spec))
    q, q2 = np.asarray(ex.inputs.question_BxQ), np.asarray(sw.inputs.question_BxQ)
    np.testing.assert_array_equal(q2[:, 1], q[:, 6])
    np.testing.assert_array_equal(q2[:, 6], q[:, 1])
    np.testing.assert_array_equal(sw.inputs.labels_BxL, ex.inputs.labels_BxL)  # same scenes
    np.testing.assert_array_equal(sw.answer_B, ex.other_B)


def test_unknown_counterfactual_names_are_refused():
    config, params, view, ex = _setup()
    with pytest.raises(ValueError, match="unknown counterfactuals"):
        cfa.build(view, params, ex.spans, ("plain", "vit_mirror"))


def test_a_rope_mirror_in_every_block_is_the_whole_mirror_and_blocks_split_it():
    config, params, view, ex = _setup(vit_pos="rope2d", n_layers=2, lm_n_layers=2)
    names = cfa.names_for(view, params)
    assert {"vit_w@0", "vit_w@1", "vit_h@1"} <= set(names)
    cfs = cfa.build(view, params, ex.spans, ("vit_w", "vit_w@0", "vit_w@1", "plain"))
    assert cfs.vit_cols.shape == (4, 2, config.task.image_len)  # per block
    m = cfa.margins(view, params, _versions(view, ex), ex.answer_B, ex.other_B, cfs)
    full = jnp.asarray(config.task.grid_w - 1 - vit2d.read(params, "cell_cols"))
    ref = _plain_margin(view, params, ex, Edits(vit_cols=full))
    np.testing.assert_allclose(m[0], ref, atol=1e-5)  # [n_blocks, L] == [L] everywhere
    assert np.abs(np.asarray(m[1] - m[0])).max() > 1e-6  # one block is not all blocks
    # the learned table has no per-block positions: refused, naming the field
    learned_config, learned, lview, lex = _setup()
    per_block = jnp.zeros((1, learned_config.task.image_len))
    with pytest.raises(ValueError, match="vit_cols"):
        lview.forward(learned, lex.inputs, Edits(vit_cols=per_block))


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

    assert "has no counterfactuals report" in report.counterfactuals_refusal(Config(), "RUN")


def test_half_cell_candidates_on_a_hand_made_grid():
    """On the 3 x 4 grid (columns 0..3 per row): the plain shift adds half a cell, the
    offset mirror reads W - 1 - col + 0.5, the roll wraps by half the width; rows stay."""
    config, params, view, ex = _setup()
    cfs = cfa.build(view, params, ex.spans)
    cols = np.tile(np.arange(4.0), 3)
    want = {"vit_half": cols + 0.5, "vit_half_mirror": 3.5 - cols, "vit_half_roll": (cols + 2) % 4}
    for name, expected in want.items():
        cf = _pick(cfs, name)
        np.testing.assert_array_equal(cf.vit_cols, expected)
        np.testing.assert_array_equal(cf.vit_rows, np.repeat(np.arange(3.0), 4))


def test_the_half_cell_shift_is_a_no_op_under_rope2d_and_the_report_says_so():
    """The note printed beside the vit_half row of a rope2d run is true: a uniform
    column shift leaves a rope2d ViT's margins unchanged (learned codes have no note:
    their interpolated codes move, `test_half_cell_candidates_on_a_hand_made_grid`)."""
    from jaxmech.reports.counterfactuals import notes

    config, params, view, ex = _setup(vit_pos="rope2d")
    cfs = cfa.build(view, params, ex.spans, ("plain", "vit_half"))
    versions = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], ex.inputs)
    run = jax.jit(lambda p: cfa.margins(view, p, versions, ex.answer_B, ex.other_B, cfs))
    m = np.asarray(run(params))  # compiled: eager op-by-op costs ~10 s here
    assert np.abs(m[1] - m[0]).max() < 1e-4 and np.abs(m[0]).max() > 1e-3
    assert "vit_half" in notes(view, params, config)
    plain_config, plain_params, plain_view, _ = _setup()
    assert "vit_half" not in notes(plain_view, plain_params, plain_config)
    video = tiny_vlm_config(vit_frames=True, task_kind="video")
    assert "vit_h" in notes(plain_view, plain_params, video)


FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
quiet = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def ckpt():
    """The fixture checkpoint on a 2 x 2 grid, 2 questions per relation (4 rows, two
    of them left-padded): its view, one model's params, the rendered questions."""
    from jaxmech.reports.common import open_checkpoint, relation_questions, view_of

    run = open_checkpoint(FOLDER, grid=(2, 2), size=112, questions=2, log=quiet)
    params = jax.tree_util.tree_map(lambda x: x[0], run.params)
    return view_of(run), params, relation_questions(run)


def _forwards(view, params, ex, cfs, capture=False):
    """(logits [C, B, V], aux) of every counterfactual on the plain scenes, compiled."""
    run = jax.vmap(lambda cf: view.forward(params, ex.inputs, cfa.edits_of(cf), capture))
    return jax.jit(run)(cfs)


def test_the_offset_mirror_is_the_mirror_under_rotary_codes_and_the_report_says_so(ckpt):
    """W - 1 - col + 0.5 is W - 1 - col shifted uniformly: the Qwen ViT's rotary q . k
    sees only differences, so vit_half_mirror answers as vit_w, logit for logit."""
    from jaxmech.reports.counterfactuals import notes

    view, params, ex = ckpt
    cfs = cfa.build(view, params, ex.spans, ("plain", "vit_w", "vit_half_mirror"))
    np.testing.assert_array_equal(cfs.vit_cols[2], cfs.vit_cols[1] + 0.5)  # the offset
    logits = np.asarray(_forwards(view, params, ex, cfs)[0])
    np.testing.assert_allclose(logits[2], logits[1], atol=1e-5)
    assert np.abs(logits[1] - logits[0]).max() > 1e-4  # and the mirror does act
    assert notes(view, params)["vit_half_mirror"].startswith("identical to vit_w")


def test_what_each_order_mirror_moves_on_a_checkpoint(ckpt):
    """order_w: slot (r, c) reads the content of (r, W-1-c) and keeps its own ids;
    order_ids_w: it reads the content and the ids of (r, W-1-c). Then the answer row's
    first block, a sum over keys that each carry their own rotary ids, is the plain
    run's (order-free) under order_ids_w, but not under order_w."""
    view, params, ex = ckpt
    cfs = cfa.build(view, params, ex.spans, ("plain", "order_w", "order_ids_w"))
    trc, image = np.asarray(ex.spans.image_trc_Ix3), np.asarray(ex.spans.image_BxI)
    perm = cfa.token_mirrors(ex.spans)["w"]
    W = trc[:, 2].max() + 1
    np.testing.assert_array_equal(trc[perm], trc * [1, 1, -1] + [0, 0, W - 1])  # (t, r, W-1-c)
    ids = np.asarray(cfs.lm_ids)  # [C, B, 3, S]: rows left-padded, ids per row
    for c in (1, 2):
        np.testing.assert_array_equal(cfs.order[c], perm)
    np.testing.assert_array_equal(ids[1], ids[0])  # order_w: the slots keep their ids
    for b in range(len(image)):
        grid = ids[0, b][1:, image[b]] - ids[0, b][1:, image[b]].min(1, keepdims=True)
        np.testing.assert_array_equal(grid.T, trc[:, 1:])  # plain: slot (r, c) has (r, c)
        moved = ids[2, b][1:, image[b]] - ids[0, b][1:, image[b]].min(1, keepdims=True)
        np.testing.assert_array_equal(moved.T, trc[perm][:, 1:])  # order_ids_w: (r, W-1-c)
        np.testing.assert_array_equal(np.delete(ids[2, b], image[b], 1), np.delete(ids[0, b], image[b], 1))  # fmt: skip
    _, aux = _forwards(view, params, ex, cfs, ("lm/embed", "lm/resid_post.0"))
    emb, rows = np.asarray(aux["lm/embed"]), np.arange(len(image))[:, None]
    for c in (1, 2):  # the content moved alike
        np.testing.assert_array_equal(emb[c][rows, image], emb[0][rows, image[:, perm]])
    last = np.asarray(aux["lm/resid_post.0"])[:, :, -1]  # [C, B, D] the answer row
    # the random fixture's image moves the answer row little (~5e-5 under order_w);
    # the order-free sum agrees to float rounding (~1e-7)
    np.testing.assert_allclose(last[2], last[0], atol=1e-6)
    assert np.abs(last[1] - last[0]).max() > 1e-5


def _hand_made_res():
    """One model, 3 horizontal and 2 vertical questions; image_w flips horizontal
    answers 0 and 1, vit_w flips answer 0; the plain run gets questions 2 and 4 wrong,
    question 2 a binding failure (its swapped twin says the same word)."""
    names = cfa.COUNTERFACTUALS
    m = np.tile(np.asarray([1.0, 1.0, -1.0, 1.0, -1.0]), (1, len(names), 1))
    m[0, names.index("image_w")] = [-1, -1, -1, 1, -1]
    m[0, names.index("vit_w")] = [-1, 1, -1, 1, -1]
    swapped = np.asarray([[1.0, 1.0, 1.0, 1.0, -1.0]])
    return {"margins": m, "swapped": swapped, "relation": np.array([0, 0, 0, 1, 1]), "names": names}


def test_a_checkpoints_cells_have_per_question_bootstrap_intervals():
    """The checkpoint's cells: the share over questions with a seeded bootstrap interval
    and n the questions; over models (one model) the same numbers have no interval."""
    from jaxmech.reports import counterfactuals as report

    res, lines = _hand_made_res(), []
    values = report.question_values(res)
    np.testing.assert_array_equal(values["vit_w", "horizontal"]["agree_mirror"], [1, 0, 1])
    np.testing.assert_array_equal(values["vit_w", "horizontal"]["changed"], [1, 0, 0])
    assert values["binding", "horizontal"]["share"].tolist() == [1.0]  # question 2
    assert values["binding", "vertical"]["errors"] == 1
    out = report.summarise(values, res["names"], lines.append, per_question=True)
    m, lo, hi, n = out["vit_w/horizontal"]["agree_mirror"]
    assert n == 3 and np.isclose(m, 2 / 3) and 0 <= lo < m < hi <= 1
    assert out["vit_w/vertical"]["changed"] == (0.0, 0.0, 0.0, 2)  # every resample: 0
    assert "(n = 3)" in "\n".join(lines) and "bootstrap over questions" in out["intervals"]
    over = report.model_values(report.table_rows(res, (0,)), report.error_rows(res, (0,)))
    models = report.summarise(over, res["names"], quiet)["vit_w/horizontal"]["agree_mirror"]
    assert np.isclose(models[0], m) and models[3] == 1 and np.isnan(models[1:3]).all()


def test_photograph_relations_have_their_mirror_or_none_and_left_right_rows_stay():
    """What'sUp's relations beside left / right (hand-made margins): on / under is
    compared with the height mirror's answers, front / behind with none (agree NaN,
    printed "no mirror") while its changed share is a number over its n questions; a
    relation asked but unreadable has rows with n = 0 and says why; the left / right
    rows are those of the same questions without the new relations."""
    from jaxmech.reports import counterfactuals as report

    base = _hand_made_res()  # 3 horizontal, 2 vertical
    names = base["names"]
    extra = np.ones((1, len(names), 4))  # 2 on / under, 2 front / behind questions
    extra[0, names.index("image_h")] = [-1, 1, -1, 1]  # flips on/under 0, front/behind 0
    extra[0, names.index("vit_h")] = [-1, -1, 1, -1]
    res = base | {"margins": np.concatenate([base["margins"], extra], 2),
                  "swapped": np.concatenate([base["swapped"], -np.ones((1, 4))], 1),
                  "relation": np.concatenate([base["relation"], [3, 3, 4, 4]])}  # fmt: skip
    rows = {(r["counterfactual"], r["relation"]): r for r in report.table_rows(res, (0,))}
    assert rows["vit_h", "on_under"]["agree_mirror"] == 0.5  # equal to image_h on question 0
    assert rows["vit_h", "on_under"]["changed"] == 1.0 and rows["vit_h", "on_under"]["n"] == 2
    fb = rows["vit_h", "front_behind"]
    assert np.isnan(fb["agree_mirror"]) and fb["changed"] == 0.5 and fb["n"] == 2
    assert rows["image_h", "front_behind"]["changed"] == 0.5  # measured, not a reference
    old = report.table_rows(base, (0,))  # left / right, above / below kept as they were
    assert all(rows[r["counterfactual"], r["relation"]] == r for r in old)
    assert [e["relation"] for e in report.error_rows(res, (0,))][2:] == ["on_under", "front_behind"]
    mirrors = {r["relation"]: r for r in report.relation_rows(res, (0,))}
    assert (
        mirrors["on_under"]["mirror"] == "image_h" and mirrors["horizontal"]["mirror"] == "image_w"
    )
    assert mirrors["front_behind"]["mirror"] == "" and mirrors["front_behind"]["n"] == 2
    assert "no image mirror" in mirrors["front_behind"]["reference"]
    lines = []
    out = report.summarise(report.question_values(res), names, lines.append, per_question=True,
                           relations=("horizontal", "vertical", "on_under", "front_behind"))  # fmt: skip
    m, lo, hi, n = out["vit_h/front_behind"]["changed"]
    assert n == 2 and m == 0.5 and out["vit_h/front_behind"]["agree_mirror"][3] == 0
    vit_h = next(x for x in lines if x.strip().startswith("vit_h "))
    assert "no mirror" in vit_h and "(n = 2)" in vit_h
    # asked but its words unreadable: rows with n = 0 (NaN, printed empty) and the reason
    gone = base | {"left_out": {"on_under": "both words begin with token 0"}}
    on = [r for r in report.table_rows(gone, (0,)) if r["relation"] == "on_under"]
    assert len(on) == len(names) and all(r["n"] == 0 and np.isnan(r["changed"]) for r in on)
    said = {r["relation"]: r["left_out"] for r in report.relation_rows(gone, (0,))}
    assert said == {"horizontal": "", "vertical": "", "on_under": "both words begin with token 0"}
    lines = []
    out = report.summarise(report.question_values(gone), names, lines.append, per_question=True,
                           relations=("horizontal", "vertical", "on_under"))  # fmt: skip
    assert out["vit_h/on_under"]["changed"][3] == 0
    vit_h = next(x for x in lines if x.strip().startswith("vit_h "))
    assert vit_h.split("  ")[-1].strip() == "empty (n = 0)" and vit_h.count("empty (n = 0)") == 2


def test_random_orders_say_where_the_objects_land_and_pooled_shares_resample_questions():
    """`order_reversed`: an object sits where its cell's tokens are read on average, so
    reading the tokens backwards reverses X and Y, moving tokens within a cell keeps
    them, and an unknown box or one shared cell is NaN; `pooled_ci`: sum / sum over
    questions, n the units, nothing counted is n = 0 (a NaN share, never 0.0)."""
    from types import SimpleNamespace

    spans = SimpleNamespace(cell_I=np.repeat(np.arange(4), 2))  # 8 tokens, 2 per cell
    within = np.asarray([1, 0, 3, 2, 5, 4, 7, 6])
    orders = np.stack([np.arange(8), np.arange(8)[::-1], within])
    cells = np.asarray([[0, 1], [3, 0], [2, 2], [-1, 1]])
    got = cfa.order_reversed(spans, cells, orders)
    want = [[0, 0, np.nan, np.nan], [1, 1, np.nan, np.nan], [0, 0, np.nan, np.nan]]
    np.testing.assert_array_equal(got, want)
    # which box is X's does not matter (CV-Bench's bbox order is assumed): X, Y swapped
    random = np.stack([cfa.random_order(8, k) for k in range(4)])
    for o in (orders, random):
        np.testing.assert_array_equal(cfa.order_reversed(spans, cells[:, ::-1], o),
                                      cfa.order_reversed(spans, cells, o))  # fmt: skip
    assert len(cfa.RANDOM_ORDERS) == 4 and sorted(cfa.random_order(8, 1)) == list(range(8))
    assert not np.array_equal(cfa.random_order(8, 0), cfa.random_order(8, 1))  # seeded apart
    m, lo, hi, n = cfa.pooled_ci([1, 2, 0], [2, 2, 2])
    assert n == 6 and np.isclose(m, 0.5) and 0 <= lo < m < hi <= 1
    assert cfa.pooled_ci([0, 0], [0, 0])[3] == 0 and np.isnan(cfa.pooled_ci([0], [0])[0])
    d = cfa.pooled_ci([2, 1], [2, 2], minus=([0, 1], [2, 2]))
    assert np.isclose(d[0], 0.75 - 0.25) and d[3] == 8
    assert cfa.pooled_ci([1], [1], minus=([0], [0]))[3] == 0  # one group empty: no difference


def _posthoc_res():
    """One model, words (left, right, on, under); questions: 2 left / right (answers
    left, right), 1 on / under (answer on), 1 above / below (no pair among the words).
    The four random orders: question 0 moves to right (its mirror), on, itself, under;
    question 1 to left (its mirror) under order 0 only; question 2 to under (its mirror)
    under order 0. Margins flip where the word moved; X and Y's order reversed under
    orders 0, 2 for question 0, 0, 1 for question 1 (2: no box), unknown for 2, 3. The
    image mirrors change every answer (image_w the left / right ones, image_h the
    others); content and order flipped with the codes not (facing_order_w / _h) brings
    back question 0's and 3's, not 1's (left / right) nor 2's (on / under)."""
    names = cfa.COUNTERFACTUALS + ("facing_order_h",) + cfa.RANDOM_ORDERS
    r0 = len(names) - 4
    says = np.tile(np.asarray([0, 1, 2, 0]), (len(names), 1))  # [C, B] word chosen
    says[r0:, 0] = [1, 2, 0, 3]
    says[r0, 1], says[r0, 2] = 0, 3
    words = np.moveaxis(np.eye(4)[says], 2, 1)[None]  # [1, C, W, B]: 1 on the word said
    margins = np.ones((1, len(names), 4))
    margins[0, r0:, 0] = [-1, -1, 1, -1]
    margins[0, r0, 1] = margins[0, r0, 2] = -1
    for name, flipped in (("image_w", [0, 1]), ("image_h", [2, 3]), ("facing_order_w", [1]),
                          ("facing_order_h", [2])):  # fmt: skip
        margins[0, names.index(name), flipped] = -1
    reversed_ = np.asarray([[1, 1, np.nan, np.nan], [0, 1, np.nan, np.nan],
                            [1, np.nan, np.nan, np.nan], [0, 0, np.nan, np.nan]])  # fmt: skip
    return {"margins": margins, "swapped": np.ones((1, 4)), "relation": np.asarray([0, 0, 3, 1]),
            "names": names, "words": words, "pair": np.asarray([0, 0, 1, -1]),
            "reversed": reversed_}  # fmt: skip


def test_posthoc_rows_count_changes_landing_on_the_mirror_and_order_reversals():
    """Paper 004's post-hoc rows on hand-made reads (`_posthoc_res`): of 4 changed left /
    right answers 2 land on the mirror word (chance 1/3 with 4 words); flips where the
    objects' order is reversed 2/4, kept 2/3; a relation with nothing counted prints
    "empty (n = 0)" and writes NaN, never 0.0."""
    from jaxmech.reports import counterfactuals as report

    res = _posthoc_res()
    rows = {(r["relation"], r["row"]): r for r in report.posthoc_rows(res, (0,))}
    land = rows["horizontal", "mirror_landing"]
    assert (land["share"], land["n"]) == (0.5, 4) and np.isclose(land["chance"], 1 / 3)
    assert land["ci_low"] <= 0.5 <= land["ci_high"]
    assert (rows["on_under", "mirror_landing"]["share"], rows["on_under", "mirror_landing"]["n"]) == (1.0, 1)  # fmt: skip
    flips = [rows["horizontal", k] for k in ("flips_reversed", "flips_kept", "reversed_minus_kept")]
    assert [(x["share"], x["n"]) for x in flips[:2]] == [(0.5, 4), (2 / 3, 3)]
    assert np.isclose(flips[2]["share"], 0.5 - 2 / 3) and flips[2]["n"] == 7
    vertical = rows["vertical", "mirror_landing"]
    assert vertical["n"] == 0 and np.isnan(vertical["share"]) and np.isnan(vertical["chance"])
    lines = []
    summary = report._posthoc_summary(list(rows.values()), lines.append)["posthoc"]["0"]
    assert summary["horizontal"]["mirror_landing"][3] == 4
    said = [x for x in lines if x.strip().startswith("vertical")][:4]  # (a), (b): none
    assert len(said) == 4 and all(x.endswith("empty (n = 0)") for x in said)
    assert report._posthoc_summary([], lines.append) == {}  # drawn scenes: none


def test_back_to_the_original_answer_counts_returns_among_the_mirrors_changes():
    """Post-hoc (c) on the hand-made reads (`_posthoc_res`): of the answers its image
    mirror changed, the share content-and-order-flipped (codes not) brings back: left /
    right 1/2 (questions 0, 1), on / under 0/1, above / below 1/1, and each minus left /
    right's; front / behind (no mirror, no question) is "empty (n = 0)". It is not (a)
    or (b): those read the random orders, which the mirrors and facing_order_* leave
    alone, and changing (c)'s conditions leaves theirs unchanged."""
    from jaxmech.reports import counterfactuals as report

    res = _posthoc_res() | {"left_out": {"front_behind": "its words read alike"}}
    rows = {(r["relation"], r["row"]): r for r in report.posthoc_rows(res, (0,))}
    got = {rel: (rows[rel, "back_to_original"]["share"], rows[rel, "back_to_original"]["n"])
           for rel in ("horizontal", "on_under", "vertical")}  # fmt: skip
    assert got == {"horizontal": (0.5, 2), "on_under": (0.0, 1), "vertical": (1.0, 1)}
    assert rows["horizontal", "back_to_original"]["chance"] == 0.5
    assert ("horizontal", "back_minus_left_right") not in rows
    minus = {rel: rows[rel, "back_minus_left_right"] for rel in ("on_under", "vertical")}
    assert np.isclose(minus["on_under"]["share"], -0.5) and minus["on_under"]["n"] == 3
    assert np.isclose(minus["vertical"]["share"], 0.5) and minus["vertical"]["n"] == 3
    fb = rows["front_behind", "back_to_original"]
    assert fb["n"] == 0 and np.isnan(fb["share"]) and np.isnan(fb["chance"])
    # the mirrors and the flipped conditions moved back: (c) changes, (a) and (b) do not
    other = _posthoc_res() | {"left_out": res["left_out"]}
    other["margins"][0, res["names"].index("facing_order_w"), 1] = 1
    again = {(r["relation"], r["row"]): r for r in report.posthoc_rows(other, (0,))}
    assert again["horizontal", "back_to_original"]["share"] == 1.0
    for key in rows:
        if not key[1].startswith("back"):
            assert str(again[key]) == str(rows[key])  # NaN-safe equality
    lines = []
    summary = report._posthoc_summary(list(rows.values()), lines.append)["posthoc"]["0"]
    assert summary["on_under"]["back_to_original"][:1] == (0.0,)
    assert summary["horizontal"]["back_chance"] == 0.5
    said = [x for x in lines if x.strip().startswith("front_behind") and "back" in x]
    assert len(said) == 2 and all(x.endswith("empty (n = 0)") for x in said)
    # the analysis function alone: counted only where the mirror changed the answer
    hits, counted = cfa.back_to_original([1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1])
    assert hits.tolist() == [1, 0, 0, 0] and counted.tolist() == [1, 0, 1, 0]


def test_the_report_on_a_checkpoint_under_the_authors_protocol(tmp_path):
    """`--protocol=authors` end to end on the fixture (the view asks in the authors'
    wording): the table is written, every cell of 2 questions has a finite interval."""
    import csv

    from jaxmech.reports import counterfactuals as report
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    run = open_checkpoint(FOLDER, grid=(2, 2), size=112, questions=2, batch=4,
                          protocol="authors", log=quiet)  # fmt: skip
    lines = []
    out = analyse_subject(report.REPORT, run, str(tmp_path), log=lines.append)
    with open(tmp_path / "counterfactuals" / "table.csv") as f:
        rows = list(csv.DictReader(f))
    names = {r["counterfactual"] for r in rows}
    assert {"order_w", "order_ids_w", "vit_half_mirror"} <= names
    assert {r["n"] for r in rows} == {"2"}
    summary = out["summary"]
    assert summary["protocol"] == "authors"
    assert "identical to vit_w" in summary["notes"]["vit_half_mirror"]
    table = {k: d for k, d in summary.items() if "/" in k and not k.startswith("binding")}
    cells = [v for d in table.values() for v in d.values()]
    assert len(cells) == 2 * 2 * len(names)  # (agree, changed) x relations
    assert all(c[3] == 2 and np.isfinite(c[:3]).all() for c in cells)
    assert any("(n = 2)" in line and "identical to vit_w" in line for line in lines)
    # drawn scenes: their own facing_order_w, no photograph's rows, no post-hoc table
    assert names == set(cfa.COUNTERFACTUALS) and "posthoc" not in summary
    assert not (tmp_path / "counterfactuals" / "posthoc.csv").exists()


def test_the_row_mirror_of_a_video_is_the_identity_the_vit_sees():
    """A video's ViT sees each frame alone as one row: mirroring its rows is an exact
    no-op (the plain rows, so the plain forward), under sin-cos codes too, and a learned
    table of one row takes it concretely (`check_edits`)."""
    from jaxmech.families.toy_vlm.checks import check_edits

    for vit_pos in ("learned2d", "sincos2d"):
        config = tiny_vlm_config(task_kind="video", grid_h=4, vit_frames=True, vit_pos=vit_pos)
        params = toy_vlm.init_params(config, jax.random.PRNGKey(0))
        view = toy_view(config)
        spans = view.render(sp.take(_video_spec(config), [0]))[1]
        cfs = cfa.build(view, params, spans, ("plain", "vit_h"))
        plain, vit_h = (_pick(cfs, n, ("plain", "vit_h")) for n in ("plain", "vit_h"))
        np.testing.assert_array_equal(vit_h.vit_rows, plain.vit_rows)
        check_edits(params, cfa.edits_of(vit_h), sc.Q_LEN)  # concrete: a real row


def _video_spec(config):
    from jaxmech.data.tasks import video

    task = config.task
    evals = video.build_eval_sets(task, video.build_tables(task))
    return video.eval_specs(task, evals.unseen_pair)["examples"]
