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

from jaxmech.data.datasets.questions import load_questions
from jaxmech.families.qwen2_vl import positions
from jaxmech.reports import batches
from jaxmech.reports.checkpoints import open_checkpoint
from jaxmech.reports.questions import photo_relations

HERE = os.path.dirname(__file__)
QWEN = os.path.join(HERE, "fixtures", "qwen2_vl", "qwen2_vl")
DATA = os.path.join(HERE, "fixtures", "datasets")
FOLDERS = {"coco_spatial": "whatsup", "whatsup_a": "whatsup", "whatsup_b": "whatsup",
           "cvbench": "cvbench", "manifest": "manifest"}  # fmt: skip
quiet = lambda *_: None  # noqa: E731


def opened(source, **kw):
    n = kw.pop("questions", 3 if source == "coco_spatial" else None)
    batch = kw.pop("batch", 4)
    return open_checkpoint(QWEN, grid=(2, 2), size=112, questions=n, batch=batch, layers=(1,),
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
        # slow: patching on photographs stays in the suite through test_authors_patching
        pytest.param("patching", "coco_spatial", marks=pytest.mark.slow),
        ("counterfactuals", "cvbench"),  # What'sUp A's: `test_the_counterfactual_table_has_...`
        # slow (~16 s each: a compile of the steering program on photographs); in the
        # suite the authors' steering asks photographs' questions in
        # test_steering.py::test_the_authors_steering_asks_questions_without_boxes, and a
        # report's dataset record is the counterfactual and diagnostics cases'
        pytest.param("steering", "manifest", marks=pytest.mark.slow),
        pytest.param("steering", "manifest:authors", marks=pytest.mark.slow),
        ("diagnostics", "coco_spatial"),
    ],  # fmt: skip
)
def test_each_report_runs_on_a_dataset_and_records_it(tmp_path, report, source):
    import importlib

    from jaxmech.reports.driver import analyse_subject

    module = importlib.import_module(f"jaxmech.reports.{report}")
    assert module.REPORT.photos
    source, _, protocol = source.partition(":")
    run = opened(source, protocol=protocol or "jaxmech")
    # the authors' steering generates replies on this family: 1 token, not their 250
    chosen = module.report(1) if (report, protocol) == ("steering", "authors") else module.REPORT
    res = analyse_subject(chosen, run, str(tmp_path), log=quiet)
    summary = json.load(open(tmp_path / report / "summary.json"))
    record = summary["questions"]
    assert record["source"] == source and record["n"] == len(run.subject.photos.questions)
    path = next(iter(record["files"]))
    from jaxmech.data.datasets.questions import sha256

    assert record["files"][path] == sha256(path)
    per_question = {"patching": lambda r: r["answer"]}.get(report, lambda r: r["relation"])
    n = len(per_question(res["res"]))
    asked = [q for q in run.subject.photos.questions if batches.photo_relation(q) in (0, 1)]
    boxed = [q for q in asked if q.boxes and all(b is not None for b in q.boxes)]
    if report == "steering" and protocol == "authors":
        # every question steered (corner IDs, no box read); the box-based tables keep
        # the questions with both boxes (the manifest's second has none)
        assert len(res["res"]["authors"]["plain"][0, 0]) == len(asked) == 2
        n = len(res["res"]["flip_rates"][("flips", "id", "horizontal")][0, 0, 0])
        assert summary["authors/both"]["id"][3] == 1  # one model: its top-sites mean
        assert (tmp_path / "steering" / "steering_paper.png").exists()  # Fig. 2, beside
        assert summary["steerability"]["accuracy"][3] == len(asked)  # Fig. 9's point
    if report in ("steering", "diagnostics"):  # only the questions with both boxes
        asked = boxed
    assert n == len(asked) > 0
    if report == "counterfactuals":  # CV-Bench's bbox: the objects' order is read
        _cvbench_order_rows(tmp_path, res["res"], boxed)


def _cvbench_order_rows(tmp_path, res, boxed):
    """Post-hoc (b) on CV-Bench: each left / right question with both boxes (in
    distinct cells) counts once per random order, reversed or kept; (c) too is written."""
    import csv

    from jaxmech.analysis import counterfactuals as cfa

    rows = {(r["relation"], r["row"]): r
            for r in csv.DictReader(open(tmp_path / "counterfactuals" / "posthoc.csv"))}  # fmt: skip
    both = sum(batches.photo_relation(q) == 0 for q in boxed)  # the third: X's box only
    known = np.isfinite(res["reversed"][:, res["relation"] == 0])
    orders = len(cfa.RANDOM_ORDERS)
    assert both == 2 and known.sum() == both * orders == known.all(0).sum() * orders
    counted = [int(rows["horizontal", k]["n"]) for k in ("flips_reversed", "flips_kept")]
    assert sum(counted) == both * len(cfa.RANDOM_ORDERS)
    assert ("vertical", "back_minus_left_right") in rows


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


def test_at_most_n_questions_and_the_authors_sample_seed():
    """`--questions` is at most: 100 of a folder of 3 left / right triples asks the 3,
    the log saying how many were found; a dataset's sample is drawn from seed 42 under
    the authors' protocol (their `random.seed(42)`), 0 under jaxmech's, a given seed
    kept under both."""
    lines = []
    run = open_checkpoint(QWEN, grid=(2, 2), size=112, questions=100, batch=4, layers=(1,),
                          questions_from="coco_spatial", data=os.path.join(DATA, "whatsup"),
                          log=lines.append)  # fmt: skip
    assert len(run.subject.photos.questions) == 3
    assert any("100 asked, 3 found: every one taken" in x for x in lines)
    assert opened("coco_spatial", protocol="authors").subject.photos.sample["seed"] == 42
    assert opened("coco_spatial").subject.photos.sample["seed"] == 0
    assert opened("coco_spatial", protocol="authors", seed=5).subject.photos.sample["seed"] == 5
    drawn = opened("coco_spatial", protocol="authors").subject.key["seed"]
    assert drawn == 0  # the drawn scenes' seed stays jaxmech's


def test_box_centres_weigh_on_the_cells_as_each_protocol_says():
    """A box centred on cell (0, 1)'s centre of a 2 x 2 grid: all its weight there
    (centred), or split with the next cell as the authors' `utils/coco.py` does; in
    the last column their dict literal keeps only the last weight of the repeated
    cell (x0 == x1), so their weights there sum to 1 - wx, here 0.5."""
    from jaxmech.data.datasets.questions import ImageQuestion

    run = opened("coco_spatial")
    view = run.subject.vlm_view
    q = ImageQuestion(None, None, ("left", "right"), ("a", "b"), "left",
                      ((55.0, 15.0, 10.0, 10.0), None), "here")  # fmt: skip
    centred = batches.box_weights(view, q, (80, 80), authors=False)
    np.testing.assert_allclose(centred[0], [0, 1, 0, 0], atol=1e-6)
    assert not centred[1].any()  # no box: no weight
    authors = batches.box_weights(view, q, (80, 80), authors=True)
    np.testing.assert_allclose(authors[0], [0, 0.25, 0, 0.25], atol=1e-6)  # fx = 1.5, fy = 0.5
    inner = q._replace(boxes=((15.0, 15.0, 10.0, 10.0), None))  # fx = fy = 0.5: four cells
    np.testing.assert_allclose(batches.box_weights(view, inner, (80, 80), True)[0], [0.25] * 4)


def test_occlusions_hide_the_box_only_and_the_control_box_misses_it():
    from jaxmech.data.inputs import image_twins

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


def test_the_blur_is_the_authors_radius_20():
    """The authors' `coco_blur.sh` blurs at radius 20 (their script's default, 15, is
    overridden there): the box's pixels are PIL's Gaussian blur of radius 20."""
    from PIL import Image, ImageFilter

    from jaxmech.data.inputs import image_twins

    x = np.random.default_rng(1).integers(0, 256, (60, 80, 3)).astype(np.uint8)
    box = (10.0, 5.0, 50.0, 40.0)
    want = np.asarray(Image.fromarray(x[5:45, 10:60]).filter(ImageFilter.GaussianBlur(20)))
    np.testing.assert_array_equal(image_twins.occluded(x, box, "blur")[5:45, 10:60], want)


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
    # one compiled call for both centrings (op by op, the two diagnoses cost ~20 s)
    go = jax.jit(lambda text: dg.diagnose(view, params, ex, probes, occ, None,
                                          batch.cell_weights, text)["believed"])  # fmt: skip
    np.testing.assert_allclose(np.asarray(go(ex)), 0, atol=1e-5)
    assert np.abs(np.asarray(go(batch.twins["text"]))).max() > 1e-3


def readable(run):
    """`run` whose view reads on / under and front / behind as a real tokenizer does:
    the fixture's word-level one has neither pair (both words read as [UNK]), so two
    pairs of its own distinct words stand in for them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(QWEN, "tokenizer.json"))
    view = run.subject.vlm_view
    words = np.asarray(view.answer_words).copy()
    words[3] = [tok.token_to_id("before"), tok.token_to_id("after")]
    words[4] = [tok.token_to_id("yes"), tok.token_to_id("no")]

    def read(v):  # each photograph bucket's view too
        return v._replace(answer_words=words, at_image_grid=lambda g: read(v.at_image_grid(g)))

    return run._replace(subject=run.subject._replace(vlm_view=read(view)))


def test_on_under_and_front_behind_are_asked_where_their_words_can_be_read():
    """What'sUp A's on / under and B's front / behind: where the tokenizer reads both
    answer words alike they are left out, saying why, and asking for them is refused;
    where it tells them apart, their answers are the relation's words, the height flip
    swaps on / under (as above / below) and no flip swaps front / behind, so it has no
    mirror twin."""
    run = opened("whatsup_a")
    ids, unread = photo_relations(run)
    assert ids == () and "both answer words begin with token" in unread["on_under"]
    with pytest.raises(ValueError, match="relations: on_under asked, but relation 3"):
        run.subject.question_batches(run, (3,), ())
    run = readable(run)
    assert photo_relations(run) == ((3,), {})
    words = np.asarray(run.subject.vlm_view.answer_words)
    (b,) = run.subject.question_batches(run, (0, 1, 3), ("swap", "scene:1", "scene:2"))
    rel = [run.subject.photos.questions[i].relation for i in b.index]
    on = np.isin(rel, ["on", "under"])
    assert on.sum() == 2 and (~on).sum() == 2  # the sample's two of each
    want = [words[3, 0] if r == "on" else words[3, 1] for r in np.asarray(rel)[on]]
    np.testing.assert_array_equal(b.examples.answer_B[on], want)
    twins = b.twins
    np.testing.assert_array_equal(twins["swap"].answer_B, b.examples.other_B)
    height = np.where(on, b.examples.other_B, b.examples.answer_B)  # swaps on / under only
    np.testing.assert_array_equal(twins["scene:2"].answer_B, height)
    width = np.where(on, b.examples.answer_B, b.examples.other_B)  # swaps left / right only
    np.testing.assert_array_equal(twins["scene:1"].answer_B, width)
    with pytest.raises(ValueError, match="on_under, which has no mirror twin .its height flip"):
        run.subject.question_batches(run, (0, 3), ("mirror",))
    run = readable(opened("whatsup_b"))
    (b,) = run.subject.question_batches(run, (4,), ("scene:1", "scene:2"))
    for t in ("scene:1", "scene:2"):  # no flip swaps front / behind
        np.testing.assert_array_equal(b.twins[t].answer_B, b.examples.answer_B)
    with pytest.raises(ValueError, match="front_behind, which has no mirror twin .no image flip"):
        run.subject.question_batches(run, (4,), ("mirror",))
    q = run.subject.photos.questions[1]
    assert batches.worded(q, 4, "authors").endswith(
        'behind the sphere? Answer "front" or "behind" only.'
    )
    assert (
        batches.worded(q, 3, "jaxmech")
        == "Is the cube on or under the sphere? Answer with one word."
    )


def test_the_counterfactual_table_has_on_under_and_front_behind_rows(tmp_path):
    """One report run on What'sUp A's images (one size: one compile), its left / right
    and on / under questions and two front / behind ones asked of the same images:
    on / under's reference is the height mirror (its own row agrees with itself),
    front / behind has none (agree empty, relations.csv says so) and its changed
    shares are numbers over its 2 questions; above / below, asked of none, is empty. The
    dataset is recorded as every report's (`test_each_report_runs_on_a_dataset_...`)."""
    import csv

    from jaxmech.analysis import counterfactuals as cfa
    from jaxmech.data.datasets.questions import OPPOSITE, sha256
    from jaxmech.reports import counterfactuals as report
    from jaxmech.reports.driver import analyse_subject

    run = readable(opened("whatsup_a", batch=8))
    photos = run.subject.photos
    on = [q for q in photos.questions if q.relation in ("on", "under")]
    fb = tuple(
        q._replace(relation=r, answers=(r, OPPOSITE[r])) for q, r in zip(on, ("front", "behind"))
    )
    run = run._replace(
        subject=run.subject._replace(photos=photos._replace(questions=photos.questions + fb))
    )
    lines = []
    out = analyse_subject(report.REPORT, run, str(tmp_path), log=lines.append)
    record = out["summary"]["questions"]
    path = next(iter(record["files"]))
    assert record["source"] == "whatsup_a" and record["files"][path] == sha256(path)
    assert len(out["res"]["relation"]) == 6  # the sample's 4 and the 2 asked of its images
    read = lambda name: list(csv.DictReader(open(tmp_path / "counterfactuals" / f"{name}.csv")))  # noqa: E731
    rows = {(r["counterfactual"], r["relation"]): r for r in read("table")}
    n = {
        rel: rows["plain", rel]["n"]
        for rel in ("horizontal", "vertical", "on_under", "front_behind")
    }
    assert n == {"horizontal": "2", "vertical": "0", "on_under": "2", "front_behind": "2"}
    assert rows["image_h", "on_under"]["agree_mirror"] == "1.0"  # its own reference
    assert rows["image_w", "horizontal"]["agree_mirror"] == "1.0"
    for name in out["res"]["names"]:
        assert rows[name, "front_behind"]["agree_mirror"] == "nan"
        assert 0 <= float(rows[name, "front_behind"]["changed"]) <= 1
        assert rows[name, "vertical"]["changed"] == "nan"  # n = 0: never 0.0
    relations = {r["relation"]: r for r in read("relations")}
    assert (
        relations["on_under"]["mirror"] == "image_h" and relations["front_behind"]["mirror"] == ""
    )
    assert relations["front_behind"]["reference"].startswith("no image mirror swaps it")
    summary = out["summary"]
    assert summary["relations"]["front_behind"]["mirror"] is None
    assert summary["vit_w/front_behind"]["changed"][3] == 2
    assert np.isfinite(summary["vit_w/front_behind"]["changed"][0])
    margins = out["res"]["margins"][0, 0]  # read between two distinct words: never 0
    assert np.abs(margins[np.isin(out["res"]["relation"], (3, 4))]).min() > 0
    plain = next(x for x in lines if x.strip().startswith("plain "))
    assert "no mirror" in plain and "empty (n = 0)" in plain
    # content and order flipped, codes not: the flipped photograph with the ViT's codes
    # mirrored back (`cfa.PHOTO_CHANGES`); facings alone cannot flip in a photograph
    names = out["res"]["names"]
    assert {"facing_order_w", "facing_order_h"} <= set(names) and "facing_order_ids_w" not in names
    assert rows["facing_order_h", "on_under"]["n"] == "2"
    # post-hoc rows (paper 004): the relation words' logits read beside the margins
    # (left, right and the stand-ins for on, under, front, behind: 6 words, chance 1/5;
    # the margin is one pair's difference), random orders in the table, and no boxes
    # in What'sUp: n = 0, NaN
    res = out["res"]
    assert set(cfa.RANDOM_ORDERS) <= set(names) and res["words"].shape[2] == 6
    pair = res["pair"]
    w = res["words"][0][:, :, pair >= 0]  # [C, W, b]
    p = pair[pair >= 0]
    diff = np.take_along_axis(w, 2 * p[None, None], 1) - np.take_along_axis(w, 2 * p[None, None] + 1, 1)  # fmt: skip
    np.testing.assert_allclose(
        np.abs(diff[:, 0]), np.abs(res["margins"][0][:, pair >= 0]), atol=1e-5
    )
    posthoc = {(r["relation"], r["row"]): r for r in read("posthoc")}
    # (a), (b) and (c) per relation, and (c) minus left / right's beside the other three
    assert len(posthoc) == 4 * 5 + 3 and posthoc["horizontal", "mirror_landing"]["chance"] == "0.2"
    assert posthoc["on_under", "flips_reversed"]["n"] == "0"
    assert posthoc["on_under", "flips_reversed"]["share"] == "nan"
    _back_to_original_rows(posthoc, res, summary, lines)


def _back_to_original_rows(posthoc, res, summary, lines):
    """Post-hoc (c) on What'sUp A (`test_the_counterfactual_table_has_...`): per relation,
    of the questions its image mirror changed, the share facing_order_* answers as the
    plain photograph; front / behind (no mirror) and above / below (no question) empty."""
    says, names = res["margins"][0] > 0, list(res["names"])
    for r, rel, mirror, back in ((0, "horizontal", "image_w", "facing_order_w"),
                                 (3, "on_under", "image_h", "facing_order_h")):  # fmt: skip
        w = res["relation"] == r
        changed = (says[names.index(mirror)] != says[0])[w]
        back_ = (says[names.index(back)] == says[0])[w] & changed
        row = posthoc[rel, "back_to_original"]
        assert int(row["n"]) == changed.sum()
        if changed.any():
            assert np.isclose(float(row["share"]), back_.sum() / changed.sum())
            assert float(row["ci_low"]) <= float(row["share"]) <= float(row["ci_high"])
        else:
            assert row["share"] == "nan"
    for rel in ("front_behind", "vertical"):
        assert posthoc[rel, "back_to_original"]["n"] == "0"
        assert posthoc[rel, "back_minus_left_right"]["share"] == "nan"
    cell = summary["posthoc"]["0"]["on_under"]["back_to_original"]
    assert cell[3] == int(posthoc["on_under", "back_to_original"]["n"])
    said = [x for x in lines if x.strip().startswith("front_behind") and "back" in x]
    assert len(said) == 2 and all(x.endswith("empty (n = 0)") for x in said)
