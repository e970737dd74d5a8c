"""Greedy generation with a key / value cache (`models.generate`, `Model.generate`) against
the reference's `generate(do_sample=False)` on every checkpoint family's fixture
(`tests/fixtures/generate_reference.py` wrote the reference's tokens and per-step logits),
per-row stops at an end-of-sequence token, the cache against full re-forwards, one
compiled step for every step, the argument errors, and the authors' reply verdict.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.families import load_checkpoint
from jaxmech.families.internvl import encode as internvl_encode
from jaxmech.families.internvl import processor as internvl_processor
from jaxmech.families.llava import model as llava_model
from jaxmech.families.llava import processor as llava_processor
from jaxmech.families.qwen2_vl import model as qwen_model
from jaxmech.families.qwen2_vl import processor as qwen_processor
from jaxmech.model import Model
from jaxmech.models import generate as gen
from jaxmech.models.edits import Edits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TOL = 1e-4  # float32, the fixtures' bound
# (checkpoint, case) -> (family folder, 1: two rows with an image each, 0: text only)
CASES = {
    ("qwen2_vl", "padded"): ("qwen2_vl", 1),
    ("qwen2_5_vl", "padded"): ("qwen2_vl", 1),
    ("qwen3_vl", "padded"): ("qwen3_vl", 1),
    ("qwen3_vl", "text"): ("qwen3_vl", 0),
    ("llava", "batch"): ("llava", 1),
    ("internvl", "batch"): ("internvl", 1),
}
MAIN = {name: case for name, case in reversed(list(CASES))}  # each checkpoint's image case


def questions(name: str, prompts) -> list[str]:
    """The questions in the reference's chat prompts."""
    if name.startswith("qwen"):
        return [t.split("<|vision_end|>")[-1].split("<|im_end|>")[0].strip() for t in prompts]
    if name == "llava":
        return [t.split("USER: ")[1].replace("<image>\n", "").rsplit(" ASSISTANT:", 1)[0]
                for t in prompts]  # fmt: skip
    return [t.split("user\n")[1].replace("<IMG_CONTEXT>\n", "").split("<|im_end|>")[0]
            for t in prompts]  # fmt: skip


ENCODE = {"qwen": qwen_processor.encode, "llava": llava_processor.encode,
          "internvl": internvl_encode.encode}  # fmt: skip


def encode_images(name: str, case: str, proc, codes: bool = False):
    """The case's two images and the reference's questions encoded by `proc` (`codes`:
    the pixels as uint8 levels, as a view renders them)."""
    family_dir, _ = CASES[name, case]
    folder = os.path.join(FIXTURES, family_dir, name)
    images = [os.path.join(FIXTURES, family_dir, f"{case}{i}.png") for i in range(2)]
    prompts = np.load(os.path.join(folder, "reference.npz"))[f"{case}/prompt"]
    encode = ENCODE["qwen" if name.startswith("qwen") else name]
    return encode(proc, images, questions(name, prompts), codes=codes)


def fixture(name: str, case: str | None = None):
    """(the model handle, the case's encoding (default: the checkpoint's image case), the
    reference's generations)."""
    return _fixture(name, MAIN[name] if case is None else case)


@functools.lru_cache(maxsize=None)
def _fixture(name: str, case: str):
    family_dir, with_image = CASES[name, case]
    folder = os.path.join(FIXTURES, family_dir, name)
    family, config, params = load_checkpoint(folder)
    ref = np.load(os.path.join(folder, "reference.npz"))
    if name.startswith("qwen"):  # the Qwen fixtures were written by the PIL backend
        proc = qwen_processor.load_processor(folder, config, resize="pil")
    elif name == "llava":
        proc = llava_processor.load_processor(folder, config)
    else:
        proc = internvl_processor.load_processor(folder, config)
        proc = proc._replace(images=proc.images._replace(size=int(ref[f"{case}/tile"])))
    if with_image:
        enc = encode_images(name, case, proc)
    else:
        enc = qwen_processor.encode_text(proc, list(ref[f"{case}/questions"]))
    gref = np.load(os.path.join(folder, "generate_reference.npz"))
    gref = {k.split("/", 1)[1]: gref[k] for k in gref.files if k.startswith(f"{case}/")}
    np.testing.assert_array_equal(enc.inputs.tokens_BxS, gref["input_ids"])
    np.testing.assert_array_equal(enc.inputs.valid_BxS, gref["attention_mask"].astype(bool))
    return Model(family, config, params, folder, proc), enc, gref


def assert_tokens(got: np.ndarray, want: np.ndarray, pad: int) -> None:
    """The reference's tokens [B, n], then pad: it stops once every row has stopped."""
    n = want.shape[1]
    np.testing.assert_array_equal(got[:, :n], want)
    assert (got[:, n:] == pad).all()


@pytest.mark.parametrize("name, case", list(CASES), ids=[f"{n}-{c}" for n, c in CASES])
def test_generate_equals_reference(name, case):
    """Token for token and per step's logits (1e-4) as the reference's greedy
    `generate` on a left-padded batch of two with an image; then with a token that the rows
    reach at different steps as the end of sequence: each row stops there, pad after,
    as the reference's. Qwen3-VL also without an image (the authors' text-only
    baseline)."""
    m, enc, ref = fixture(name, case)
    pad = int(ref["pad"])
    programs = lambda: (gen._prefill._cache_size(), gen._step._cache_size())  # noqa: E731
    before = programs()
    out = m.generate(enc, max_new_tokens=8, eos_token_id=int(ref["eos"]), pad_token_id=pad,
                     logits=True)  # fmt: skip
    compiled = programs()
    # one program for the prompt, one for all 7 steps (none where an earlier test made it)
    assert all(0 <= a - b <= 1 for a, b in zip(compiled, before))
    assert out.tokens_BxN.shape == (2, 8)
    assert_tokens(out.tokens_BxN, ref["tokens"], pad)
    n = ref["logits"].shape[1]
    np.testing.assert_allclose(out.logits_BxNxV[:, :n], ref["logits"], atol=TOL, rtol=TOL)
    stop = int(ref["stop_eos"])
    stopped = m.generate(enc, max_new_tokens=8, eos_token_id=stop, pad_token_id=pad)
    assert programs() == compiled  # the same shapes: nothing traced again
    assert_tokens(stopped.tokens_BxN, ref["stop_tokens"], pad)
    for row, n_row in zip(stopped.tokens_BxN, stopped.n_B):
        if n_row < 8:  # stopped: its first end of sequence, then pad
            assert row[n_row - 1] == stop and stop not in row[: n_row - 1]
            assert (row[n_row:] == pad).all()
        else:
            assert stop not in row[:-1]


def test_cache_equals_full_forward():
    """Greedy decoding with the cache equals greedy decoding by whole forwards without
    one: a forward of the prompts and the generated tokens (Qwen2-VL, 8 new tokens)
    gives at each row the logits the cached step gave (1e-4), whose argmax is the next
    generated token. (A causal row reads the tokens before it only, so this one forward
    is every re-forward of the greedy loop at once.) With the new tokens' position ids
    one later, those logits miss by far more than the bound: the positions count."""
    m, enc, ref = fixture("qwen2_vl")
    N = 8
    out = m.generate(enc, max_new_tokens=N, eos_token_id=int(ref["eos"]),
                     pad_token_id=int(ref["pad"]), logits=True)  # fmt: skip
    assert (out.n_B == N).all()
    inputs = enc.inputs
    S = inputs.tokens_BxS.shape[1]
    top = np.asarray(inputs.pos_Bx3xS).max((1, 2))[:, None]
    forward = jax.jit(functools.partial(qwen_model.forward, config=m.config))
    for shift in (0, 1):
        ids = np.repeat((top + 1 + shift + np.arange(N - 1))[:, None], 3, 1)
        x = inputs._replace(
            tokens_BxS=np.concatenate([inputs.tokens_BxS, out.tokens_BxN[:, : N - 1]], 1),
            pos_Bx3xS=np.concatenate([inputs.pos_Bx3xS, ids], 2),
            valid_BxS=np.concatenate([inputs.valid_BxS, np.ones((2, N - 1), bool)], 1),
        )
        logits = np.asarray(forward(m.params, jax.tree.map(jnp.asarray, x))[0])[:, S - 1 :]
        if shift == 0:
            np.testing.assert_allclose(logits, out.logits_BxNxV, atol=TOL, rtol=TOL)
            np.testing.assert_array_equal(logits.argmax(-1), out.tokens_BxN)
        else:
            assert np.abs(logits - out.logits_BxNxV)[:, 1:].max() > 100 * TOL


def test_edits_act_on_the_prompt():
    """`edits` act in the prompts' forward only (as the authors' steering hooks): the
    first new token's logits are the edited forward's at the last row (far from the
    unedited ones); `lm_pos_ids` is refused by name."""
    m, enc, ref = fixture("llava")
    D = m.config.lm_width
    edits = Edits(add={"lm/resid_post.0": 3.0 * jnp.ones(D)})
    out = m.generate(enc, max_new_tokens=8, eos_token_id=int(ref["eos"]),
                     pad_token_id=int(ref["pad"]), edits=edits, logits=True)  # fmt: skip
    forward = jax.jit(functools.partial(llava_model.forward, config=m.config, last_row=True))
    want = forward(m.params, jax.tree.map(jnp.asarray, enc.inputs), edits)[0]
    np.testing.assert_allclose(out.logits_BxNxV[:, 0], want, atol=TOL, rtol=TOL)
    assert not np.allclose(out.logits_BxNxV[:, 0], ref["logits"][:, 0], atol=0.1)
    with pytest.raises(ValueError, match="edits.lm_pos_ids"):
        m.generate(enc, max_new_tokens=2, edits=Edits(lm_pos_ids=np.arange(3)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens = 0"),
        (dict(max_new_tokens=-2), "max_new_tokens = -2"),
        (dict(max_new_tokens=True), "max_new_tokens = True"),
        (dict(max_new_tokens=2.0), "max_new_tokens = 2.0"),
        (dict(max_new_tokens=2, greedy=False), "greedy = False"),
        (dict(max_new_tokens=2, eos_token_id=-1), "eos_token_id = -1"),
        (dict(max_new_tokens=2, pad_token_id=[1, 2]), "pad_token_id"),
    ],
)
def test_bad_arguments_named_before_compute(kwargs, match):
    m, enc, _ = fixture("llava")
    traces = []

    def counted(config):
        traces.append(1)
        return llava_model.decoding(config)

    with pytest.raises(ValueError, match=match):
        gen.generate(counted, m.config, m.params, enc, **kwargs)
    assert not traces


def test_not_encoded_and_right_padded_refused():
    m, enc, _ = fixture("llava")
    with pytest.raises(ValueError, match="encoded: expected a processor's output"):
        m.generate(enc.inputs, max_new_tokens=2)
    with pytest.raises(ValueError, match="encoded: expected a processor's output"):
        m.generate(["a question"], max_new_tokens=2)
    right = enc.inputs._replace(valid_BxS=np.asarray(enc.inputs.valid_BxS)[:, ::-1])
    with pytest.raises(ValueError, match="left-padded"):
        m.generate(enc._replace(inputs=right), max_new_tokens=2)


def test_default_ids_from_the_folder(tmp_path):
    """generation_config.json's ids before config.json's; config.json's text_config
    after its own fields; pad falls back to the first end-of-sequence id."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    assert gen.generation_ids(str(tmp_path)) == ([7], 7)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [3, 4], "pad_token_id": 9})
    )
    assert gen.generation_ids(str(tmp_path)) == ([3, 4], 9)
    m, enc, ref = fixture("llava")  # its config.json: pad 61, no end of sequence
    assert gen.generation_ids(m.folder) == ([], 61)


def test_judge_reply_as_the_authors():
    """The reply after the last "ASSISTANT" / "assistant", lower-cased, containing one
    of the two words and not the other; the prompt's "left or right" does not count."""
    m, enc, _ = fixture("llava")
    tok = m.tokenizer
    prompt = tok.encode("USER: Is the red circle to the left or right ? ASSISTANT:").ids

    def judge(reply, correct="left", wrong="right"):
        ids = prompt + tok.encode(reply, add_special_tokens=False).ids
        return gen.judge_reply(tok, ids, correct, wrong)

    assert judge("Left") == "correct"  # counted here, not by an exact next-token match
    assert judge("right .") == "wrong"
    assert judge("left or right") == "nonsense"
    assert judge("yes") == "nonsense"
    # the word-level fixture tokenizer decodes with a space between words
    assert gen.reply_text(tok, prompt + tok.encode("Left .", add_special_tokens=False).ids) == (
        " : left ."
    )
    q, qenc, _ = fixture("qwen2_vl")
    qtok = q.tokenizer
    ids = (
        list(qenc.inputs.tokens_BxS[0][qenc.inputs.valid_BxS[0]])
        + qtok.encode("Right", add_special_tokens=False).ids
    )
    assert gen.judge_reply(qtok, ids, "left", "right") == "wrong"


def test_sequences_for_the_verdict():
    """Each row's real prompt tokens, then its new tokens through its end of sequence."""
    m, enc, ref = fixture("internvl")
    out = m.generate(enc, max_new_tokens=8, eos_token_id=int(ref["stop_eos"]),
                     pad_token_id=int(ref["pad"]))  # fmt: skip
    seqs = gen.sequences(enc, out)
    valid = np.asarray(enc.inputs.valid_BxS)
    for b, s in enumerate(seqs):
        assert len(s) == valid[b].sum() + out.n_B[b]
        assert s[-1] == int(ref["stop_eos"])


# the views' scenes on each fixture: the size its processor keeps as drawn on a 2 x 2 grid
VIEW_SIZES = {"qwen2_vl": 112, "qwen2_5_vl": 112, "qwen3_vl": 128, "internvl": None,
              "gemma3": 56}  # fmt: skip


def gemma_fixture():
    """(the Gemma-3 fixture's handle, its batch case encoded as uint8 codes, the
    reference's generations): `tests/test_gemma3.py`'s case (its reference is not
    `CASES`' layout)."""
    from jaxmech.families.gemma3 import processor as gemma_processor

    folder = os.path.join(FIXTURES, "gemma3", "gemma3")
    family, config, params = load_checkpoint(folder)
    proc = gemma_processor.load_processor(folder, config)
    prompts = np.load(os.path.join(folder, "reference.npz"))["batch/prompt"]
    asked = [t.split("<start_of_turn>user\n")[1].replace("<start_of_image>", "")
             .split("<end_of_turn>")[0] for t in prompts]  # fmt: skip
    images = [os.path.join(FIXTURES, "gemma3", f"batch{i}.png") for i in range(2)]
    codes = gemma_processor.encode(proc, images, asked, codes=True)
    gref = np.load(os.path.join(folder, "generate_reference.npz"))
    gref = {k.split("/", 1)[1]: gref[k] for k in gref.files}
    np.testing.assert_array_equal(codes.inputs.tokens_BxS, gref["input_ids"])
    return Model(family, config, params, folder, proc), codes, gref


@functools.lru_cache(maxsize=None)
def view_case(name: str):
    """(the handle, its checkpoint view (`family.view`, the authors' wording), the
    image case's prompts encoded as a view renders them (`codes=True`: uint8 levels),
    the reference's generations) of fixture `name`."""
    from jaxmech.data.spec import Grid

    if name == "gemma3":
        m, codes, ref = gemma_fixture()
    else:
        m, _, ref = fixture(name)
        codes = encode_images(name, MAIN[name], m.processor, codes=True)
    view = m.family.view(m.folder, m.config, Grid(2, 2), VIEW_SIZES[name], wording="authors")
    return m, view, codes, ref


@pytest.mark.parametrize("name", list(VIEW_SIZES))
def test_the_views_generate_equals_reference(name):
    """A checkpoint view's `generate` (`vlm_view.generate_rendered`: a rendered batch's
    uint8 pixel codes decoded as the view's forward does, then `models.generate` with
    the folder's end-of-sequence and pad ids) on the fixture's prompts encoded as a
    view renders them (`codes=True`): the reference's greedy tokens and per-step
    logits (TOL), none of the folder's end-of-sequence ids among them."""
    m, view, codes, ref = view_case(name)
    assert {x.dtype for x in jax.tree.leaves(codes.inputs)} >= {np.dtype(np.uint8)}
    out = view.generate(m.params, codes.inputs, max_new_tokens=8, logits=True)
    eos, pad = gen.generation_ids(m.folder)
    assert not np.isin(ref["tokens"], eos).any()  # so the folder's ids stop no row early
    assert_tokens(out.tokens_BxN, ref["tokens"], pad)
    n = ref["logits"].shape[1]
    np.testing.assert_allclose(out.logits_BxNxV[:, :n], ref["logits"], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", ["qwen2_vl", pytest.param("internvl", marks=pytest.mark.slow)])
def test_a_steer_of_zero_strength_keeps_the_views_reply(name):
    """The authors' steering on the view's replies (`analysis.steering.steered_replies`
    on the fixture's prompts, two of the question's tokens as X's and Y's words): at
    scale 0 (their hooks adding zeros) every reply is the unsteered `generate`'s, its
    per-step logits within TOL; at their 5 x the words' norms the logits move (the edit
    reaches the reply; the fixture's tokens are too robust to change). 8 tokens:
    `test_the_views_generate_equals_reference`'s compiled programs. InternVL's slow (its
    generation is the reference's above; ~10 s of its own compiles)."""
    from jaxmech.analysis import steering as st
    from jaxmech.families.vlm_view import Examples, Spans

    m, view, codes, _ = view_case(name)
    view = view._replace(generate=functools.partial(view.generate, logits=True))
    inputs = codes.inputs
    S = inputs.tokens_BxS.shape[1]
    words = np.full(2, S - 9), np.full(2, S - 7)  # real tokens of both left-padded rows
    spans = Spans(None, None, None, *words, np.ones((2, S), bool), np.full(2, S - 1))
    ex = Examples(None, inputs, spans, np.zeros(2, np.int32), np.zeros(2, np.int32))
    control = view.generate(m.params, inputs, max_new_tokens=8)
    clean = jax.jit(lambda params: st.unsteered(view, params, ex))(m.params)
    D = clean[1]["lm/resid_pre.1"].shape[-1]
    delta = jax.random.normal(jax.random.PRNGKey(0), (view.grid.cells, D))
    src, dst = np.zeros(2, np.int32), np.full(2, view.grid.cells - 1, np.int32)
    steer = functools.partial(st.steered_replies, view, m.params, ex, 1, delta, src, dst, 8,
                              clean)  # fmt: skip
    zero, five = steer(scale=0.0), steer(scale=5.0)
    np.testing.assert_array_equal(zero.tokens_BxN, control.tokens_BxN)
    np.testing.assert_allclose(zero.logits_BxNxV, control.logits_BxNxV, atol=TOL, rtol=TOL)
    assert np.abs(five.logits_BxNxV - control.logits_BxNxV).max() > 100 * TOL


@pytest.mark.parametrize("name", ["qwen2_vl", pytest.param("internvl", marks=pytest.mark.slow),
                                  "gemma3"])  # fmt: skip
def test_a_forward_on_the_prompt_and_reply_reads_the_generated_rows(name):
    """`vlm_view.with_reply` (the prompts with 7 generated tokens appended, position ids
    continued as generation places them: M-RoPE's [B, 3, S] and the 1-D [B, S]): the
    view's forward on it gives at its last row the logits generation chose token 8
    from (TOL), so the states a forward reads at a reply's rows are the generation's.
    (8 tokens: `test_the_views_generate_equals_reference`'s compiled programs.) Qwen's
    M-RoPE ids and Gemma-3's 1-D ids with sliding-window layers in the suite; InternVL's
    (1-D, as Gemma-3's) slow."""
    from jaxmech.families.vlm_view import with_reply

    m, view, codes, _ = view_case(name)
    out = view.generate(m.params, codes.inputs, max_new_tokens=8, logits=True)
    forward = jax.jit(lambda params, inputs: view.forward(params, inputs)[0])
    logits = forward(m.params, with_reply(codes.inputs, out.tokens_BxN[:, :7]))
    np.testing.assert_allclose(logits, out.logits_BxNxV[:, 7], atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="inputs: expected"):
        with_reply(codes, out.tokens_BxN)
