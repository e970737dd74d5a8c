"""jaxmech against the authors' own `mirror_swapping.py` (paper 003, Fig. 4), run
unmodified on the tiny LLaVA checkpoint `tests/fixtures/authors/llava_336` and the
COCO-Spatial sample by `tests/fixtures/authors/make_authors_reference.py` (their numbers
in `mirror_swapping.npz`, per question, layer 1..31 and modality, with the commit).

Their quantity, per read word w in ("left", "right") (the bare pieces, not the prompt's
"▁left"): (log p_orig(w) - log p_patched(w)) / (log p_orig(w) - log p_mirror(w)), the
mirror the photograph flipped left / right, the patch the mirror's output of LM block
L (`layers[L]`: jaxmech's `lm/resid_post.L`) at the modality's positions.

Tolerance: both codes' log-probs agree to float32 rounding (the family fixtures bound
1e-4; observed ~1e-6 here), so with eps = 2e-5 on each log-prob a ratio r = a / d may
differ by 2 eps (1 + |r|) / |d| + 1e-5, d jaxmech's own denominator (their script
keeps only the ratio; a small d, e.g. 0.01 at question 285's "right", amplifies
rounding).

Cost: one compile of the 32-block forward and 8 calls per question (~5 s alone, ~12 s
on 2 busy cores); the report's own run is `slow`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
AUTHORS = os.path.join(HERE, "fixtures", "authors")
LLAVA = os.path.join(AUTHORS, "llava_336")
SAMPLE = os.path.join(HERE, "fixtures", "datasets", "whatsup")
COMMIT = "1c034d6ecbe1494c450d412f52fdf98e4a4c51c2"
EPS = 2e-5
LAYERS = (1, 31)  # their first patched layer and their last (the last block's output)


def reference() -> dict:
    ref = np.load(os.path.join(AUTHORS, "mirror_swapping.npz"))
    assert str(ref["commit"]) == COMMIT
    return {k: ref[k] for k in ref.files}


def test_the_reference_records_the_commit_and_their_sample():
    """The stored outputs name the commit, and their questions are the sample's left /
    right rows (their filter: "to the left of " / "to the right of " in the caption)."""
    with open(os.path.join(AUTHORS, "reference.json")) as f:
        record = json.load(f)
    assert record["commit"] == COMMIT
    ref = reference()
    with open(os.path.join(SAMPLE, "coco_qa_two_obj.json")) as f:
        rows = json.load(f)
    lr = [(r[0], "left" if "to the left of " in r[1] else "right") for r in rows
          if "to the left of " in r[1] or "to the right of " in r[1]]  # fmt: skip
    assert sorted(zip(ref["image_id"].tolist(), ref["relation"].tolist())) == sorted(lr)
    assert ref["ratio_QxYxMx2"].shape == (len(lr), 31, 3, 2)
    assert np.isfinite(ref["ratio_QxYxMx2"]).all()


def _their_inputs(model, proc, image, query):
    """jaxmech's encoding of their LLaVA prompt (no chat template) and `image`, with
    their three position sets (`mirror_swapping.py` 218-271, computed from jaxmech's
    tokens): "image" the 576 image tokens, "text" from position 575 to the end
    (their `range(575, len(tokens) + 575)`: with the image at 1..576 it also holds the last
    two image tokens), "text_objwords" the first occurrence after
    the image of each object word's last piece (`tokenize(" " + word)[-1]`)."""
    from jaxmech.families.llava.model import Inputs
    from jaxmech.families.llava.processor import patches
    from jaxmech.models.positions import text_ids

    c = model.config
    prompt = "<image>\nQUESTION: " + query + "Answer left or right. ANSWER: "
    tok = proc.tokenizer
    ids = np.asarray(tok.encode(prompt.replace("<image>", "<image>" * c.n_patches)).ids)
    S = len(ids)
    image_pos = np.flatnonzero(ids == c.image_token_id)
    assert image_pos.tolist() == list(range(1, 577))  # their `1 + u` and `+ 575`
    subj, obj = query[len("Is the ") : -1].split(" to the left or right of the ")
    words = [tok.encode(" " + w, add_special_tokens=False).ids[-1] for w in (subj, obj)]
    after = image_pos[-1] + 1
    obj_pos = [after + int(np.flatnonzero(ids[after:] == w)[0]) for w in words]
    # their "text" starts at position 575: the last two image tokens, then the text
    groups = {"image": image_pos, "text": np.arange(575, S), "text_objwords": obj_pos}
    pixels = patches(image, proc.images, c.patch_size)[None]
    valid = np.ones((1, S), bool)
    inputs = Inputs(ids[None].astype(np.int32), pixels, image_pos[None].astype(np.int32),
                    text_ids(valid), valid)  # fmt: skip
    return inputs, groups


def patched_ratios(model, read, sites):
    """A function (inputs, twin, groups) -> ([Y, M, 2] the ratio per site in `sites`,
    modality in `groups`' order and read word (token ids `read`), [2] the denominator
    log p_orig - log p_twin): the twin's `sites` patched into `inputs` one site and
    modality at a time, as `mirror_swapping.py` / `attribute_swapping.py` do. One
    compile serves every run (all-False masks: the plain forward)."""
    import jax
    import jax.numpy as jnp

    from jaxmech.models.edits import Edits

    @jax.jit
    def run(inputs, where_YxS, values):
        """(log p of the read words at the last row, the `sites` captured) of `inputs`
        with `sites` replaced by `values` where `where_YxS`."""
        edits = Edits(
            replace={s: (w[None, :, None], v) for s, w, v in zip(sites, where_YxS, values)}
        )
        logits, aux = model.forward(inputs, edits=edits, capture=sites)
        logp = jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))[np.asarray(read)]
        return logp, [aux[s] for s in sites]

    def ratios(inputs, twin, groups):
        none = np.zeros((len(sites), inputs.tokens_BxS.shape[1]), bool)
        zeros = [jnp.zeros((1, none.shape[1], model.config.lm_width))] * len(sites)
        twin_lp, values = run(twin, none, zeros)
        orig, _ = run(inputs, none, values)
        d = np.asarray(orig) - np.asarray(twin_lp)
        out = np.zeros((len(sites), len(groups), 2))
        for y in range(len(sites)):
            for m, where_S in enumerate(groups.values()):
                where = none.copy()
                where[y, where_S] = True
                out[y, m] = (np.asarray(orig) - np.asarray(run(inputs, where, values)[0])) / d
        return out, d

    return ratios


def test_mirror_patching_equals_their_mirror_swapping_per_question():
    """jaxmech's forward, sites and edits reproduce their numbers per question: on their
    prompt, with the photograph resized as their transformers 4.53 does (the slow
    `CLIPImageProcessor`: Pillow's bicubic; `resize="pil"`), the mirror's
    `lm/resid_post.L` patched into the original at their positions gives their ratio for
    both read words, at layers 1 and 31, every modality, every question."""
    import jax.numpy as jnp
    from PIL import Image

    import jaxmech
    from jaxmech.families.llava.processor import load_processor

    ref = reference()
    model = jaxmech.load(LLAVA, dtype=jnp.float32)
    proc = load_processor(LLAVA, model.config, resize="pil")
    read = [proc.tokenizer.token_to_id(w) for w in ("left", "right")]
    assert None not in read and read != [proc.tokenizer.token_to_id(w) for w in ("▁left", "▁right")]
    ratios = patched_ratios(model, read, [f"lm/resid_post.{layer}" for layer in LAYERS])
    rows = [list(ref["layers"]).index(layer) for layer in LAYERS]
    mods = [str(m) for m in ref["modalities"]]
    for q, (image_id, query) in enumerate(zip(ref["image_id"], ref["query"])):
        photo = Image.open(os.path.join(SAMPLE, "val2017", f"{int(image_id):012d}.jpg"))
        inputs, groups = _their_inputs(model, proc, photo, str(query))
        twin, _ = _their_inputs(model, proc, photo.transpose(Image.FLIP_LEFT_RIGHT), str(query))
        ratio, d = ratios(inputs, twin, {m: groups[m] for m in mods})
        theirs = ref["ratio_QxYxMx2"][q, rows]
        tol = 2 * EPS * (1 + np.abs(theirs)) / np.abs(d) + 1e-5
        assert (np.abs(ratio - theirs) <= tol).all(), (int(image_id), ratio, theirs, tol)


def test_llavas_authors_patching_view_asks_their_prompt():
    """LLaVA's authors' patching wording (`FAMILY.authors_wordings`, the view the report
    renders with under `--protocol=authors`) asks each sample question as their script:
    the same tokens as `_their_inputs` (their prompt, no chat template), the photograph
    resized by Pillow (the same pixel levels as `resize="pil"`), their "text" group
    (`patching.authors_groups`) and object positions, and it reads their bare pieces
    "left" / "right". No weights are read (< 5 s)."""
    from types import SimpleNamespace

    from PIL import Image

    from jaxmech.analysis.patching import GROUPS, token_groups
    from jaxmech.data.datasets.questions import load_questions
    from jaxmech.data.spec import Grid
    from jaxmech.families.llava.processor import load_processor, patches
    from jaxmech.families.registry import read_checkpoint_config
    from jaxmech.reports.batches import photo_batches
    from jaxmech.reports.patching import authors_groups

    ref = reference()
    family, config = read_checkpoint_config(LLAVA)
    view = family.view(
        LLAVA, config, Grid(4, 4), None, wording=dict(family.authors_wordings)["patching"]
    )
    proc = load_processor(LLAVA, config, resize="pil")
    qset = load_questions("coco_spatial_all", SAMPLE)
    (batch,) = photo_batches(view, qset, (0,), (), "authors")
    ex = batch.examples
    bare = [proc.tokenizer.token_to_id(w) for w in ("left", "right")]
    assert np.asarray(view.answer_words)[0].tolist() == bare
    groups = authors_groups(token_groups(ex.spans), ex.spans)
    for b, i in enumerate(batch.index):
        image_id = int(os.path.basename(str(qset.questions[i].image)).split(".")[0])
        query = str(ref["query"][list(ref["image_id"]).index(image_id)])
        photo = Image.open(os.path.join(SAMPLE, "val2017", f"{image_id:012d}.jpg"))
        inputs, theirs = _their_inputs(SimpleNamespace(config=config), proc, photo, query)
        tokens, valid = (np.asarray(x)[b] for x in (ex.inputs.tokens_BxS, ex.inputs.valid_BxS))
        np.testing.assert_array_equal(tokens[valid], inputs.tokens_BxS[0])
        codes = patches(photo, proc.images, config.patch_size, codes=True)
        np.testing.assert_array_equal(np.asarray(ex.inputs.pixels_BxPxF)[b], codes)
        pad = int((~valid).sum())  # rows are left-padded: their positions shifted
        for group, mine in (("image", "image"), ("text", "text"), ("text_objwords", "objects")):
            got = np.flatnonzero(groups[GROUPS.index(mine), b]) - pad
            assert got.tolist() == sorted(np.asarray(theirs[group]).tolist()), (image_id, group)


@pytest.mark.slow
def test_the_patching_report_under_the_authors_protocol_equals_theirs(tmp_path):
    """The report itself (`--protocol=authors --questions_from=coco_spatial`) on their
    checkpoint and sample: its per-question change of "left" / "right" for the mirror
    patch at layer 2 (jaxmech's `resid_pre.2`, their `layers[1]` output) equals their
    layer-1 ratio, per question, for the groups both have (image, text, objects); the
    tolerance as above, over the report's own denominators. It needs the LLaVA
    family's authors' patching wording (`report_view`: their prompt without a chat
    template, the bare pieces "left" / "right", Pillow's resize) and their "text" group
    (`patching.authors_groups`); without any one of them it fails. Slow: the report on
    the 32-block model (~1 min on 2 busy cores)."""
    from jaxmech.reports import patching
    from jaxmech.reports.checkpoints import open_checkpoint
    from jaxmech.reports.driver import analyse_subject

    ref = reference()
    run = open_checkpoint(LLAVA, questions=3, batch=4, layers=(2,), protocol="authors",
                          questions_from="coco_spatial", data=SAMPLE, log=lambda *_: None)  # fmt: skip
    res = analyse_subject(patching.REPORT, run, str(tmp_path), log=lambda *_: None)["res"]
    lp = patching._word_logps(res)
    ids = [int(os.path.basename(str(q.image)).split(".")[0]) for q in run.subject.photos.questions]
    assert sorted(ids) == sorted(ref["image_id"].tolist())
    y = list(ref["layers"]).index(1)
    for mod, group in (("image", "image"), ("text", "text"), ("text_objwords", "objects")):
        m, g = list(ref["modalities"]).index(mod), patching.GROUPS.index(group)
        for w, word in enumerate(("left", "right")):
            got = res["shifts"][("mirror", word, "logp")][0, 0, g]
            d = lp[("mirror", "orig")][w][0] - lp[("mirror", "twin")][w][0]
            for b, image_id in enumerate(ids):
                theirs = ref["ratio_QxYxMx2"][list(ref["image_id"]).index(image_id), y, m, w]
                tol = 2 * EPS * (1 + abs(theirs)) / abs(d[b]) + 1e-5
                assert abs(got[b] - theirs) <= tol, (image_id, mod, word, got[b], theirs)
