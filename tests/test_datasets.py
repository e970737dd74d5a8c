"""The dataset loaders (`data.datasets.questions` and one module per source) on small samples
written in each dataset's real layout (`tests/fixtures/datasets/make_samples.py`; no
real dataset is here): what they read, how they sample, and the errors bad records get."""

import json
import os
import shutil

import numpy as np
import pytest

from jaxmech.data.datasets import questions as q
from jaxmech.data.datasets.questions import load_questions
from jaxmech.data.datasets.whatsup import parse_caption

DATA = os.path.join(os.path.dirname(__file__), "fixtures", "datasets")


def _load(source, folder, **kw):
    return load_questions(source, os.path.join(DATA, folder), **kw)


def test_whatsup_controlled_reads_relations_and_objects_from_file_names():
    a = _load("whatsup_a", "whatsup")
    assert [(x.relation, x.answers[1], x.objects) for x in a.questions] == [
        ("left", "right", ("mug", "plate")), ("right", "left", ("mug", "plate")),
        ("on", "under", ("book", "table")), ("under", "on", ("book", "table"))]  # fmt: skip
    assert all(os.path.isfile(x.image) and x.question is None for x in a.questions)
    b = _load("whatsup_b", "whatsup")
    assert [x.relation for x in b.questions] == ["left", "front", "behind"]
    path = os.path.join(DATA, "whatsup", "controlled_images_dataset.json")
    assert a.files == {path: q.sha256(path)} and a.sample["records"] == 4


def test_coco_triples_parse_skip_and_coco_spatial_samples_with_boxes():
    assert parse_caption("A photo of a dog to the left of a person") == ("dog", "left", "person")
    assert parse_caption("A photo of an apple on top of the table.") == ("apple", "on", "table")
    assert parse_caption("A photo of a dog and a cat") is None
    coco = _load("whatsup_coco", "whatsup")
    assert coco.sample["skipped"] == 1 and len(coco.questions) == 5
    cs = _load("coco_spatial", "whatsup", n=3)
    assert {x.relation for x in cs.questions} == {"left", "right"}
    boxes = {x.objects: x.boxes for x in cs.questions}
    assert boxes[("dog", "person")] == ((2.0, 12.0, 19.0, 24.0), (42.0, 12.0, 19.0, 24.0))
    assert boxes[("cat", "chair")][1] is None and cs.sample["boxes_missing"] == 1
    assert len(cs.files) == 2  # the triples and the COCO instances file, each hashed
    # a seeded sample: the same seed draws the same questions, another seed another order
    again, other = (
        _load("coco_spatial", "whatsup", n=2),
        _load("coco_spatial", "whatsup", n=2, seed=5),
    )
    first = _load("coco_spatial", "whatsup", n=2)
    assert first.questions == again.questions
    assert {x.where for x in other.questions} <= {x.where for x in cs.questions}


def test_coco_spatial_asks_at_most_n_and_says_how_many_it_found():
    """The paper's default 100 on a folder of 3 left / right triples, or 10 asked of
    them: every one, the sample saying how many were asked and found (not an error)."""
    for n, asked in ((None, 100), (10, 10)):
        cs = _load("coco_spatial", "whatsup", n=n)
        assert len(cs.questions) == 3 and cs.sample["found"] == 3
        assert (
            cs.sample["asked"] == asked
            and cs.sample["fewer"] == f"{asked} asked, 3 found: every one taken"
        )
        assert {x.where for x in cs.questions} == {
            x.where for x in _load("coco_spatial", "whatsup", n=3).questions
        }
    m = _load("manifest", "manifest", n=10)  # every source: "at most"
    assert len(m.questions) == 2 and m.sample["fewer"]
    assert "fewer" not in _load("coco_spatial", "whatsup", n=2).sample


def test_coco_spatial_all_gives_every_row_of_both_relations_as_the_authors_steering():
    """`coco_spatial_all`: every left / right and above / below row of the file, in file
    order, boxes where COCO has them (the authors' steering reads every row); the
    default `coco_spatial` keeps its 100 left / right."""
    every = _load("coco_spatial_all", "whatsup")
    assert [(x.objects, x.relation) for x in every.questions] == [
        (("dog", "person"), "left"), (("cup", "laptop"), "right"), (("bird", "car"), "above"),
        (("cat", "chair"), "left"), (("bench", "clock"), "below")]  # fmt: skip
    assert every.source == "coco_spatial_all" and every.sample["skipped"] == 1
    assert every.sample["by_relation"] == {"left": 2, "right": 1, "above": 1, "below": 1}
    assert every.questions[-1].boxes == ((38.0, 14.0, 16.0, 28.0), (2.0, 14.0, 16.0, 28.0))
    assert every.questions[2].boxes[1] is None  # no car annotated
    assert {x.relation for x in _load("coco_spatial", "whatsup").questions} == {"left", "right"}
    drawn = _load("coco_spatial_all", "whatsup", n=2, seed=42)  # a seeded sample when n is given
    assert len(drawn.questions) == 2 and set(drawn.questions) <= set(every.questions)
    from jaxmech.data.datasets import coco_spatial

    with pytest.raises(ValueError, match=r"relations = 'vertical'"):
        coco_spatial.load(os.path.join(DATA, "whatsup"), relations="vertical")


def test_the_authors_sample_seed_draws_their_positions():
    """Under the authors' protocol a dataset's sample is drawn from seed 42 (their
    `random.seed(42)`; jaxmech's 0), and `random.Random(seed).sample` picks the positions
    their `random.sample(range(n), k)` picks."""
    import random

    assert q.sample_seed(None, "authors") == 42 and q.sample_seed(None, "jaxmech") == 0
    assert q.sample_seed(7, "authors") == 7
    items = [f"row {i}" for i in range(250)]
    random.seed(42)
    theirs = [items[i] for i in random.sample(range(len(items)), 100)]
    assert q.sample(items, 100, q.sample_seed(None, "authors")) == theirs


def test_cvbench_jsonl_and_parquet_give_the_same_relation_questions():
    js = _load("cvbench", "cvbench")
    pq = _load("cvbench", os.path.join("cvbench", "parquet"))
    assert js.sample["rows"] == 6 and len(js.questions) == 5  # the Count row left out
    assert [x.answers for x in js.questions] == [
        ("left", "right"),
        ("right", "left"),
        ("below", "above"),
        ("right", "left"),
        ("above", "below"),
    ]
    assert js.questions[0].objects == ("book", "couch")
    assert "annotated by the red box" in js.questions[0].question
    for a, b in zip(js.questions, pq.questions):
        read = lambda x: (x.question, x.answers, x.objects, x.boxes)  # noqa: E731
        assert read(a) == read(b)
        with open(a.image, "rb") as f:
            assert f.read() == b.image  # the parquet row embeds the same image file
    assert {k: v for k, v in js.sample.items() if k.startswith("bbox")} == {
        k: v for k, v in pq.sample.items() if k.startswith("bbox")}  # fmt: skip


def test_cvbench_bbox_is_read_as_corners_of_x_then_y():
    """`bbox` [[x1, y1, x2, y2] of X, of Y] in pixels becomes the questions' [x, y, w, h]
    (the sample's red and blue blocks, `make_samples.blocks`); X's box alone leaves Y's
    None, [] none; the sample says the reading is assumed and checks list order against
    the answers (boxes swapped in a copy: one disagrees)."""
    js = _load("cvbench", "cvbench")
    book, lamp, chair, bottle, clock = js.questions
    assert book.boxes == ((2.0, 10.0, 14.0, 20.0), (34.0, 10.0, 14.0, 20.0))
    assert lamp.boxes[0][0] > lamp.boxes[1][0] and lamp.answers[0] == "right"
    assert bottle.boxes == ((34.0, 10.0, 14.0, 20.0), None) and clock.boxes is None
    from PIL import Image

    for question in (book, lamp, chair):  # each box holds its block: red X, blue Y
        pixels = np.asarray(Image.open(question.image).convert("RGB"), int)
        for box, colour in zip(question.boxes, (0, 2)):
            x, y, w, h = (int(v) for v in box)
            assert (pixels[y : y + h, x : x + w, colour] > 200).all()
    s = js.sample
    assert (s["bbox_both"], s["bbox_x_only"], s["bbox_none"]) == (3, 1, 1)
    # chair's above / below: its blocks side by side, centres level, not counted
    assert (s["bbox_order_agrees"], s["bbox_order_disagrees"]) == (2, 0)
    assert s["bbox_reading"].startswith("assumed")


def test_cvbench_bbox_order_check_and_malformed_boxes(tmp_path):
    c = _copy(tmp_path, "cvbench")
    _rewrite_jsonl(c / "test_2d.jsonl", 1, lambda r: r.update(bbox=r["bbox"][::-1]))
    s = load_questions("cvbench", str(c)).sample
    assert (s["bbox_order_agrees"], s["bbox_order_disagrees"]) == (1, 1)
    for bad, said in (([[5.0, 2.0, 3.0, 4.0]], r"x2 > x1"), ([[1, 2, 3]], r"\[x1, y1, x2, y2\] numbers"),
                      ([[1, 2, 3, 4]] * 3, "one or two"), ("1,2,3,4", "one or two")):  # fmt: skip
        _rewrite_jsonl(c / "test_2d.jsonl", 1, lambda r: r.update(bbox=bad))
        with pytest.raises(ValueError, match=rf"test_2d.jsonl:2: field 'bbox': expected .*{said}"):
            load_questions("cvbench", str(c))
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(c / "parquet" / "test_2d.parquet").to_pylist()
    rows[1]["bbox"] = [[1.0, 4.0, 3.0, 4.0]]  # no height
    pq.write_table(pa.Table.from_pylist(rows), c / "parquet" / "test_2d.parquet")
    with pytest.raises(ValueError, match=r"test_2d.parquet: row 2: field 'bbox': expected x2 > x1"):
        load_questions("cvbench", str(c / "parquet"))


def test_cvbench_reads_both_relation_wordings(tmp_path):
    """CV-Bench's Relation rows with "(annotated by the red box)" and without it (e.g.
    "... of the bottle and the wine glass in the image provided, where is the bottle
    located with respect to the wine glass?"): both read, X and Y from either."""
    for folder in ("cvbench", os.path.join("cvbench", "parquet")):
        js = _load("cvbench", folder)
        assert js.sample["boxed"] == 3 and js.sample["unboxed"] == 2
        plain = [x for x in js.questions if "red box" not in x.question]
        assert [(x.objects, x.answers[0]) for x in plain] == [
            (("bottle", "wine glass"), "right"), (("clock", "shelf"), "above")]  # fmt: skip
        assert plain[0].question.startswith("Considering the relative positions of the bottle and")
    from jaxmech.data.datasets.cvbench import _OBJECTS

    boxed = _OBJECTS.search(
        "Considering the relative positions of the book (annotated by the red box) and the "
        "couch in the image provided, where is the book (annotated by the red box) located?"
    )
    assert (boxed["x"], boxed["y"]) == ("book", "couch")
    # X and Y as the asked clause names them, whatever order the leading clause lists
    c = _copy(tmp_path, "cvbench")
    swapped = CV_SWAPPED.format(x="book", y="couch")
    _rewrite_jsonl(c / "test_2d.jsonl", 0, lambda r: r.update(question=swapped))
    book = load_questions("cvbench", str(c)).questions[0]
    assert book.objects == ("book", "couch") and book.question == swapped


CV_SWAPPED = ("Considering the relative positions of the {y} and the {x} (annotated by the "
              "red box) in the image provided, where is the {x} (annotated by the red box) "
              "located with respect to the {y}?")  # fmt: skip


def test_a_manifest_needs_no_code():
    m = _load("manifest", "manifest")
    a, b = m.questions
    assert a.question is None and a.boxes == ((2.0, 11.0, 18.0, 22.0), (40.0, 11.0, 18.0, 22.0))
    assert b.question.startswith("Is the red block") and b.relation == "right"
    assert b.boxes == (None, None)


def _copy(tmp_path, folder):
    dst = tmp_path / folder
    shutil.copytree(os.path.join(DATA, folder), dst)
    return dst


def _rewrite_jsonl(path, i, change):
    lines = path.read_text().splitlines()
    record = json.loads(lines[i])
    change(record)
    lines[i] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


def test_bad_records_are_refused_naming_file_line_and_field(tmp_path):
    m = _copy(tmp_path, "manifest")
    _rewrite_jsonl(m / "questions.jsonl", 1, lambda r: r.pop("answers"))
    with pytest.raises(ValueError, match=r"questions.jsonl:2: field 'answers': expected two"):
        load_questions("manifest", str(m))
    _rewrite_jsonl(
        m / "questions.jsonl", 1, lambda r: r.update(answers=["l", "r"], boxes=[[1, 2, 0, 4], None])
    )
    with pytest.raises(ValueError, match=r"questions.jsonl:2: field 'boxes': expected a positive"):
        load_questions("manifest", str(m))
    _rewrite_jsonl(m / "questions.jsonl", 0, lambda r: r.update(image="photos/gone.png"))
    with pytest.raises(ValueError, match=r"photos/gone.png: no such file"):
        load_questions("manifest", str(m))
    c = _copy(tmp_path, "cvbench")
    _rewrite_jsonl(c / "test_2d.jsonl", 2, lambda r: r.update(answer="(C)"))
    with pytest.raises(ValueError, match=r"test_2d.jsonl:3: field 'answer'"):
        load_questions("cvbench", str(c))
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(c / "parquet" / "test_2d.parquet").to_pylist()
    rows[2]["answer"] = "(C)"  # the same record as the line above: counted from 1 alike
    pq.write_table(pa.Table.from_pylist(rows), c / "parquet" / "test_2d.parquet")
    with pytest.raises(ValueError, match=r"test_2d.parquet: row 3: field 'answer'"):
        load_questions("cvbench", str(c / "parquet"))
    w = _copy(tmp_path, "whatsup")
    recs = json.loads((w / "controlled_images_dataset.json").read_text())
    recs[1]["caption_options"] = recs[1]["caption_options"][:3]
    (w / "controlled_images_dataset.json").write_text(json.dumps(recs))
    with pytest.raises(
        ValueError, match=r"controlled_images_dataset.json: record 2: field 'caption_options'"
    ):
        load_questions("whatsup_a", str(w))
    ann = json.loads((w / "annotations" / "instances_val2017.json").read_text())
    ann["annotations"][0]["bbox"] = [1, 2, 3]
    (w / "annotations" / "instances_val2017.json").write_text(json.dumps(ann))
    with pytest.raises(ValueError, match=r"instances_val2017.json: annotation 1: field 'bbox'"):
        load_questions("coco_spatial", str(w))
    (w / "coco_qa_two_obj.json").write_text(json.dumps([[139, "A photo of a dog"]]))
    with pytest.raises(ValueError, match=r"coco_qa_two_obj.json: record 1: field 'record'"):
        load_questions("whatsup_coco", str(w))
    os.remove(w / "val2017" / "000000000139.jpg")
    (w / "coco_qa_two_obj.json").write_text(
        json.dumps([[139, "A photo of a dog above a cat", "x"]])
    )
    with pytest.raises(ValueError, match=r"000000000139.jpg: no such file"):
        load_questions("whatsup_coco", str(w))


def test_bad_sources_and_folders_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"questions_from = 'coco'"):
        load_questions("coco", DATA)
    with pytest.raises(ValueError, match=r"data = .*not a folder"):
        load_questions("manifest", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"no CV-Bench 2D file"):
        load_questions("cvbench", str(tmp_path))
    with pytest.raises(ValueError, match=r"n = 0"):
        load_questions("manifest", os.path.join(DATA, "manifest"), n=0)


def _crop(pixels, box):
    x, y, w, h = (int(v) for v in box)
    return pixels[y : y + h, x : x + w]


def test_the_mirror_twin_flips_pixels_boxes_and_answer():
    from jaxmech.data.inputs.image_twins import mirror_twin, open_image

    (question,) = [
        x for x in _load("coco_spatial", "whatsup", n=3).questions if x.objects[0] == "dog"
    ]
    pixels = open_image(question.image)
    flipped, twin = mirror_twin(question, pixels)
    assert twin.answers == ("right", "left") and twin.relation == "right"
    np.testing.assert_array_equal(flipped, pixels[:, ::-1])
    for box, moved in zip(question.boxes, twin.boxes):  # each box holds the same pixels, flipped
        np.testing.assert_array_equal(_crop(flipped, moved), _crop(pixels, box)[:, ::-1])
    back, again = mirror_twin(twin, flipped)
    np.testing.assert_array_equal(back, pixels)
    assert again == question
    vertical = question._replace(relation="above", answers=("above", "below"))
    up, vtwin = mirror_twin(vertical, pixels)
    np.testing.assert_array_equal(up, pixels[::-1])
    assert vtwin.answers == ("below", "above") and vtwin.boxes[0][1] == 48 - 12 - 24
    on = _load("whatsup_a", "whatsup").questions[2]
    assert on.relation == "on"
    none, why = mirror_twin(on, open_image(on.image))
    assert none is None and "no mirror twin" in why
    # a parquet row's embedded image opens as its file does
    js, pq = (
        _load("cvbench", f).questions[0] for f in ("cvbench", os.path.join("cvbench", "parquet"))
    )
    np.testing.assert_array_equal(open_image(js.image), open_image(pq.image))


def test_the_recolour_twin_changes_hue_not_layout_and_is_seeded():
    from jaxmech.data.inputs.image_twins import open_image, recolour_twin

    question = _load("manifest", "manifest").questions[0]
    pixels = open_image(question.image)
    out, same = recolour_twin(question, pixels, np.random.default_rng(0))
    again, _ = recolour_twin(question, pixels, np.random.default_rng(0))
    other, _ = recolour_twin(question, pixels, np.random.default_rng(1))
    assert same == question and out.shape == pixels.shape and out.dtype == np.uint8
    np.testing.assert_array_equal(out, again)
    assert (out != other).any()
    grey = (pixels == 128).all(-1)  # no saturation: the hue does not show
    assert np.abs(out[grey].astype(int) - 128).max() <= 2
    red = (pixels[..., 0] > 200) & (pixels[..., 2] < 60)
    assert np.abs(out[red].astype(int) - pixels[red].astype(int)).max() > 40
