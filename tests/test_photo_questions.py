"""The papers' datasets through the reports: photographs rendered by the checkpoint's
processor, bucketed by processed grid, their twins as image transforms
(`reports.batches`), on the tiny Qwen2-VL fixture and the samples in each dataset's
layout (`tests/fixtures/datasets`). The report runs compile a small program per image
size; together ~25 s."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxmech.data.questions import load_questions
from jaxmech.families.qwen2_vl import positions
from jaxmech.reports import batches
from jaxmech.reports.subjects import open_checkpoint

HERE = os.path.dirname(__file__)
QWEN = os.path.join(HERE, "fixtures", "qwen2_vl", "qwen2_vl")
DATA = os.path.join(HERE, "fixtures", "datasets")
FOLDERS = {"coco_spatial": "whatsup", "whatsup_a": "whatsup", "whatsup_b": "whatsup",
           "cvbench": "cvbench", "manifest": "manifest"}  # fmt: skip
quiet = lambda *_: None  # noqa: E731


def opened(source, **kw):
    n = kw.pop("questions", 3 if source == "coco_spatial" else None)
    return open_checkpoint(QWEN, grid=(2, 2), size=112, questions=n, batch=4, layers=(1,),
                           questions_from=source, data=os.path.join(DATA, FOLDERS[source]),
                           log=quiet, **kw)  # fmt: skip


def test_photographs_are_bucketed_by_processed_grid_and_every_one_is_asked():
    run = opened("coco_spatial")
    out = run.subject.question_batches(run, (0, 1), ("mirror", "recolour", "swap"))
    assert len(out) == 2  # the sample's photographs resize to 56 x 56 and 56 x 84
    assert sorted(np.concatenate([b.index for b in out]).tolist()) == [0, 1, 2]
    for b in out:
        n = len(b.index)
        grid = tuple(b.key["image_grid"])
        assert b.examples.inputs.pixels_BxPxF.shape[:2] == (n, grid[1] * grid[2])
        rows, cols, (h, w) = b.view.vit_positions(None)  # this bucket's ViT grid
        assert (h, w) == grid[1:] and len(rows) == grid[1] * grid[2]
        for t in ("mirror", "recolour"):  # same question, same tokens
            np.testing.assert_array_equal(
                b.twins[t].inputs.tokens_BxS, b.examples.inputs.tokens_BxS
            )
        # the mirror answers the other word; the recolour keeps it; the swap swaps it
        np.testing.assert_array_equal(b.twins["mirror"].answer_B, b.examples.other_B)
        np.testing.assert_array_equal(b.twins["recolour"].answer_B, b.examples.answer_B)
        np.testing.assert_array_equal(b.twins["swap"].answer_B, b.examples.other_B)


def test_the_mirror_twin_is_the_processed_patches_flipped():
    """Flipping the photograph then resizing it gives the resized photograph's patches
    flipped (the patch grid mirrored, each patch's pixels reversed along its width)."""
    run = opened("coco_spatial")
    for b in run.subject.question_batches(run, (0,), ("mirror",)):
        _, gh, gw = b.key["image_grid"]
        rows, cols, _ = positions.patch_grid((1, gh, gw), 2)
        at = {(r, c): i for i, (r, c) in enumerate(zip(rows.tolist(), cols.tolist()))}
        perm = np.asarray([at[(r, gw - 1 - c)] for r, c in zip(rows.tolist(), cols.tolist())])
        p = b.examples.inputs.pixels_BxPxF
        x = np.asarray(p).reshape(p.shape[:2] + (3, 2, 14, 14))
        flipped = x[:, perm][..., ::-1].reshape(p.shape)
        np.testing.assert_array_equal(np.asarray(b.twins["mirror"].inputs.pixels_BxPxF), flipped)


def test_relations_a_flip_does_not_swap_are_left_out_and_said():
    qs = load_questions("whatsup_a", os.path.join(DATA, "whatsup"))
    relations = {q.relation for q in qs.questions}
    assert {"on", "under"} & relations and {"left", "right"} & relations
    run = opened("whatsup_a")
    out = run.subject.question_batches(run, (0, 1), ("mirror",))
    asked = [qs.questions[i].relation for b in out for i in b.index]
    assert set(asked) <= {"left", "right"} and len(asked) < len(qs.questions)


@pytest.mark.parametrize(
    "report, source",
    [
        ("patching", "coco_spatial"),
        ("counterfactuals", "cvbench"),
        ("counterfactuals", "whatsup_a"),
        ("steering", "manifest"),
        ("diagnostics", "coco_spatial"),
    ],  # fmt: skip
)
def test_each_report_runs_on_a_dataset_and_records_it(tmp_path, report, source):
    import importlib

    from jaxmech.reports.driver import analyse_subject

    module = importlib.import_module(f"jaxmech.reports.{report}")
    assert module.REPORT.photos
    run = opened(source)
    res = analyse_subject(module.REPORT, run, str(tmp_path), log=quiet)
    summary = json.load(open(tmp_path / report / "summary.json"))
    record = summary["questions"]
    assert record["source"] == source and record["n"] == len(run.subject.photos.questions)
    path = next(iter(record["files"]))
    from jaxmech.data.questions import sha256

    assert record["files"][path] == sha256(path)
    per_question = {"patching": lambda r: r["answer"]}.get(report, lambda r: r["relation"])
    n = len(per_question(res["res"]))
    asked = [q for q in run.subject.photos.questions if batches.photo_relation(q) is not None]
    if report in ("steering", "diagnostics"):  # only the questions with both boxes
        asked = [q for q in asked if q.boxes and all(b is not None for b in q.boxes)]
    assert n == len(asked) > 0


def test_a_report_of_drawn_scenes_refuses_a_dataset_by_name():
    run = opened("cvbench")
    with pytest.raises(ValueError, match="--questions_from=cvbench: this table asks drawn"):
        run.subject.question_specs(run)


def test_bad_dataset_options_are_refused_before_the_weights():
    with pytest.raises(ValueError, match="give the dataset's folder"):
        open_checkpoint(QWEN, grid=(2, 2), size=112, questions_from="cvbench", log=quiet)
    with pytest.raises(ValueError, match="questions_from = 'imagenet'"):
        open_checkpoint(QWEN, grid=(2, 2), size=112, questions_from="imagenet", data=DATA,
                        log=quiet)  # fmt: skip
    with pytest.raises(ValueError, match="only read with a dataset"):
        open_checkpoint(QWEN, grid=(2, 2), size=112, data=DATA, log=quiet)
    with pytest.raises(ValueError, match="has only 3 question"):
        opened("coco_spatial", questions=100)


def test_box_centres_weigh_on_the_cells_as_each_protocol_says():
    """A box centred on cell (0, 1)'s centre of a 2 x 2 grid: all its weight there
    (centred), or split with the next cell as the authors' `utils/coco.py` does."""
    from jaxmech.data.questions import ImageQuestion

    run = opened("coco_spatial")
    view = run.subject.vlm_view
    q = ImageQuestion(None, None, ("left", "right"), ("a", "b"), "left",
                      ((55.0, 15.0, 10.0, 10.0), None), "here")  # fmt: skip
    centred = batches.box_weights(view, q, (80, 80), authors=False)
    np.testing.assert_allclose(centred[0], [0, 1, 0, 0], atol=1e-6)
    assert not centred[1].any()  # no box: no weight
    authors = batches.box_weights(view, q, (80, 80), authors=True)
    np.testing.assert_allclose(authors[0], [0, 0.5, 0, 0.5], atol=1e-6)  # fy = 0.5: half below
    assert np.isclose(authors[0].sum(), 1)


def test_occlusions_hide_the_box_only_and_the_control_box_misses_it():
    from jaxmech.data import image_twins

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 60, 3)).astype(np.uint8)
    box = (10.0, 5.0, 12.0, 8.0)
    for kind in ("blur", "fill"):
        y = image_twins.occluded(x, box, kind)
        inside = np.zeros(x.shape[:2], bool)
        inside[5:13, 10:22] = True
        np.testing.assert_array_equal(y[~inside], x[~inside])
        assert (y[inside] != x[inside]).mean() > 0.5
    other = image_twins.box_elsewhere(box, 60, 40, rng)
    assert other[2:] == box[2:]
    assert (
        other[0] + other[2] <= box[0]
        or box[0] + box[2] <= other[0]
        or other[1] + other[3] <= box[1]
        or box[1] + box[3] <= other[1]
    )
    with pytest.raises(ValueError, match="occlusion = 'erase'"):
        image_twins.occluded(x, box, "erase")


def test_a_photographs_words_are_centred_on_their_text_only_states():
    """The diagnostics read a photograph's word against its state in the question asked
    without the image: centred on its own state instead, every believed displacement is
    0; on the text-only run's, not."""
    import jax

    from jaxmech.analysis import diagnostics as dg
    from jaxmech.analysis import spatial_ids as si

    run = opened("coco_spatial")
    batch = run.subject.question_batches(run, (0, 1), ("fill:x", "fill:y", "fill:random", "text"))[
        0
    ]
    view, ex = batch.view, batch.examples
    assert batch.twins["text"].inputs.image_BxI.shape[1] == 0  # no image tokens
    probes = [[si.probe(view, range(1, 3), named_first=f, relation=r) for f in (True, False)]
              for r in (0, 1)]  # fmt: skip
    occ = jax.tree_util.tree_map(lambda *x: np.stack(x), *(batch.twins[f"fill:{w}"].inputs
                                                           for w in ("x", "y", "random")))  # fmt: skip
    params = jax.tree_util.tree_map(lambda x: x[0], run.params)
    go = lambda text: dg.diagnose(view, params, ex, probes, occ, None, batch.cell_weights, text)  # noqa: E731
    np.testing.assert_allclose(np.asarray(go(ex)["believed"]), 0, atol=1e-5)
    assert np.abs(np.asarray(go(batch.twins["text"])["believed"])).max() > 1e-3
