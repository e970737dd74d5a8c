"""jaxmech against the authors' occlusion experiment (paper 003, Fig. 8B):
`ground_truth_deviation/coco_blur.py --blur_radius 20` (`coco_blur.sh`) run unmodified
on `llava_336` (their `llava-7b`) and `qwen2vl_28` (their `qwen2-2b`) and the
COCO-Spatial sample's rows it can ask (139, 285, 885), with PYTHONHASHSEED=0, plus the
boxes their process used and `fig_8a.ipynb` / `fig_8b.ipynb`'s arithmetic, stored in
`occlusion.npz` by `tests/fixtures/authors/make_authors_occlusion.py`.

Tolerances: log p are float32 forwards of both codes, 1e-4 absolute (seen: 4e-6 on
LLaVA, 5e-7 on Qwen2-VL); the figure's arithmetic on their stored numbers, 1e-6.
The Qwen2-VL fixture's vocabulary has no "Left" / "Right" / "Above" / "Below" piece (it
was written for their steering's lower-case words): both answer words are its unknown
token there, so its correct and wrong log p are one number; LLaVA's has "▁Left" etc.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
AUTHORS = os.path.join(HERE, "fixtures", "authors")
SAMPLE = os.path.join(HERE, "fixtures", "datasets", "whatsup")
COMMIT = "1c034d6ecbe1494c450d412f52fdf98e4a4c51c2"
FOLDERS = {"llava": "llava_336", "qwen2": "qwen2vl_28"}
RELATION = {"to the left of": "left", "to the right of": "right", "above": "above",
            "below": "below"}  # fmt: skip


def reference(family: str) -> dict:
    ref = np.load(os.path.join(AUTHORS, "occlusion.npz"))
    assert str(ref["commit"]) == COMMIT and int(ref["blur_radius"]) == 20
    return {k[len(family) + 1 :]: ref[k] for k in ref.files if k.startswith(family + "_")}


def coco() -> dict:
    with open(os.path.join(SAMPLE, "annotations", "instances_val2017.json")) as f:
        return json.load(f)


def their_rows() -> dict:
    """{image id: (X, Y, relation)} of the sample's captions."""
    with open(os.path.join(SAMPLE, "coco_qa_two_obj.json")) as f:
        rows = json.load(f)
    out = {}
    for image_id, caption, _ in rows:
        for phrase, rel in RELATION.items():
            if f" {phrase} a " in caption:
                x, y = caption[len("A photo of a ") :].split(f" {phrase} a ")
                out[image_id] = (x, y, rel)
    return out


@pytest.mark.parametrize("family", ["llava", "qwen2"])
def test_their_boxes_are_jaxmechs_choice(family):
    """X's and Y's box their process blurred / avoided are `pick_pair` over
    `category_boxes` (exact category name, every instance); their 10 boxes elsewhere
    have X's size, lie in the photograph and meet neither box, as `boxes_elsewhere`'s."""
    from PIL import Image

    from jaxmech.data.inputs import occlusion_boxes as ob

    ref, rows, c = reference(family), their_rows(), coco()
    assert ref["image_id"].tolist() == [139, 285, 885]
    for image_id, theirs, elsewhere in zip(ref["image_id"], ref["boxes_Qx2x4"],
                                           ref["elsewhere_Qx10x4"]):  # fmt: skip
        x, y, rel = rows[int(image_id)]
        mine = ob.pick_pair(ob.category_boxes(c, int(image_id), x),
                            ob.category_boxes(c, int(image_id), y), rel)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(mine), theirs)
        w, h = Image.open(os.path.join(SAMPLE, "val2017", f"{int(image_id):012d}.jpg")).size
        for b in elsewhere:
            assert tuple(b[2:]) == tuple(round(v) for v in theirs[0][2:])
            assert 0 <= b[0] <= w - b[2] and 0 <= b[1] <= h - b[3]
            assert not ob.meets(b, theirs[0]) and not ob.meets(b, theirs[1])


def test_pick_pair_takes_the_best_fitting_instances_by_exact_name(tmp_path):
    """Their choice among several instances (the pair whose centres best fit the
    relation, X-major, the first best kept) and by exact category name; the
    COCO-Spatial loader's (`box_finder`: the first instance whose category name
    contains the word) takes the hot dog for "dog" and the first dog."""
    from jaxmech.data.datasets.coco_spatial import box_finder
    from jaxmech.data.inputs import occlusion_boxes as ob

    c = {"categories": [{"id": 1, "name": "hot dog"}, {"id": 2, "name": "dog"},
                        {"id": 3, "name": "cat"}],
         "annotations": [{"image_id": 7, "category_id": 1, "bbox": [0, 0, 4, 4]},
                         {"image_id": 7, "category_id": 2, "bbox": [50, 0, 10, 10]},
                         {"image_id": 7, "category_id": 2, "bbox": [5, 0, 10, 10]},
                         {"image_id": 7, "category_id": 2, "bbox": [5, 20, 10, 10]},
                         {"image_id": 7, "category_id": 3, "bbox": [30, 0, 10, 10]},
                         {"image_id": 8, "category_id": 2, "bbox": [0, 0, 1, 1]}]}  # fmt: skip
    dogs, cats = ob.category_boxes(c, 7, "dog"), ob.category_boxes(c, 7, "cat")
    assert dogs == [[50, 0, 10, 10], [5, 0, 10, 10], [5, 20, 10, 10]]
    assert ob.pick_pair(dogs, cats, "left") == ([5, 0, 10, 10], [30, 0, 10, 10])
    assert ob.pick_pair(dogs, cats, "right") == ([50, 0, 10, 10], [30, 0, 10, 10])
    assert ob.pick_pair(dogs, cats, "below")[0] == [5, 20, 10, 10]
    path = tmp_path / "instances.json"
    with open(path, "w") as f:
        json.dump(c | {"images": []}, f)
    assert box_finder(path)(7, "dog") == (0, 0, 4, 4)  # the loader's: not theirs
    with pytest.raises(ValueError, match="relation"):
        ob.pick_pair(dogs, cats, "on")
    with pytest.raises(ValueError, match="y_boxes"):
        ob.pick_pair(dogs, [], "left")


def test_boxes_elsewhere_follow_their_rules():
    """`boxes_elsewhere`: n boxes of X's rounded size, inside, meeting no forbidden box
    (sharing an edge allowed); where only a few places fit, those repeated; where none
    does, one box at (0, 0); a box larger than the image, none; the draws seeded."""
    from jaxmech.data.inputs import occlusion_boxes as ob

    rng = lambda: np.random.default_rng(3)  # noqa: E731
    x, y = [0, 0, 10.4, 19.6], [30, 0, 10, 20]  # rounded: 10 x 20, the image's height
    got = ob.boxes_elsewhere(x, [x, y], 40, 20, rng())
    assert got.shape == (10, 4) and (got[:, 1:] == [0, 10, 20]).all()
    assert not any(ob.meets(b, f) for b in got for f in (x, y))
    np.testing.assert_array_equal(got, ob.boxes_elsewhere(x, [x, y], 40, 20, rng()))
    # between the two boxes only: left edge from 11 (x ends at 10.4) to 20 (y starts at 30)
    assert ((got[:, 0] >= 11) & (got[:, 0] <= 20)).all() and len(set(got[:, 0])) > 1
    one = ob.boxes_elsewhere(x, [x, y], 21, 20, rng())  # only (11, 0) fits
    assert one.shape == (10, 4) and (one == [11, 0, 10, 20]).all()
    assert ob.boxes_elsewhere(x, [[0, 0, 40, 20]], 40, 20, rng()).tolist() == [[0, 0, 10, 20]]
    assert ob.boxes_elsewhere([0, 0, 50, 5], [x], 40, 20, rng()).shape == (0, 4)


def test_the_wording_and_answer_ids_are_theirs():
    """Their question per stored row (text "Answer Left or Right." / "Above or
    Below."), and their answer ids: the first token of the bare word, no special tokens
    ("▁Left" in LLaVA's Llama-like pieces)."""
    from jaxmech.data.inputs.prompts import read_tokenizer
    from jaxmech.families.llava.processor import load_tokenizer
    from jaxmech.reports import occlusion as oc

    rows = their_rows()
    for family in FOLDERS:
        ref, folder = reference(family), os.path.join(AUTHORS, FOLDERS[family])
        tok = load_tokenizer(folder) if family == "llava" else read_tokenizer(folder)[0]
        for image_id, question, ids in zip(ref["image_id"], ref["question"],
                                           ref["answer_ids_Qx2"]):  # fmt: skip
            x, y, rel = rows[int(image_id)]
            assert oc.authors_question(x, y, rel) == str(question)
            assert oc.answer_ids(tok, rel) == tuple(ids)
    tok = load_tokenizer(os.path.join(AUTHORS, "llava_336"))
    assert [tok.id_to_token(i) for i in oc.answer_ids(tok, "below")] == ["▁Below", "▁Above"]


def sample_questions():
    """The sample's COCO-Spatial questions of both relations (`coco_spatial_all`)."""
    from jaxmech.data.datasets.questions import load_questions

    return load_questions("coco_spatial_all", SAMPLE).questions


def assert_logp_equal_theirs(family: str) -> None:
    """The report's `compute` on the sample, their boxes elsewhere injected, boxes its
    questions as theirs (X, Y; the two without an exact category left out) and gives
    their correct / wrong log p for the 12 images of each."""
    import jax.numpy as jnp

    import jaxmech
    from jaxmech.reports import occlusion as oc

    ref = reference(family)
    model = jaxmech.load(os.path.join(AUTHORS, FOLDERS[family]), dtype=jnp.float32)
    given = dict(zip(ref["image_id"].tolist(), ref["elsewhere_Qx10x4"]))
    res = oc.compute(model, sample_questions(), coco(), elsewhere=given, log=lambda _: None)
    assert res["image_id"].tolist() == ref["image_id"].tolist() and res["skipped"] == 2
    np.testing.assert_array_equal(res["boxes_Qx2x4"], ref["boxes_Qx2x4"])
    for q, image_id in enumerate(ref["image_id"]):
        lp = res["logp_Qx12x2"][q]
        np.testing.assert_allclose(lp[:, 0], ref["corr_Qx12"][q], atol=1e-4, err_msg=str(image_id))
        np.testing.assert_allclose(lp[:, 1], ref["wrong_Qx12"][q], atol=1e-4, err_msg=str(image_id))


def test_qwen2_vl_logp_equal_theirs_per_question():
    """Qwen2-VL (`qwen2vl_28`): `assert_logp_equal_theirs`; the
    prompt has the question before the image (their message's order, which Qwen's
    template keeps) and the photographs are resized by torchvision (their
    `use_fast=True`). All three photographs resize to one 56 px grid: one compile."""
    assert_logp_equal_theirs("qwen2")


@pytest.mark.slow
def test_llava_logp_equal_theirs_per_question():
    """LLaVA (`llava_336`): the same (its template renders the image first whatever the
    message's order). Slow: 33 forwards of 606 tokens through 32 blocks (~25 s)."""
    assert_logp_equal_theirs("llava")


def test_qwen2_vl_text_first_prompt_moves_the_question_only():
    """`encode(text_first=True)`: the question before the vision block, the same
    tokens otherwise; the question's character range still points at it. The image-first
    prompt (jaxmech's default, the old encoding of this question) gives their log p
    only 1e-4 apart or more: the order is read."""
    import jax.numpy as jnp

    import jaxmech
    from jaxmech.families.qwen2_vl import processor as P

    model = jaxmech.load(os.path.join(AUTHORS, "qwen2vl_28"), dtype=jnp.float32)
    photo = os.path.join(SAMPLE, "val2017", "000000000139.jpg")
    q = "Is the dog to the left or right of the person? Answer Left or Right."
    first = P.encode(model.processor, [photo], [q], text_first=True)
    last = P.encode(model.processor, [photo], [q])
    a, b = first.question_Bx2[0]
    assert first.prompts[0][a:b] == q and "<|vision_start|>" in first.prompts[0][b:]
    assert sorted(np.asarray(first.inputs.tokens_BxS[0]).tolist()) == sorted(
        np.asarray(last.inputs.tokens_BxS[0]).tolist()
    )
    ref = reference("qwen2")
    theirs = ref["corr_Qx12"][0, 0]
    word = int(ref["answer_ids_Qx2"][0, 0])
    got = [float(np.asarray(model.next_token_logprobs(e))[0, word]) for e in (first, last)]
    assert abs(got[0] - theirs) < 1e-4 and abs(got[1] - theirs) > 1e-4, got


@pytest.mark.parametrize("family", ["llava", "qwen2"])
def test_figure_8b_arithmetic_equals_theirs(family):
    """`figure_8b` on their stored log p and Fig. 8A verdicts gives their `keep_changes`
    groups (min(cc[3:7]) - cc[1], True / False verdicts, None left out), for the
    correct and the wrong word's log p; a question with no cc[3] is left out."""
    from jaxmech.reports import occlusion as oc

    ref = reference(family)
    verdict = [{1: True, 0: False}.get(int(v)) for v in ref["verdict"]]
    for which in ("corr", "wrong"):
        fig = oc.figure_8b(ref[f"{which}_Qx12"], verdict)
        for name, group in (("positive", "true"), ("negative", "false")):
            theirs = ref[f"group_{which}_{group}"]
            np.testing.assert_allclose(fig[name]["values"], theirs, atol=1e-6)
            assert fig[name]["n"] == len(theirs)
    short = np.array([[0.0, -1.0, -2.0], [0.0, -1.0, -2.0]])
    assert np.isnan(oc.sensitivity(short)).all()
    empty = oc.figure_8b(short, [True, False])
    assert empty["positive"]["n"] == 0 and empty["negative"]["values"] == []


@pytest.mark.slow
def test_fig_8a_verdicts_are_theirs():
    """`fig_8a_verdicts` (a greedy reply to `coco_deviation.py`'s question, judged as
    `fig_8a.ipynb`'s `verdict`) gives their stored verdicts on Qwen2-VL (their replies
    are 250 tokens of answer words; 4 tokens decide the same). Slow: a generation per
    question, each compiled (~1 min)."""
    import jax.numpy as jnp

    import jaxmech
    from jaxmech.reports import occlusion as oc

    ref = reference("qwen2")
    model = jaxmech.load(os.path.join(AUTHORS, "qwen2vl_28"), dtype=jnp.float32)
    keep = set(ref["image_id"].tolist())
    qs = [q for q in sample_questions() if int(os.path.basename(str(q.image))[:12]) in keep]
    got = oc.fig_8a_verdicts(model, qs, max_new_tokens=4)
    want = {
        int(i): {1: True, 0: False}.get(int(v)) for i, v in zip(ref["image_id"], ref["verdict"])
    }
    assert got == want


@pytest.mark.slow
def test_the_report_writes_its_table_and_summary(tmp_path):
    """`run` on Qwen2-VL and the sample (jaxmech's own boxes elsewhere, seed 42):
    questions.csv holds the 3 boxed questions, summary.json the figure of the csv's
    sensitivities split by its verdicts, strict JSON (n = 1 per group: no interval).
    Slow: the verdicts' generations (~1 min)."""
    import csv

    import jax.numpy as jnp

    import jaxmech
    from jaxmech.reports import occlusion as oc

    model = jaxmech.load(os.path.join(AUTHORS, "qwen2vl_28"), dtype=jnp.float32)
    oc.run(model, sample_questions(), coco(), str(tmp_path), max_new_tokens=4, log=lambda _: None)
    folder = tmp_path / "occlusion_authors"
    with open(folder / "questions.csv") as f:
        rows = list(csv.DictReader(f))
    with open(folder / "summary.json") as f:
        summary = json.loads(f.read(), parse_constant=lambda c: pytest.fail(c))
    assert [int(r["image_id"]) for r in rows] == [139, 285, 885]
    assert summary["n_questions"] == 3 and summary["skipped"] == 2
    for name, verdict in (("positive", "True"), ("negative", "False")):
        want = [float(r["sensitivity"]) for r in rows if r["verdict"] == verdict]
        np.testing.assert_allclose(summary[name]["values"], want)
        assert summary[name]["n"] == len(want) == 1 and summary[name]["ci"] == [None, None]


def test_a_family_whose_prompt_is_unchecked_is_refused_before_its_weights_load():
    from jaxmech.model import checkpoint_family
    from jaxmech.reports.occlusion import check_family

    folder = os.path.join(os.path.dirname(AUTHORS), "gemma3", "gemma3")
    with pytest.raises(ValueError, match="'gemma3'.*known for llava, qwen2_vl only"):
        check_family(checkpoint_family(folder))  # reads config.json only
    assert check_family(checkpoint_family(os.path.join(AUTHORS, FOLDERS["llava"]))) == "llava"
