"""The LLaVA family's VLM view (`families.llava.view`) on the tiny random fixture (values
meaningless, the machinery checked): rendering, spans and position ids, paper 004's
counterfactuals on a learned position table, the resumed forward, and every paper 003 /
004 report through `--checkpoint`'s path."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest
from conftest import quiet

from jaxmech.data.inputs.pictures import object_names
from jaxmech.data.spec import Grid, pair_questions
from jaxmech.families import load_checkpoint
from jaxmech.families.llava.view import checkpoint_view
from jaxmech.families.vlm_view import examples
from jaxmech.reports.common import open_checkpoint

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "llava", "llava")


@pytest.fixture(scope="module")
def fixture():
    _, config, params = load_checkpoint(FOLDER)
    view = checkpoint_view(FOLDER, config, Grid(2, 2), 28)
    specs = pair_questions(view.grid, 4, view.n_labels, view.n_colours, seed=1)
    ex = examples(view, specs["examples"])
    mirror = view.render(specs["mirror"], ask=specs["examples"])[0]
    return config, params, view, specs, ex, mirror


def test_render_spans_and_position_ids(fixture):
    config, params, view, specs, ex, mirror = fixture
    tokens = np.asarray(ex.inputs.tokens_BxS)
    np.testing.assert_array_equal(np.asarray(mirror.tokens_BxS), tokens)  # the same question
    assert not np.array_equal(np.asarray(mirror.pixels_BxPxF), np.asarray(ex.inputs.pixels_BxPxF))
    ids = view.lm_position_ids(params, ex.spans)
    assert ids.shape == (4, 3) + tokens.shape[1:] and (ids == ids[:, :1]).all()
    np.testing.assert_array_equal(ids[:, 0], np.asarray(ex.inputs.pos_BxS))
    # 4 x 4 patches on a 2 x 2 grid: each cell 2 x 2 patches, row-major
    np.testing.assert_array_equal(np.asarray(ex.spans.cell_I).reshape(4, 4),
                                  [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]])  # fmt: skip
    assert (tokens[:, np.asarray(ex.spans.image_BxI)[0]] == config.image_token_id).all()
    tok = view.render.args[0].tokenizer
    for b, (x, y) in enumerate(object_names(specs["examples"])):
        assert tok.id_to_token(int(tokens[b, ex.spans.x_B[b]])) in (x.split()[-1], "<unk>")
        assert tok.id_to_token(int(tokens[b, ex.spans.y_B[b]])) in (y.split()[-1], "<unk>")
    assert view.answer_words[0].tolist() == [tok.token_to_id("Left"), tok.token_to_id("Right")]
    authors = checkpoint_view(FOLDER, config, Grid(2, 2), wording="authors")
    assert authors.size == config.image_size == 28  # no size: the ViT's own
    assert authors.answer_words[0].tolist() == [tok.token_to_id("left"), tok.token_to_id("right")]
    rows, cols, extent = view.vit_positions(params)
    assert extent == (4, 4) and view.vit_blocks(params) == 0
    np.testing.assert_array_equal(view.position_basis(params), params["vit"]["pos"][1:])


def test_bad_views_are_refused_by_name(fixture):
    config = fixture[0]
    with pytest.raises(ValueError, match="size = 448: the processor makes every picture 28 x 28"):
        open_checkpoint(FOLDER, size=448)
    with pytest.raises(ValueError, match="grid = 3 x 3: must divide the ViT's 4 x 4"):
        checkpoint_view(FOLDER, config, Grid(3, 3))
    with pytest.raises(ValueError, match="video = True"):
        checkpoint_view(FOLDER, config, Grid(2, 2), video=True)
    with pytest.raises(ValueError, match="wording = 'plain'"):
        checkpoint_view(FOLDER, config, Grid(2, 2), wording="plain")


def test_a_resumed_run_equals_the_full_one(fixture):
    """`forward_from` (the LM resumed at block 1 from the rows after the image, the rows
    before read from the run's key / value cache) gives the full run's answer logits."""
    config, params, view, specs, ex, mirror = fixture
    start = int(np.asarray(ex.spans.image_BxI).max()) + 1

    def run():
        sites = view.cache_sites + ("lm/resid_pre.1",)
        logits, aux = view.forward(params, ex.inputs, capture=sites)
        x = aux["lm/resid_pre.1"][:, start:]
        return logits, view.forward_from(params, ex.inputs, 1, start, x, aux)

    full, resumed = jax.jit(run)()
    np.testing.assert_allclose(resumed, full, atol=1e-5)


def test_photographs_become_one_size_and_their_boxes_follow_the_crop():
    """A dataset's photographs (COCO-Spatial's sample: 64 x 48, 40 x 70, 48 x 64) all
    become the ViT's 28 x 28, one batch; their boxes map through the centre crop: the
    40 x 70 photograph shows its columns 14.3..54.3 only, so X's box centred at x = 12.5
    has no cell, while the 48 x 64 one keeps both (its columns 6.9..55.4), in the
    bottom row."""
    data = os.path.join(os.path.dirname(__file__), "fixtures", "datasets", "whatsup")
    run = open_checkpoint(FOLDER, grid=(2, 2), size=28, questions=3, layers=(1,), log=quiet,
                          questions_from="coco_spatial", data=data)  # fmt: skip
    (batch,) = run.subject.question_batches(run, (0, 1), ("mirror",))
    assert sorted(batch.index.tolist()) == [0, 1, 2]
    assert np.asarray(batch.examples.inputs.pixels_BxPxF).shape[:2] == (3, 16)
    cells = {run.subject.photos.questions[i].boxes[0][2]: c.tolist()
             for i, c in zip(batch.index, batch.examples.spec.cells_BxK)}  # fmt: skip
    assert cells[21.0] == [-1, -1] and cells[19.0] == [2, 3]  # (40 x 70) and (48 x 64)
    cut = list(batch.index).index(1)
    assert not batch.cell_weights[cut].any() and batch.cell_weights.sum() == 4  # 2 x 2 boxes


def test_ask_answers(tmp_path, capsys):
    from experiments import ask

    image = os.path.join(os.path.dirname(FOLDER), "single0.png")
    try:
        ask.FLAGS([ask.__file__, f"--checkpoint={FOLDER}", f"--image={image}", "--top=3",
                   "--question=Is the red circle above or below the blue square?"])  # fmt: skip
        ask.main([])
    finally:
        ask.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "llava, 2 LM blocks, 4 x 4 patches: image 28 x 28 px, 16 patches" in out
    assert len(re.findall(r"^\s+[123]\s+0\.\d+", out, re.M)) == 3


def _llava_run(protocol="jaxmech", layers=(1,)):
    """The fixture as `--checkpoint` opens it: 2 x 2 cells at 28 px, 2 questions per
    relation, one LM layer."""
    return open_checkpoint(FOLDER, grid=(2, 2), size=28, questions=2, batch=8, layers=layers,
                           protocol=protocol, log=quiet)  # fmt: skip


# slow: every report on LLaVA (~13 s); the same reports on Qwen2-VL and on the stand-in family, and LLaVA's forward (contract test), stay in the suite
@pytest.mark.slow
def test_paper_003_004_reports_run_on_llava(tmp_path):
    """~20 s: the patching (authors' protocol) and counterfactual reports through
    `--checkpoint`'s path (`open_checkpoint`, `analyse_subject`) on the fixture, each one
    compiled table; the temporal-ID report is not the family's (no video view). On the
    learned table the half-cell shift moves the answer margins and shifted-then-mirrored
    is not the mirror (under rotary positions a uniform shift cancels in q . k); the
    plain run is the model's. (Spatial IDs, steering, diagnostics: the slow test below.)"""
    from jaxmech.families.llava.family import FAMILY
    from jaxmech.reports import counterfactuals, patching
    from jaxmech.reports.common import analyse_subject

    out = str(tmp_path)
    assert "temporal_ids" not in FAMILY.reports
    pat = analyse_subject(patching.REPORT, _llava_run("authors"), out, log=quiet)
    assert np.isfinite(pat["res"]["shifts"][("mirror", "both", "logp", "mean")]).all()
    cf = analyse_subject(counterfactuals.REPORT, _llava_run(), out, log=quiet)
    rows = {(r["counterfactual"], r["relation"]): r for r in cf["tables"]["table"]}
    assert rows[("plain", "horizontal")]["changed"] == 0.0
    m, names = np.asarray(cf["res"]["margins"])[0], list(cf["res"]["names"])
    at = {n: m[names.index(n)] for n in ("plain", "vit_half", "vit_w", "vit_half_mirror")}
    assert np.abs(at["vit_half"] - at["plain"]).min() > 1e-5
    assert np.abs(at["vit_half_mirror"] - at["vit_w"]).min() > 1e-5
    for folder in ("patching", "counterfactuals"):
        assert os.path.isfile(os.path.join(out, folder, "summary.json")), folder


@pytest.mark.slow  # ~30 s of compiles (measured 53 s with the two above under CI load)
def test_spatial_ids_steering_and_diagnostics_run_on_llava(tmp_path):
    """The spatial-ID, steering and diagnostics (authors' protocol) reports with
    `--checkpoint` on the fixture (the generic machinery the Qwen fixture's tests cover
    in the suite)."""
    from jaxmech.reports import diagnostics, spatial_ids, steering
    from jaxmech.reports.common import analyse_subject

    out = str(tmp_path)
    ids = analyse_subject(spatial_ids.REPORT, _llava_run(), out, log=quiet)
    assert any(np.isfinite(r["r2"]) for r in ids["tables"]["r2"])
    analyse_subject(steering.REPORT, _llava_run(), out, log=quiet)
    analyse_subject(diagnostics.REPORT, _llava_run("authors", (2,)), out, log=quiet)
    for folder in ("spatial_ids", "steering", "diagnostics"):
        assert os.path.isfile(os.path.join(out, folder, "summary.json")), folder
