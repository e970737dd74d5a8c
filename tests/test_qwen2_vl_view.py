"""The Qwen2-VL family's VLM view (`families.qwen2_vl.view`) on the tiny random fixture
(values meaningless, the machinery checked): rendering, spans and position ids, the
resumed forward, paper 003's patching through it, and the `--checkpoint` report."""

from __future__ import annotations

import glob
import os
import re

import jax
import numpy as np
import pytest

from jaxmech.analysis import counterfactuals as cfa
from jaxmech.analysis import spatial_ids as si
from jaxmech.analysis import steering as st
from jaxmech.analysis.patching import GROUPS, patch_logp, resume_plan, token_groups
from jaxmech.data.inputs.pictures import object_names
from jaxmech.data.spec import Grid, first_word, pair_questions
from jaxmech.families import load_checkpoint
from jaxmech.families.qwen2_vl import model
from jaxmech.families.qwen2_vl.view import checkpoint_view
from jaxmech.families.vlm_view import cell_tokens, examples
from jaxmech.models.edits import Edits
from jaxmech.reports.common import open_checkpoint
from jaxmech.train import param_paths

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")


@pytest.fixture(scope="module")
def fixture():
    _, config, params = load_checkpoint(FOLDER)
    view = checkpoint_view(FOLDER, config, Grid(4, 4), 112)
    specs = pair_questions(view.grid, 4, view.n_labels, view.n_colours, seed=1)
    ex = examples(view, specs["examples"])
    mirror = view.render(specs["mirror"], ask=specs["examples"])[0]
    return config, params, view, specs, ex, mirror


def test_pair_questions_and_their_twins():
    grid = Grid(3, 4)
    s = pair_questions(grid, 50, 10, 6, seed=2)
    ex = s["examples"]
    assert (ex.cells_BxK[:, 0] % 4 != ex.cells_BxK[:, 1] % 4).all()  # the answer is defined
    assert (ex.labels_BxK[:, 0] != ex.labels_BxK[:, 1]).all()
    assert (np.asarray(first_word(grid, s["mirror"])) != np.asarray(first_word(grid, ex))).all()
    assert (s["recolour"].colours_BxK != ex.colours_BxK).all()
    with pytest.raises(ValueError, match="n = 0"):
        pair_questions(grid, 0, 10, 6)


def test_render_spans_and_position_ids(fixture):
    config, params, view, specs, ex, mirror = fixture
    tokens = np.asarray(ex.inputs.tokens_BxS)
    np.testing.assert_array_equal(np.asarray(mirror.tokens_BxS), tokens)  # the same question
    # the mirrored spec's patches are the flipped picture's: the image tokens differ
    assert not np.array_equal(np.asarray(mirror.pixels_BxPxF), np.asarray(ex.inputs.pixels_BxPxF))
    np.testing.assert_array_equal(
        view.lm_position_ids(params, ex.spans), np.asarray(ex.inputs.pos_Bx3xS)
    )
    # each cell of the 4 x 4 grid is one merged token of the 4 x 4 merged grid
    assert sorted(np.asarray(ex.spans.cell_I).tolist()) == list(range(16))
    for b, (x, y) in enumerate(object_names(specs["examples"])):
        # the last sub-token of each name (words the fixture's vocabulary lacks are [UNK])
        assert tokens[b, ex.spans.x_B[b]] == vocab_id(view, x.split()[-1])
        assert tokens[b, ex.spans.y_B[b]] == vocab_id(view, y.split()[-1])
        assert ex.spans.x_B[b] < ex.spans.y_B[b] < tokens.shape[1] - 1
    assert view.answer_words[0].tolist() == [vocab_id(view, "Left"), vocab_id(view, "Right")]


def vocab_id(view, word):
    tok = view.render.args[0].tokenizer
    found = tok.token_to_id(word)
    return tok.token_to_id("[UNK]") if found is None else found


def test_bad_sizes_are_refused_by_name(fixture):
    config = fixture[0]
    with pytest.raises(ValueError, match="size = 224: the processor would resize"):
        checkpoint_view(FOLDER, config, Grid(4, 4), 224)
    with pytest.raises(ValueError, match="size = 84: must be a multiple"):
        checkpoint_view(FOLDER, config, Grid(4, 4), 84)
    with pytest.raises(ValueError, match="layers"):
        open_checkpoint(FOLDER, size=112, layers=(5,))


def test_patching_through_the_cache(fixture):
    config, params, view, specs, ex, mirror = fixture
    shared = np.asarray(ex.spans.image_BxI)[:, 0]
    groups = token_groups(ex.spans)
    plan = resume_plan(view, groups, shared)
    image_end = int(np.asarray(ex.spans.image_BxI)[:, -1].min()) + 1
    assert plan[GROUPS.index("image")] == (image_end, True)  # image rows follow the twin
    assert plan[GROUPS.index("last")] == (ex.inputs.tokens_BxS.shape[1] - 1, False)

    def patch(v, twin, plan):  # at the first LM site
        return patch_logp(v, params, ex.inputs, twin, groups, ex.answer_B, ex.other_B, (0,),
                          plan=plan)  # fmt: skip

    full_view = view._replace(forward_from=None)
    same, got, full = jax.jit(  # one program: the suite's time
        lambda: (patch(view, ex.inputs, plan), patch(view, mirror, plan),
                 patch(full_view, mirror, None))
    )()  # fmt: skip
    # the example's own run is a no-op; the cache gives the full forward's patches
    np.testing.assert_allclose(
        same["patched"], np.broadcast_to(same["orig"], (1, len(GROUPS), 4)), atol=1e-5
    )
    np.testing.assert_allclose(got["patched"], full["patched"], atol=1e-5)
    # patching every token at the first LM site gives the twin's answer
    np.testing.assert_allclose(got["patched"][0, GROUPS.index("all")], got["twin"], atol=1e-5)
    assert np.abs(np.asarray(got["orig"] - got["twin"])).max() > 1e-4  # the mirror matters


def test_resume_errors(fixture):
    config, params, view, specs, ex, mirror = fixture
    x = np.zeros((4, 3, config.lm_width), np.float32)
    with pytest.raises(ValueError, match="Resume.layer = 7"):
        model.forward(params, ex.inputs, config=config, resume=model.Resume(7, 1, x, {}))
    with pytest.raises(ValueError, match="Resume.x_BxTxD"):
        model.forward(params, ex.inputs, config=config, resume=model.Resume(0, 1, x, {}))
    S = ex.inputs.tokens_BxS.shape[1]
    x = np.zeros((4, 3, config.lm_width), np.float32)
    with pytest.raises(ValueError, match="Resume.aux: lacks"):
        model.forward(params, ex.inputs, config=config, resume=model.Resume(0, S - 3, x, {}))


@pytest.fixture(scope="module")
def small():
    """The fixture on a 2 x 2 grid (4 cells of 2 x 2 merged tokens): probes stay few."""
    _, config, params = load_checkpoint(FOLDER)
    view = checkpoint_view(FOLDER, config, Grid(2, 2), 112)
    return config, params, view, si.probe(view, range(1, 4), placements=2)


def test_probe_chunks_and_a_planted_spatial_id(small):
    """One compiled program (the suite's time): the probe run reduced to two positions
    and chunked gives the full run's IDs and analytic IDs; and a direction per cell
    added to X's word at `lm/resid_pre.1` comes out of the ID extraction at site 1
    (centred over the cells), on top of the model's own ID."""
    config, params, view, pr = small
    token = cell_tokens(pr.spans, pr.cell_N)
    n, B = config.lm_layers, len(token)
    plant = np.random.default_rng(0).normal(size=(4, config.lm_width)).astype(np.float32)
    add = np.zeros(pr.inputs.tokens_BxS.shape + (config.lm_width,), np.float32)
    add[np.arange(B), pr.spans.x_B] = plant[pr.cell_N]
    zeros = np.zeros(B, np.int32)

    def run(p):
        _, aux = view.forward(p, pr.inputs, capture=si.probe_sites(n))
        full = si.analytic_ids(p, aux, pr.spans.x_B, token, pr.label_N, pr.cell_N, 4)
        red = si.chunked_probe(view, p, pr.inputs, pr.spans.x_B, token, 5)
        got = si.analytic_ids(p, red, zeros, zeros + 1, pr.label_N, pr.cell_N, 4)
        states = si.states_at(aux, n, pr.spans.x_B), si.states_at(red, n, zeros)
        edits = Edits(add={"lm/resid_pre.1": add})
        _, planted = view.forward(p, pr.inputs, edits, capture=["lm/resid_pre.1"])
        moved = planted["lm/resid_pre.1"][np.arange(B), pr.spans.x_B][None]
        ids = [si.spatial_ids(x, pr.label_N, pr.cell_N, 4)[0] for x in (moved, states[0][1:2])]
        return full, got, states, ids[0] - ids[1]

    full, got, (s_full, s_red), planted = jax.jit(run)(params)
    for k in full:
        np.testing.assert_allclose(got[k], full[k], atol=1e-5, err_msg=k)
    np.testing.assert_allclose(s_red, s_full, atol=1e-5)
    np.testing.assert_allclose(planted, plant - plant.mean(0), atol=1e-4)


def test_counterfactual_mirrors_on_a_checkpoint(fixture):
    config, params, view, specs, ex, mirror = fixture
    cfs = cfa.build(view, params, ex.spans, ("plain", "vit_w", "lm_ids_w"))
    plain, vit_w, ids_w = (jax.tree_util.tree_map(lambda x, i=i: x[i], cfs) for i in range(3))
    W = 112 // config.patch_size
    np.testing.assert_array_equal(vit_w.vit_cols, W - 1 - plain.vit_cols)
    image = np.asarray(ex.spans.image_BxI)
    moved = np.asarray(ids_w.lm_ids != plain.lm_ids).any(1)  # [B, S]
    assert moved[:, image[0]].any() and not np.delete(moved, image[0], axis=1).any()

    def logits(cols):
        return view.forward(params, ex.inputs, Edits(vit_cols=cols))[0]

    twice = jax.jit(logits)(W - 1 - vit_w.vit_cols[0])  # the width mirror applied twice
    np.testing.assert_allclose(twice, jax.jit(logits)(plain.vit_cols[0]), atol=1e-6)


def test_steering_through_the_cache(fixture):
    """A steered run resumed from the clean run's cache (the rows before the object
    words) gives the full steered forward's logits."""
    config, params, view, specs, ex, mirror = fixture
    B, S = ex.inputs.tokens_BxS.shape
    add = np.zeros((B, S, config.lm_width), np.float32)
    rng = np.random.default_rng(1)
    for pos in (ex.spans.x_B, ex.spans.y_B):
        add[np.arange(B), pos] = rng.normal(size=(B, config.lm_width))
    words = [ex.spans.x_B, ex.spans.y_B]

    def both():
        clean = st.unsteered(view, params, ex)[1]
        plain = view._replace(forward_from=None)
        return [st.add_forward(v, params, ex.inputs, 1, add, words, clean) for v in (view, plain)]

    cached, full = jax.jit(both)()
    np.testing.assert_allclose(cached, full, atol=1e-5)
    plain = jax.jit(lambda: view.forward(params, ex.inputs)[0])()
    assert np.abs(np.asarray(full - plain)).max() > 1e-4  # the steering acts


def test_the_patching_report_on_a_checkpoint_resumes(tmp_path, capsys):
    """The patching report on the fixture checkpoint under the authors' protocol, end
    to end (~10 s): one LM layer, the 3 left/right questions in two chunks of 2 (the
    last padded), the change of both words over every question with intervals over
    questions; then resumed after its second chunk is lost (one more table: ~3 s),
    equal to the whole run. (The other reports' checkpoint runs are in their own test
    files, under the authors' protocol too.)"""
    from jaxmech.reports import patching
    from jaxmech.reports.common import analyse_subject

    analyse = lambda run, out, log: analyse_subject(patching.REPORT, run, out, log)  # noqa: E731

    run = open_checkpoint(FOLDER, grid=(2, 2), size=112, questions=3, batch=2, layers=(1,),
                          protocol="authors", log=lambda *_: None)  # fmt: skip
    out = analyse(run, str(tmp_path), log=lambda *_: None)
    assert os.path.exists(tmp_path / "patching" / "summary.json")
    # the estimate, printed before the table computes: forwards x one forward's FLOPs
    (estimate,) = [x for x in capsys.readouterr().out.splitlines() if "estimate:" in x]
    forwards, gflop = re.search(r"= (\d+) forwards of ([\d.e+-]+) GFLOP", estimate).groups()
    assert int(forwards) > 3 * 2 and float(gflop) > 0  # more than the plain and twin runs
    rows = out["tables"]["shifts"]
    assert {r["layer"] for r in rows} == {1} and {r["twin"] for r in rows} == {"mirror", "recolour"}
    assert {r["word"] for r in rows} == {"left", "right", "both"} and {r["n"] for r in rows} == {3}
    assert np.asarray(out["res"]["logp"]["mirror"]["patched"]).shape == (1, 1, len(GROUPS), 3)
    cell = out["summary"]["patches"]["mirror/1/text/left"]["shift_logp"]
    assert cell[3] == 3 and np.isfinite(cell[:3]).all()  # over questions, not NaN
    (store,) = glob.glob(str(tmp_path / "patching" / "chunks" / "*"))
    os.remove(os.path.join(store, "rows_000002-000003.npz"))  # the second chunk
    capsys.readouterr()
    again = analyse(run, str(tmp_path), log=lambda *_: None)
    assert "3/3 questions (2 resumed)" in capsys.readouterr().out  # the progress line
    assert again["tables"]["shifts"] == rows


def test_id_loss_fine_tunes_a_checkpoint_with_the_lm_frozen(tmp_path):
    """Two steps of the authors' recipe per weight on the fixture, end to end: the LM's
    params and the merger stay bit-equal, the ViT's MLP weights move, weight 0's loss has no ID term, and a
    pattern that matches no parameter is refused by name before any compute; a rerun
    resumes each weight from its stored fine-tune, equal. ~13 s: the fine-tune's scan,
    the target's probes and the evaluation compile one program each (the rerun's
    probes and evaluation again)."""
    from jaxmech.reports import id_finetune as idf

    run = open_checkpoint(FOLDER, grid=(2, 2), size=112, questions=4, batch=64, log=lambda *_: None)
    with pytest.raises(ValueError, match="train_only = 'nope/\\*'"):
        idf.run_id_loss(run, str(tmp_path), train_only="nope/*", log=lambda *_: None)
    # remat off: its program is another compile (~5 s); remat's own checks: test_remat.py
    out = idf.run_id_loss(run, str(tmp_path), steps=2, lr=1e-2, remat="off", log=lambda *_: None)
    flat = lambda tree: dict(zip(param_paths(tree), jax.tree_util.tree_leaves(tree)))  # noqa: E731
    before = flat(jax.tree_util.tree_map(lambda x: x[0], run.params))
    for w, tuned in out["params"].items():
        after = flat(tuned)
        trained = {f"vit/block_{i}/{n}" for i in (0, 1) for n in ("W_in", "W_out")}
        assert all(np.array_equal(before[p], after[p]) for p in before if p not in trained)
        assert not np.array_equal(before["vit/block_1/W_out"], after["vit/block_1/W_out"]), w
    rows = {w: [r for r in out["curves"] if r["weight"] == w] for w in (0.0, 1.0)}
    assert [r["step"] for r in rows[1.0]] == [1, 2]
    np.testing.assert_allclose(
        rows[1.0][0]["loss"], rows[1.0][0]["answer"] + rows[1.0][0]["id"], rtol=1e-5
    )
    np.testing.assert_allclose(
        rows[0.0][0]["loss"], rows[0.0][0]["answer"], rtol=1e-6
    )  # no ID term
    assert rows[0.0][0]["answer"] == rows[1.0][0]["answer"]  # the same start and batch
    assert {(r["weight"], r["when"]) for r in out["table"]} == {
        (w, t) for w in (0.0, 1.0) for t in ("before", "after")
    }
    assert os.path.exists(tmp_path / "id_loss" / "summary.json")
    lines = []  # a rerun reads each weight's finished fine-tune instead of redoing it
    again = idf.run_id_loss(run, str(tmp_path), steps=2, lr=1e-2, remat="off", log=lines.append)
    assert sum("resumed" in line for line in lines) == 2
    assert again["table"] == out["table"] and again["curves"] == out["curves"]
    for w, tuned in out["params"].items():
        assert all(np.array_equal(a, b) for a, b in zip(
            jax.tree_util.tree_leaves(tuned), jax.tree_util.tree_leaves(again["params"][w])))  # fmt: skip


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_a_video_view_renders_frames_as_time(variant):
    """Each scene frame is one temporal patch; the spans' cells are (frame, column);
    the view's LM position ids equal the processor's (Qwen2.5-VL's time ids spaced by
    tokens_per_second x seconds per frame); relation 1 is answered Before / After."""
    folder = os.path.join(os.path.dirname(FOLDER), variant)
    _, config, params = load_checkpoint(folder)
    view = checkpoint_view(folder, config, Grid(2, 2), 112, video=True)
    specs = pair_questions(view.grid, 3, view.n_labels, view.n_colours, seed=2, relation=1)
    ex = examples(view, specs["examples"])
    rev = view.render(specs["mirror"], ask=specs["examples"])[0]
    np.testing.assert_array_equal(np.asarray(rev.tokens_BxS), np.asarray(ex.inputs.tokens_BxS))
    P = np.asarray(ex.inputs.pixels_BxPxF).shape[1] // 2  # patches per frame
    np.testing.assert_array_equal(  # time reversal swaps the two frames' patches
        np.asarray(rev.pixels_BxPxF)[:, :P], np.asarray(ex.inputs.pixels_BxPxF)[:, P:]
    )
    np.testing.assert_array_equal(
        view.lm_position_ids(params, ex.spans), np.asarray(ex.inputs.pos_Bx3xS)
    )
    frame = np.asarray(ex.spans.image_trc_Ix3)[:, 0]
    np.testing.assert_array_equal(np.asarray(ex.spans.cell_I) // 2, frame)  # the cell's row
    t_ids = np.take_along_axis(
        np.asarray(ex.inputs.pos_Bx3xS)[:, 0], np.asarray(ex.spans.image_BxI), 1
    )
    # one frame per temporal patch of 2 frames at 2 fps: 1 s, x tokens_per_second (4 here)
    assert (np.ptp(t_ids, 1) == (4 if config.vit_tokens_per_second else 1)).all()
    tok = view.render.args[0].tokenizer
    assert view.answer_words[1].tolist() == [tok.token_to_id("Before"), tok.token_to_id("After")]
    with pytest.raises(ValueError, match="size = 168: the video processor would resize"):
        checkpoint_view(folder, config, Grid(2, 3), 168, video=True)


def test_temporal_ids_on_a_checkpoint(tmp_path):
    """The temporal-ID report on the fixture opened as videos, end to end; a checkpoint
    opened as pictures is refused. ~9-15 s in the suite: it compiles the steering
    program (probes, flip margins, ID curves) for the video view, as the toy's does."""
    from jaxmech.reports import temporal_ids
    from jaxmech.reports.common import analyse_subject

    quiet = lambda *_: None  # noqa: E731
    run = open_checkpoint(FOLDER, grid=(2, 2), size=112, questions=3, video=True, layers=(1,), batch=64,
                          log=quiet)  # fmt: skip
    assert set(np.asarray(run.subject.specs["examples"].relation_B).tolist()) == {1}
    out = analyse_subject(temporal_ids.REPORT, run, str(tmp_path), log=quiet)
    ids = out["tables"]["ids"]
    assert {r["site"] for r in ids} == {0, 1, 2} and "frame_1" in ids[0]
    assert os.path.exists(tmp_path / "temporal_ids" / "temporal_ids.png")
    with pytest.raises(ValueError, match="opened as videos"):
        analyse_subject(
            temporal_ids.REPORT, open_checkpoint(FOLDER, size=112, log=quiet), str(tmp_path)
        )
