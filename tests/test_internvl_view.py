"""The InternVL family's VLM view (`families.internvl.view`) on the tiny random fixture
(values meaningless, the machinery checked): rendering, spans and positions, the
counterfactual position edits on a learned table, and every paper 003 / 004 report
with `--checkpoint`."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import quiet

import jaxmech
from jaxmech.analysis import counterfactuals as cfa
from jaxmech.data.inputs import pictures
from jaxmech.data.spec import Grid, pair_questions
from jaxmech.families.internvl.view import checkpoint_view
from jaxmech.families.vlm_view import examples

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "internvl", "internvl")


@pytest.fixture(scope="module")
def fixture():
    model = jaxmech.load(FOLDER)
    view = model.view((2, 2), 56)
    specs = pair_questions(view.grid, 3, view.n_labels, view.n_colours, seed=1)
    return model, view, specs, examples(view, specs["examples"])


def test_render_spans_and_positions(fixture):
    """A 56 px scene is one tile of 8 x 8 patches, 4 x 4 LM tokens, 2 x 2 per cell; the
    mirrored scene asks the same tokens over the flipped picture; the view's LM ids are
    the processor's (three equal rows); its ViT positions are the tile's patch grid and
    its position basis the table's pixel shuffle."""
    model, view, specs, ex = fixture
    x = ex.inputs
    assert x.pixels_BxTxPxF.shape[1:3] == (1, 64) and x.image_BxI.shape[1] == 16
    assert np.bincount(np.asarray(ex.spans.cell_I)).tolist() == [4, 4, 4, 4]
    assert np.asarray(ex.spans.cell_I).reshape(4, 4)[:2, :2].tolist() == [[0, 0], [0, 0]]
    mirror = view.render(specs["mirror"], ask=specs["examples"])[0]
    np.testing.assert_array_equal(np.asarray(mirror.tokens_BxS), np.asarray(x.tokens_BxS))
    p = 7  # the picture of the mirrored spec is the picture flipped (x-symmetric glyphs)
    tiles = lambda px: np.asarray(px).reshape(-1, 8, 8, 3, p, p)  # noqa: E731
    np.testing.assert_array_equal(
        tiles(mirror.pixels_BxTxPxF), tiles(x.pixels_BxTxPxF)[:, :, ::-1, :, :, ::-1]
    )
    ids = view.lm_position_ids(model.params, ex.spans)
    assert ids.shape[1] == 3 and (ids == np.asarray(x.pos_BxS)[:, None]).all()
    rows, cols, extent = view.vit_positions(model.params)
    assert extent == (8, 8) and (rows * 8 + cols == np.arange(64)).all()
    basis = np.asarray(view.position_basis(model.params))
    table = np.asarray(model.params["vit"]["pos"])
    np.testing.assert_array_equal(basis[1].reshape(4, -1)[1], table[0, 3])  # token (0, 1), block 1
    assert view.vit_blocks(model.params) == 0 and view.image_grid(56, 56) == (1, 8, 8)
    tok = model.tokenizer
    assert view.answer_words[0].tolist() == [tok.token_to_id("Left"), tok.token_to_id("Right")]
    enc = model.encode(list(pictures.draw(view.grid, specs["examples"], 56))[:1], ["Is it?"])
    assert enc.describe() == "1 tile(s) of 56 px (1 x 1), 16 image tokens, 26 tokens"
    # a photograph is tiled as the reference's processor tiles it (tests/test_internvl_tiles.py)
    q = "Is the red circle to the left or the right of the blue square?"
    photo, sp = view.render_images([np.zeros((30, 70, 3), np.uint8)], [q], [("circle", "square")])
    assert photo.pixels_BxTxPxF.shape[1:3] == (11, 64) and sp.x_B[0] < sp.y_B[0]
    text, sp = view.render_text([q], [("circle", "square")])
    assert text.pixels_BxTxPxF.shape[1] == 0 and sp.image_BxI.shape == (1, 0)


def test_bad_views_are_refused_by_name(fixture):
    config = fixture[0].config
    with pytest.raises(ValueError, match="size = 112: expected the tile size 56"):
        checkpoint_view(FOLDER, config, Grid(2, 2), 112)
    with pytest.raises(ValueError, match="size = 56: its 4 x 4 LM tokens do not split"):
        checkpoint_view(FOLDER, config, Grid(3, 3), 56)
    with pytest.raises(ValueError, match="video = True"):
        checkpoint_view(FOLDER, config, Grid(2, 2), 56, video=True)
    with pytest.raises(ValueError, match="wording = 'x'"):
        checkpoint_view(FOLDER, config, Grid(2, 2), 56, wording="x")
    assert checkpoint_view(FOLDER, config, Grid(2, 2)).size == 56  # no size: the tile's


def test_counterfactual_positions_on_a_learned_table(fixture):
    """The counterfactuals' ViT edits are one [P] row (positions enter once): the width
    mirror is a permutation of the table's columns, the half-cell shift a position
    between two columns; every counterfactual is offered but no per-block one."""
    model, view, specs, ex = fixture
    names = cfa.names_for(view, model.params)
    assert "vit_half" in names and not any("@" in n for n in names)
    cfs = cfa.build(view, model.params, ex.spans, ("plain", "vit_w", "vit_half"))
    plain, vit_w, half = (np.asarray(cfs.vit_cols[i]) for i in range(3))
    np.testing.assert_array_equal(vit_w, 7 - plain)
    np.testing.assert_array_equal(half, plain + 0.5)
    assert sorted(vit_w.tolist()) == sorted(plain.tolist())  # a permutation


def run_report(report, protocol="jaxmech", layers=(1,), out=None):
    """`report` with `--checkpoint` on the fixture: 2 x 2 cells at 56 px, 2 questions per
    relation, one LM layer."""
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    run = open_checkpoint(FOLDER, grid=(2, 2), size=56, questions=2, batch=8, layers=layers,
                          protocol=protocol, log=quiet)  # fmt: skip
    res = analyse_subject(report.REPORT, run, out, log=quiet)
    assert os.path.isfile(os.path.join(out, report.REPORT.folder, "summary.json"))
    return res


# slow: every report on a third family (~14 s); the same reports on Qwen2-VL and LLaVA and InternVL's forward (contract test) stay in the suite
@pytest.mark.slow
def test_paper_003_004_reports_run_on_internvl(tmp_path):
    """~20 s on a quiet machine (estimate): the patching (authors' protocol: the
    resumed forward) and counterfactual reports with `--checkpoint` on the fixture, each
    one compiled table (spatial IDs, steering, diagnostics: the slow test below, ~2 x
    this); on the learned table the half-cell shift moves every answer margin (under
    rotary positions it would cancel), and the plain run is the model's."""
    from jaxmech.reports import counterfactuals, patching

    out = str(tmp_path)
    pat = run_report(patching, "authors", out=out)
    assert np.isfinite(pat["res"]["shifts"][("mirror", "both", "logp", "mean")]).all()
    cf = run_report(counterfactuals, out=out)
    rows = {(r["counterfactual"], r["relation"]): r for r in cf["tables"]["table"]}
    assert rows[("plain", "horizontal")]["changed"] == 0.0
    m, names = np.asarray(cf["res"]["margins"])[0], list(cf["res"]["names"])
    assert np.abs(m[names.index("vit_half")] - m[names.index("plain")]).min() > 1e-3


@pytest.mark.slow  # ~35 s of compiles on a quiet machine (estimate), past the suite's budget
def test_spatial_ids_steering_and_diagnostics_run_on_internvl(tmp_path):
    """The spatial-ID (its rank-k fits on the table's pixel shuffle), steering and
    diagnostics reports with `--checkpoint` on the fixture (the generic machinery the
    Qwen fixture's tests cover in the suite)."""
    from jaxmech.reports import diagnostics, spatial_ids, steering

    ids = run_report(spatial_ids, out=str(tmp_path))
    assert any(np.isfinite(r["r2"]) for r in ids["tables"]["r2"])
    run_report(steering, out=str(tmp_path))
    diag = run_report(diagnostics, "authors", (2,), out=str(tmp_path))
    assert {r["site"] for r in diag["tables"]["deviation"]} == {2}
