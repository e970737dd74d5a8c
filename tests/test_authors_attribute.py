"""jaxmech against the authors' own `attribute_swapping.py` (paper 003, Fig. 4B), run
unmodified on the tiny LLaVA checkpoint `tests/fixtures/authors/llava_336` and the
COCO-Spatial sample by `tests/fixtures/authors/make_authors_attribute.py` (their numbers
in `attribute_swapping.npz`, per question, layer 1..31 and modality, with the commit,
the three rainbow draws their run took from NumPy's unseeded global state, the
pictures their processor was given, and their `fig4.ipynb` curves). LLaVA only: their
script hard-codes llava-1.5-7b-hf and its 576 image tokens.

Their quantity, per read word w in ("left", "right"): (log p_orig(w) - log p_patched(w))
/ (log p_orig(w) - log p_recoloured(w)), the twin `recolor_with_random_rainbow` of the
photograph (jaxmech: `image_twins.recolour_twin` with their draws given), the patch the
twin's output of LM block L (`layers[L]`: jaxmech's `lm/resid_post.L`, the report's
layer L + 1) at the modality's positions.

Tolerance: as `test_authors_patching.py`: eps = 2e-5 on each log-prob, so a ratio
r = a / d may differ by 2 eps (1 + |r|) / |d| + 1e-5, d jaxmech's own denominator (the
recoloured twin's gap is small: it moves little, so the ratio amplifies rounding).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_authors_patching import AUTHORS, LLAVA, SAMPLE, _their_inputs, patched_ratios

COMMIT = "1c034d6ecbe1494c450d412f52fdf98e4a4c51c2"
EPS = 2e-5
MODS = {"image": "image", "text": "text", "text_objwords": "objects"}  # theirs -> GROUPS


def reference() -> dict:
    ref = np.load(os.path.join(AUTHORS, "attribute_swapping.npz"))
    assert str(ref["commit"]) == COMMIT
    return {k: ref[k] for k in ref.files}


def photo(image_id) -> str:
    return os.path.join(SAMPLE, "val2017", f"{int(image_id):012d}.jpg")


def tolerance(theirs, d):
    """The bound on |ours - theirs| of a ratio over jaxmech's own denominator `d`."""
    return 2 * EPS * (1 + np.abs(theirs)) / np.abs(d) + 1e-5


def test_the_reference_records_the_commit_their_sample_and_their_draws():
    """The stored outputs name the commit and their sha256; their questions are the
    mirror reference's (the sample's left / right rows, their order); three draws per
    question in their ranges; the photograph their processor was given is the
    sample's as jaxmech opens it; their run's mirror equalled the stored one."""
    from jaxmech.data.inputs.image_twins import RAINBOW_RANGES, open_image

    with open(os.path.join(AUTHORS, "reference_attribute.json")) as f:
        record = json.load(f)
    assert record["commit"] == COMMIT and all(record["checks"].values())
    from test_authors_patching import reference as mirror

    ref, mir = reference(), mirror()
    for key in ("image_id", "relation", "query", "layers", "modalities"):
        np.testing.assert_array_equal(ref[key], mir[key])
    assert ref["ratio_QxYxMx2"].shape == mir["ratio_QxYxMx2"].shape
    assert ref["draws_Qx3"].shape == (len(ref["image_id"]), 3)
    lo, hi = np.array(RAINBOW_RANGES).T
    assert ((ref["draws_Qx3"] >= lo) & (ref["draws_Qx3"] <= hi)).all()
    for image_id in ref["image_id"]:
        np.testing.assert_array_equal(ref[f"photo_{image_id}"], open_image(photo(image_id)))


def test_the_recolour_with_their_draws_is_their_twin_pixel_for_pixel():
    """`recolour_twin` given their draws returns the very picture their
    `recolor_with_random_rainbow` gave their processor (uint8, every pixel); its own
    seeded draws give another; draws out of range are refused by name."""
    from jaxmech.data.inputs.image_twins import open_image, recolour_twin

    ref = reference()
    for image_id, draws in zip(ref["image_id"], ref["draws_Qx3"]):
        pixels = open_image(photo(image_id))
        ours, _ = recolour_twin(None, pixels, None, draws=draws)
        np.testing.assert_array_equal(ours, ref[f"recoloured_{image_id}"])
        seeded, _ = recolour_twin(None, pixels, np.random.default_rng(0))
        assert not np.array_equal(seeded, ours)
    with pytest.raises(ValueError, match="draws"):
        recolour_twin(None, pixels, None, draws=(0.0, 3.0, 0.5))


def injected(monkeypatch, ref) -> None:
    """`image_twins.recolour_twin` (as `reports.batches` calls it) given their draws for
    each question's photograph, by its image id."""
    from jaxmech.data.inputs import image_twins

    given = dict(zip(ref["image_id"].tolist(), ref["draws_Qx3"]))
    own = image_twins.recolour_twin

    def theirs(question, pixels, rng, **kw):
        image_id = int(os.path.basename(str(question.image)).split(".")[0])
        return own(question, pixels, rng, **kw, draws=given[image_id])

    monkeypatch.setattr(image_twins, "recolour_twin", theirs)


def test_the_authors_batches_recolour_twin_is_their_processors_input(monkeypatch):
    """Under the authors' wording, `photo_batches`' recolour twin (their draws
    injected) asks the question's own tokens and feeds the ViT the pixel codes of their
    recoloured picture through Pillow's resize: the twin their model saw. No weights
    are read (~2 s)."""
    from PIL import Image

    from jaxmech.data.datasets.questions import load_questions
    from jaxmech.data.spec import Grid
    from jaxmech.families.llava.processor import load_processor, patches
    from jaxmech.families.registry import read_checkpoint_config
    from jaxmech.reports.batches import photo_batches

    ref = reference()
    injected(monkeypatch, ref)
    family, config = read_checkpoint_config(LLAVA)
    view = family.view(
        LLAVA, config, Grid(4, 4), None, wording=dict(family.authors_wordings)["patching"]
    )
    proc = load_processor(LLAVA, config, resize="pil")
    qset = load_questions("coco_spatial", SAMPLE, seed=42)
    (batch,) = photo_batches(view, qset, (0,), ("recolour",), "authors", seed=42)
    ex, twin = batch.examples, batch.twins["recolour"]
    np.testing.assert_array_equal(
        np.asarray(twin.inputs.tokens_BxS), np.asarray(ex.inputs.tokens_BxS)
    )
    ids = [int(os.path.basename(str(qset.questions[i].image)).split(".")[0]) for i in batch.index]
    assert sorted(ids) == sorted(ref["image_id"].tolist())
    for b, image_id in enumerate(ids):
        picture = Image.fromarray(ref[f"recoloured_{image_id}"])
        codes = patches(picture, proc.images, config.patch_size, codes=True)
        np.testing.assert_array_equal(np.asarray(twin.inputs.pixels_BxPxF)[b], codes)


@pytest.mark.slow
def test_recolour_patching_equals_their_attribute_swapping_per_question():
    """jaxmech's forward on their prompt (`_their_inputs`), the twin their recoloured
    picture (`recolour_twin` with their draws), the twin's `lm/resid_post.L` patched into
    the original at their positions: their ratio for both read words at every layer
    1..31 and modality, every question. Slow: 95 forwards of the 32-block model per
    question (~50 s on 2 busy cores)."""
    import jax.numpy as jnp
    from PIL import Image

    import jaxmech
    from jaxmech.data.inputs.image_twins import open_image, recolour_twin
    from jaxmech.families.llava.processor import load_processor

    ref = reference()
    model = jaxmech.load(LLAVA, dtype=jnp.float32)
    proc = load_processor(LLAVA, model.config, resize="pil")
    read = [proc.tokenizer.token_to_id(w) for w in ("left", "right")]
    ratios = patched_ratios(model, read, [f"lm/resid_post.{int(y)}" for y in ref["layers"]])
    mods = [str(m) for m in ref["modalities"]]
    for q, (image_id, query) in enumerate(zip(ref["image_id"], ref["query"])):
        pixels = open_image(photo(image_id))
        twin_px, _ = recolour_twin(None, pixels, None, draws=ref["draws_Qx3"][q])
        inputs, groups = _their_inputs(model, proc, Image.fromarray(pixels), str(query))
        twin, _ = _their_inputs(model, proc, Image.fromarray(twin_px), str(query))
        ratio, d = ratios(inputs, twin, {m: groups[m] for m in mods})
        theirs = ref["ratio_QxYxMx2"][q]
        tol = tolerance(theirs, d)
        print(
            f"{int(image_id)}: worst |ours - theirs| / tolerance {(np.abs(ratio - theirs) / tol).max():.3g}"
        )
        assert (np.abs(ratio - theirs) <= tol).all(), (int(image_id), ratio, theirs, tol)


@pytest.mark.slow
def test_the_attribute_report_under_the_authors_protocol_equals_theirs(tmp_path, monkeypatch):
    """The report itself (`--protocol=authors --questions_from=coco_spatial`, their
    draws injected) on their checkpoint and sample: its per-question authors' shift of
    "left" / "right" at report layers 2, 16 and 31 (their `layers[1]`, `[15]`, `[30]`
    outputs) equals their ratio for the groups both have, over the report's own
    denominators; its summary's means equal their `fig4.ipynb` curve (NaN / inf read
    as 0, every question). Slow: the report on the 32-block model (~30 s)."""
    from jaxmech.analysis.patching import GROUPS
    from jaxmech.reports import attribute_swapping as report
    from jaxmech.reports.checkpoints import open_checkpoint
    from jaxmech.reports.driver import analyse_subject

    ref = reference()
    injected(monkeypatch, ref)
    layers = (2, 16, 31)
    run = open_checkpoint(LLAVA, questions=3, batch=4, layers=layers, protocol="authors",
                          questions_from="coco_spatial", data=SAMPLE, log=lambda *_: None)  # fmt: skip
    out = analyse_subject(report.REPORT, run, str(tmp_path), log=lambda *_: None)
    res, folder = out["res"], tmp_path / "attribute_swapping"
    summary = json.loads((folder / "summary.json").read_text())
    ids = [int(os.path.basename(str(q.image)).split(".")[0]) for q in run.subject.photos.questions]
    assert sorted(ids) == sorted(ref["image_id"].tolist())
    rows = [ref["image_id"].tolist().index(i) for i in ids]
    lp = res["logp"]
    first = np.asarray(res["answer"]) == res["words"]["left"]
    for w, word in enumerate(("left", "right")):
        pick = lambda own, oth: np.where(first == (w == 0), own, oth)  # noqa: E731
        d = pick(lp["orig"], lp["orig_other"]) - pick(lp["twin"], lp["twin_other"])
        for mod, group in MODS.items():
            m, g = ref["modalities"].tolist().index(mod), GROUPS.index(group)
            for y, layer in enumerate(layers):
                theirs = ref["ratio_QxYxMx2"][rows, layer - 2, m, w]
                got = res["read"]["authors"][word][0, y, g]
                assert (np.abs(got - theirs) <= tolerance(theirs, d[0])).all(), (layer, mod, word)
                mean = summary["patches"][f"{layer}/{group}"][f"authors_{word}"][0]
                curve = ref[f"fig4_attribute_mean_{word}_MxY"][m, layer - 2]
                assert abs(mean - curve) <= tolerance(theirs, d[0]).mean(), (layer, mod, word)


@pytest.mark.slow
def test_the_patching_reports_recolour_column_equals_theirs(tmp_path, monkeypatch):
    """The patching report (`--protocol=authors`, their draws injected): its recolour
    twin's shift of "left" / "right" at layer 2 (their `layers[1]` output) equals their
    attribute-swapping ratio per question for image / text / objects, over that
    twin's own denominators. Slow: both twins on the 32-block model (~20-35 s)."""
    from jaxmech.reports import patching
    from jaxmech.reports.checkpoints import open_checkpoint
    from jaxmech.reports.driver import analyse_subject

    ref = reference()
    injected(monkeypatch, ref)
    run = open_checkpoint(LLAVA, questions=3, batch=4, layers=(2,), protocol="authors",
                          questions_from="coco_spatial", data=SAMPLE, log=lambda *_: None)  # fmt: skip
    res = analyse_subject(patching.REPORT, run, str(tmp_path), log=lambda *_: None)["res"]
    lp = patching._word_logps(res)
    ids = [int(os.path.basename(str(q.image)).split(".")[0]) for q in run.subject.photos.questions]
    rows = [ref["image_id"].tolist().index(i) for i in ids]
    for mod, group in MODS.items():
        m, g = ref["modalities"].tolist().index(mod), patching.GROUPS.index(group)
        for w, word in enumerate(("left", "right")):
            got = res["shifts"][("recolour", word, "logp")][0, 0, g]
            d = lp[("recolour", "orig")][w][0] - lp[("recolour", "twin")][w][0]
            theirs = ref["ratio_QxYxMx2"][rows, 0, m, w]
            assert (np.abs(got - theirs) <= tolerance(theirs, d)).all(), (mod, word, got, theirs)
