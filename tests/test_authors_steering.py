"""jaxmech against the authors' own steering (paper 003, Fig. 2): `adversarial_steering.py`
(the control run, then the steered runs at layers 8 and 14 of their llava-7b window, factor
5, their universal IDs) and `compute_coco_stats.py`, run unmodified on `llava_336` and the
COCO-Spatial sample by `tests/fixtures/authors/make_authors_reference.py`; their outputs
in `steering.npz` (per question and run: the generated reply, their verdict, the log p of
the answer and the other word's "▁Left" / "▁Right" piece at the first generated token,
their control states' norms), the universal IDs in `spatial_ids.npz`. The same on
Qwen2-VL (`qwen2vl_28`, their `qwen2-2b`, layers 8 and 14 of their window 6:16, the bare
"left" / "right" pieces their stats read for it): `steering_qwen2.npz` and
`spatial_ids_qwen2.npz`, by `make_authors_qwen2_vl.py`.

Their steering: the direction from the control reply (lower-cased text: "right" and not
"left" -> X from cell (3, 0) to (0, 0); "left" and not "right" -> (0, 0) to (3, 0);
"above" / "below" along (0, 0) - (0, 3); else not steered), X's word moved by 5 x the
norm of its control states at layer L (every occurrence in prompt and reply, here the
prompt's one), Y's the other way, both at their first occurrence in the prompt, added
to the output of block L - 1 (jaxmech's `lm/resid_pre.L`) in the prompt's pass.

Tolerance: the log-probs are float32 forwards of both codes: 1e-4 absolute.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
AUTHORS = os.path.join(HERE, "fixtures", "authors")
LLAVA = os.path.join(AUTHORS, "llava_336")
QWEN2 = os.path.join(AUTHORS, "qwen2vl_28")  # their `qwen2-2b` (make_authors_qwen2_vl.py)
SAMPLE = os.path.join(HERE, "fixtures", "datasets", "whatsup")
COMMIT = "1c034d6ecbe1494c450d412f52fdf98e4a4c51c2"
# their corner IDs as jaxmech's row-major cells of the 4 x 4 grid: (x, y) -> 4 y + x
CORNER = {"left": (0, 3), "right": (3, 0), "above": (0, 12), "below": (12, 0)}


def reference(suffix: str = "") -> tuple[dict, dict]:
    """(their steering outputs, their spatial IDs): LLaVA's, or with `suffix` "_qwen2"
    Qwen2-VL's (`make_authors_qwen2_vl.py`)."""
    out = []
    for name in (f"steering{suffix}.npz", f"spatial_ids{suffix}.npz"):
        ref = np.load(os.path.join(AUTHORS, name))
        assert str(ref["commit"]) == COMMIT
        out.append({k: ref[k] for k in ref.files})
    return out[0], out[1]


def their_question(case) -> tuple[str, str, str, str, str, str]:
    """(the photograph's path, their question, X, Y, the correct word, the wrong word) of
    a stored case "X_Y_POS_NEG_IMAGEID" (their `utils/coco.py` wording)."""
    x, y, pos, neg, image_id = str(case).split("_")
    wording = ("to the left or right of", "left", "right") if pos in ("left", "right") else (
        "above or below", "above", "below")  # fmt: skip
    q = f'Is the {x} {wording[0]} the {y}? Answer "{wording[1]}" or "{wording[2]}" only.'
    return os.path.join(SAMPLE, "val2017", f"{int(image_id):012d}.jpg"), q, x, y, pos, neg


def their_direction(reply: str):
    """Their response test (`adversarial_steering.py` 86-124), or None: not steered."""
    r = reply.lower()
    for a, b in (("right", "left"), ("left", "right"), ("above", "below"), ("below", "above")):
        if a in r and b not in r:
            return a
    return None


@pytest.mark.parametrize("suffix", ["", "_qwen2"])
def test_their_steering_ran_on_every_worded_question(suffix):
    """Every sample row their `utils/coco.py` can word (left / right, above / below; not
    "a dog and a cat") has a control and a steered run at each layer, with a verdict and
    finite log-probs; their verdicts follow their rule on their replies."""
    ref, _ = reference(suffix)
    assert len(ref["case"]) == 5
    assert np.isfinite(ref["logp_CxRx2"]).all()
    for case, replies, verdicts in zip(ref["case"], ref["reply"], ref["verdict"]):
        pos, neg = str(case).split("_")[2:4]
        for reply, verdict in zip(replies, verdicts):
            r = str(reply).lower()
            want = "correct" if pos in r and neg not in r else "wrong" if neg in r and pos not in r else "nonsense"  # fmt: skip
            assert verdict == want


def test_reply_direction_is_their_response_test():
    """`analysis.steering.reply_direction` steers what their response test steers: on
    their stored replies and on replies naming both words, one word, words inside
    others, or none; `reply_corners` moves X between the corners they use per word
    (`CORNER`), whatever the question's relation."""
    import jax.numpy as jnp

    from jaxmech.analysis.steering import (
        REPLY_WORDS,
        reply_corners,
        reply_direction,
        token_directions,
    )

    ref, _ = reference()
    replies = [str(r) for r in np.ravel(ref["reply"])] + [
        "Left.", "RIGHT", "left or right", "leftmost", "Above, not below", "below",
        "the cat is above the dog and to the left", "no idea", "",
    ]  # fmt: skip
    for reply in replies:
        assert reply_direction(reply) == their_direction(reply), reply
    table = token_directions(REPLY_WORDS + ("left right", "cat"))
    np.testing.assert_array_equal(table, [0, 1, 2, 3, -1, -1])
    logits = jnp.eye(len(table))  # example b's top token is entry b
    src, dst, counted = reply_corners(logits, table, 4, 4)
    for b, word in enumerate(REPLY_WORDS):
        assert (int(src[b]), int(dst[b])) == CORNER[word], word
    assert np.asarray(counted).tolist() == [True] * 4 + [False, False]


def assert_first_token_logp(folder, P, ref, ids, piece, read, **load) -> None:
    """jaxmech's forward with `Edits.add` at `lm/resid_pre.L` and jaxmech's
    `analysis.steering.authors_vectors` over their universal IDs `ids` and their norms
    gives their log p of the answer and the other word (`read(word)`: the piece their
    `compute_coco_stats.py` reads) at the first generated token, per question of `ref`,
    unsteered and steered at both layers (their direction from their reply). `P`: the
    family's processor module (`load`: `load_processor`'s options); `piece(word)`: the
    object word's piece in the prompt."""
    import jax
    import jax.numpy as jnp

    import jaxmech
    from jaxmech.analysis.steering import authors_vectors
    from jaxmech.models.edits import Edits

    model = jaxmech.load(folder, dtype=jnp.float32)
    proc = P.load_processor(folder, model.config, **load)
    tok = proc.tokenizer
    layers = [int(y) for y in ref["steer_layers"]]
    sites = [f"lm/resid_pre.{y}" for y in layers]

    @jax.jit
    def logp(inputs, add_YxSxD):
        edits = Edits(add={s: a[None] for s, a in zip(sites, add_YxSxD)})
        logits, _ = model.forward(inputs, edits=edits)
        return jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))

    for c, case in enumerate(ref["case"]):
        photo, q, x, y, pos, neg = their_question(case)
        enc = P.encode(proc, [photo], [q])
        tokens = np.asarray(enc.inputs.tokens_BxS[0])
        rows = [int(np.flatnonzero(tokens == tok.token_to_id(piece(w)))[0]) for w in (x, y)]
        words = [tok.token_to_id(read(w)) for w in (pos, neg)]
        S, D = tokens.shape[0], model.config.lm_width
        zero = np.zeros((len(layers), S, D), np.float32)
        np.testing.assert_allclose(np.asarray(logp(enc.inputs, zero))[words], ref["logp_CxRx2"][c, 0], atol=1e-4)  # fmt: skip
        direction = their_direction(str(ref["reply"][c, 0]))
        assert direction is not None  # the fixture's control replies are decisive
        src, dst = CORNER[direction]
        for r, layer in enumerate(layers):
            delta = jnp.asarray(ids["universal_LxCxD"][list(ids["layers"]).index(layer)])
            add = zero.copy()
            for sign, row, norm in zip((1.0, -1.0), rows, ref["word_norm_CxYx2"][c, r]):
                v = authors_vectors(delta, np.array([src]), np.array([dst]), np.array([norm]), 5.0)
                add[r, row] += sign * np.asarray(v[0])
            got = np.asarray(logp(enc.inputs, add))[words]
            np.testing.assert_allclose(got, ref["logp_CxRx2"][c, 1 + r], atol=1e-4)


def test_steered_first_token_equals_theirs_per_question():
    """LLaVA (`llava_336`, their `llava-7b`): `assert_first_token_logp` with their
    "▁Left" / "▁Right" pieces (`tokenize(": " + word.capitalize())[-1]`), photographs
    resized by Pillow as their 4.53's slow processor (judging a reply is theirs;
    jaxmech's report reads the top token, below)."""
    from jaxmech.families.llava import processor as P

    ref, ids = reference()
    assert_first_token_logp(LLAVA, P, ref, ids, lambda w: "▁" + w,
                            lambda w: "▁" + w.capitalize(), resize="pil")  # fmt: skip


def test_qwen2_vl_steered_first_token_equals_theirs():
    """Qwen2-VL (`qwen2vl_28`, their `qwen2-2b`, 28 LM blocks; their window 6:16, layers
    8 and 14): `assert_first_token_logp` with the object words' "Ġ" pieces and the bare
    answer pieces their `compute_coco_stats.py` reads for it (`tokenize(word)[-1]`:
    "left", the reply's first token follows "assistant\\n"), their photographs resized
    by Pillow (their 4.53's slow `Qwen2VLImageProcessor`) to multiples of 28; their
    prompt the processor's chat template, jaxmech's `chat_prompt`. In the suite (~9 s
    alone, as LLaVA's above): the one fast check of a second family against their code."""
    from jaxmech.families.qwen2_vl import processor as P

    ref, ids = reference("_qwen2")
    assert int(ids["layers"][-1]) == 28 and len(ref["case"]) == 5
    assert_first_token_logp(QWEN2, P, ref, ids, lambda w: "Ġ" + w, lambda w: w, resize="pil")


# their replies are 250 tokens; the fixture's are ": left left ...", so the first
# N_NEW tokens' text is compared as a prefix of theirs, and their verdict, which no
# longer reply of "left"s can change, on it
N_NEW = 4


def their_batch(family: str = "llava"):
    """(reference, the model, its authors' view, (inputs, spans) of the 5 stored cases
    rendered by the view, [(correct, wrong)] words); `family` "qwen2_vl": Qwen2-VL's,
    each case its own batch of one (the photographs resize to different patch grids):
    (inputs, spans) a list of them."""
    import importlib

    import jax.numpy as jnp
    from PIL import Image

    import jaxmech

    checkpoint_view = importlib.import_module(f"jaxmech.families.{family}.view").checkpoint_view
    folder, suffix = (LLAVA, "") if family == "llava" else (QWEN2, "_qwen2")
    ref, ids = reference(suffix)
    model = jaxmech.load(folder, dtype=jnp.float32)
    view = checkpoint_view(folder, model.config, wording="authors")
    qs = [their_question(c) for c in ref["case"]]
    images = [np.asarray(Image.open(q[0]).convert("RGB")) for q in qs]
    if family == "llava":
        rendered = view.render_images(images, [q[1] for q in qs], [q[2:4] for q in qs])
    else:
        rendered = [view.render_images([im], [q[1]], [q[2:4]]) for im, q in zip(images, qs)]
    return ref, ids, model, view, rendered, [q[4:6] for q in qs]


def judged(model, inputs, generation, words):
    """(each row's reply text, their verdict on it)."""
    import types

    from jaxmech.models.generate import reply_text, sequences, text_verdict

    seqs = sequences(types.SimpleNamespace(inputs=inputs), generation)
    texts = [reply_text(model.tokenizer, q) for q in seqs]
    return texts, [text_verdict(t, *w) for t, w in zip(texts, words)]


def assert_their_replies(texts, verdicts, ref, run: int):
    for c, (text, verdict) in enumerate(zip(texts, verdicts)):
        theirs = str(ref["reply"][c, run])
        assert len(text) > len(": ") and theirs.startswith(text), (c, text, theirs[:40])
        assert verdict == ref["verdict"][c, run], c


def test_the_views_control_replies_are_theirs():
    """LLaVA's view-level `generate` (its uint8 pixel codes decoded as its forward,
    then `models.generate`) on the five cases rendered by the authors' view: each
    greedy reply of N_NEW tokens, read as their `compute_coco_stats.py` reads it, is the
    start of their stored 250-token control reply, with their verdict (~8 s: the
    32-block fixture's prefill of 606 tokens and its compiled step)."""
    ref, _, model, view, (inputs, _), words = their_batch()
    g = view.generate(model.params, inputs, max_new_tokens=N_NEW)
    assert g.tokens_BxN.shape == (len(ref["case"]), N_NEW)
    assert_their_replies(*judged(model, inputs, g, words), ref, 0)


@pytest.mark.slow
def test_qwen2_vl_views_control_replies_are_theirs():
    """Qwen2-VL's view-level `generate` on the five cases rendered by its authors' view
    (one per batch): each greedy reply of N_NEW tokens, read as their
    `compute_coco_stats.py` reads it (the text after the last "assistant": "\\nleft..."),
    is the start of their stored control reply, with their verdict. Slow: five
    batches of one (different patch grids), each compiled (~2 min on 2 busy cores)."""
    ref, _, model, view, rendered, words = their_batch("qwen2_vl")
    for c, (inputs, _) in enumerate(rendered):
        g = view.generate(model.params, inputs, max_new_tokens=N_NEW)
        texts, verdicts = judged(model, inputs, g, words[c : c + 1])
        sub = {k: ref[k][c : c + 1] for k in ("reply", "verdict")}
        assert_their_replies(texts, verdicts, sub, 0)


def test_qwen2_vl_views_photographs_are_their_processors():
    """The pixel codes Qwen2-VL's authors' view renders each photograph to equal their
    processor's (Pillow's resize, as `processor.load_processor(resize="pil")`), as
    LLaVA's view does (`llava.view.AUTHORS_PROCESSOR`)."""
    from jaxmech.families.qwen2_vl import processor as P

    ref, _, model, _, rendered, _ = their_batch("qwen2_vl")
    proc = P.load_processor(QWEN2, model.config, resize="pil")
    for case, (inputs, _) in zip(ref["case"], rendered):
        photo, q = their_question(case)[:2]
        theirs = P.encode(proc, [photo], [q], codes=True).inputs.pixels_BxPxF
        np.testing.assert_array_equal(np.asarray(inputs.pixels_BxPxF), np.asarray(theirs))


@pytest.mark.slow
def test_steered_replies_are_theirs():
    """The report's steered replies (`analysis.steering.steered_replies`: their hooks'
    `Edits.add` on the prompt's forward, X's word 5 x its norm along their corner IDs
    and Y's the other way, at layers 8 and 14) over their universal IDs, the direction
    from the control reply as their response test reads it: the start of their stored
    steered replies, with their verdicts. Slow: three generations (~25 s)."""
    from jaxmech.analysis import steering as st

    ref, ids, model, view, (inputs, spans), words = their_batch()
    control = view.generate(model.params, inputs, max_new_tokens=N_NEW)
    texts, _ = judged(model, inputs, control, words)
    src, dst, counted = st.direction_corners(st.token_directions(texts), *view.grid)
    assert np.asarray(counted).all()  # every control reply decisive, as theirs
    want = [CORNER[their_direction(str(r))] for r in ref["reply"][:, 0]]
    assert list(zip(np.asarray(src).tolist(), np.asarray(dst).tolist())) == want
    from jaxmech.families.vlm_view import Examples

    no_words = np.zeros(len(texts), np.int32)  # the replies are judged, not a margin
    ex = Examples(None, inputs, spans, no_words, no_words)
    clean = st.unsteered(view, model.params, ex)
    for r, layer in enumerate(int(y) for y in ref["steer_layers"]):
        delta = ids["universal_LxCxD"][list(ids["layers"]).index(layer)]
        g = st.steered_replies(view, model.params, ex, layer, delta, src, dst, N_NEW, clean)
        assert_their_replies(*judged(model, inputs, g, words), ref, 1 + r)


def test_max_new_tokens_is_checked_before_compute():
    """`reports.steering.report(max_new_tokens)` refuses a count that is not an int >=
    1, naming the flag, and otherwise passes it to the report's compute."""
    from jaxmech.reports import steering

    for bad in (0, -3, 2.5, True, "250"):
        with pytest.raises(ValueError, match="--max_new_tokens"):
            steering.report(bad)
    assert steering.report(7).compute.keywords == {"max_new_tokens": 7}
    assert steering.MAX_NEW_TOKENS == 250  # their num_generate


@pytest.mark.slow
def test_the_steering_report_under_the_authors_protocol_equals_theirs(tmp_path):
    """The report itself (`--protocol=authors --questions_from=coco_spatial_all`, layers
    8 and 14) on their checkpoint and sample: it steers the questions they steer (their
    reply decisive by their rule), and per question and layer the answer changes where
    theirs does (the steered reply's verdict differs from the control's). It needs
    their reply test on the model's answer (`analysis.steering.reply_corners`: "left"
    to an above / below question steers along x; jaxmech's `answer_corners` read the
    question's own relation's words and left 632, 885 out). Its replies are generated
    (`report(max_new_tokens=N_NEW)`, the view's `generate`, N_NEW of their 250 tokens)
    and judged as theirs: each question's control and steered verdicts equal theirs.
    What it cannot tell apart: their norm over every occurrence in prompt and reply
    (`reports.steering.reply_norms`, computed, but no object word occurs in these
    replies) and their IDs their canvases' (no verdict changes here). Slow: the report's
    ID probes and factorial steering on the 32-block model (~9 min on 2 busy cores)."""
    from jaxmech.reports import steering
    from jaxmech.reports.checkpoints import open_checkpoint
    from jaxmech.reports.driver import analyse_subject

    ref, _ = reference()
    run = open_checkpoint(LLAVA, grid=(4, 4), layers=(8, 14), protocol="authors", batch=8,
                          questions_from="coco_spatial_all", data=SAMPLE, log=lambda *_: None)  # fmt: skip
    report = steering.report(max_new_tokens=N_NEW)
    res = analyse_subject(report, run, str(tmp_path), log=lambda *_: None)["res"]
    assert res["answer_read"].startswith(f"a greedy reply of {N_NEW} tokens")
    authors = res["authors"]
    ids = [int(os.path.basename(str(q.image)).split(".")[0]) for q in run.subject.photos.questions]
    theirs = {int(str(c).split("_")[-1]): k for k, c in enumerate(ref["case"])}
    assert sorted(ids) == sorted(theirs)  # the same 5 questions
    steered = [their_direction(str(ref["reply"][theirs[i], 0])) is not None for i in ids]
    counted = np.asarray(authors["counted"])[0, 0].tolist()
    assert counted == steered, (ids, counted, steered)
    verdicts = np.asarray(authors["verdict"])[0]  # [1 + sites, B]: control, then steered
    for b, image_id in enumerate(ids):
        np.testing.assert_array_equal(verdicts[:, b], ref["verdict"][theirs[image_id]])
    for r in range(2):
        flipped = np.asarray(authors["reply_flip"])[0, r]
        for b, image_id in enumerate(ids):
            v = ref["verdict"][theirs[image_id]]
            assert bool(flipped[b]) == (v[0] != v[1 + r]), image_id
