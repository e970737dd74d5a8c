"""The Qwen2-VL / Qwen2.5-VL family against the reference implementation's stored outputs
(`tests/fixtures/qwen2_vl/make_fixtures.py`: tiny random checkpoints written by Hugging
Face transformers 5.24, its processor's tokens, pixels and M-RoPE ids, its float32
forward's hidden states and logits), its edits, and its loader's and processor's errors.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.families import load_checkpoint
from jaxmech.families.qwen2_vl import load, model, params, positions, processor
from jaxmech.families.qwen2_vl.checks import site_names
from jaxmech.families.qwen2_vl.config import from_hf
from jaxmech.models.edits import Edits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl")
VARIANTS = ("qwen2_vl", "qwen2_5_vl")  # Hub layout float32 / transformers-5 layout bf16, sharded
CASES = {"single": 1, "batch": 2, "downscaled": 1, "padded": 2}
TOL = 1e-4  # the bound in float32; seen: <= 2.4e-5 (BUILD_NOTES.md)


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request):
    folder = os.path.join(FIXTURES, request.param)
    family, config, p = load_checkpoint(folder)
    proc = processor.load_processor(folder, config, resize="pil")  # written by the PIL backend
    return config, p, proc, np.load(os.path.join(folder, "reference.npz"))


def questions(ref, case):
    """The questions in the reference's chat prompts."""
    return [t.split("<|vision_end|>")[1].split("<|im_end|>")[0] for t in ref[f"{case}/prompt"]]


def encoded(proc, ref, case):
    images = [os.path.join(FIXTURES, f"{case}{i}.png") for i in range(CASES[case])]
    return processor.encode(proc, images, questions(ref, case)), list(ref[f"{case}/prompt"])


def reference_pixels(ref, case, s):
    """The reference's pixel_values from its stored levels (make_fixtures.pixel_levels)."""
    n = s.temporal_patch_size * s.patch_size**2
    mean, std = np.repeat(np.float32(s.mean), n), np.repeat(np.float32(s.std), n)
    return ((ref[f"{case}/levels"].astype(np.float64) / 255).astype(np.float32) - mean) / std


@pytest.mark.parametrize("case", CASES)
def test_processor_equals_reference(checkpoint, case):
    config, _, proc, ref = checkpoint
    enc, prompts = encoded(proc, ref, case)
    assert float(ref[f"{case}/levels_err"]) <= 1e-6  # the levels hold the reference's floats
    assert [
        processor.chat_prompt(q) for q in questions(ref, case)
    ] == prompts  # the published template
    np.testing.assert_array_equal(enc.inputs.tokens_BxS, ref[f"{case}/input_ids"])
    np.testing.assert_array_equal(enc.inputs.valid_BxS, ref[f"{case}/attention_mask"].astype(bool))
    assert (1, *enc.grid[1:]) == tuple(ref[f"{case}/grid"][0])
    pixels = reference_pixels(ref, case, proc.images)
    np.testing.assert_allclose(
        enc.inputs.pixels_BxPxF.reshape(pixels.shape), pixels, atol=1e-6, rtol=0
    )
    np.testing.assert_array_equal(enc.inputs.pos_Bx3xS, ref[f"{case}/rope"].transpose(1, 0, 2))


@pytest.mark.parametrize("case", CASES)
def test_forward_equals_reference(checkpoint, case):
    config, p, proc, ref = checkpoint
    enc, _ = encoded(proc, ref, case)
    logits, aux = jax.jit(functools.partial(model.forward, config=config, capture=True))(
        p, enc.inputs
    )
    valid = enc.inputs.valid_BxS
    close = lambda ours, theirs: np.testing.assert_allclose(
        np.asarray(ours), theirs, atol=TOL, rtol=TOL
    )
    close(np.asarray(logits)[valid], ref[f"{case}/logits"][valid])
    hidden = ref[f"{case}/hidden"]  # entering each block, then after the final norm
    for i in range(config.lm_layers):
        close(np.asarray(aux[f"lm/resid_pre.{i}"])[valid], hidden[i][valid])
    close(np.asarray(aux["lm/final"])[valid], hidden[-1][valid])
    close(np.asarray(aux["merger/out"]).reshape(ref[f"{case}/merged"].shape), ref[f"{case}/merged"])
    for i, block in enumerate(ref[f"{case}/vit_blocks"]):
        close(np.asarray(aux[f"vit/resid_post.{i}"]).reshape(block.shape), block)


def test_bfloat16_forward():
    """Loaded in bfloat16 (norms, rotations and softmax still in float32), Qwen2.5-VL's
    logits stay near the float32 reference's."""
    folder = os.path.join(FIXTURES, "qwen2_5_vl")
    _, config, p = load_checkpoint(folder, dtype=jnp.bfloat16)
    ref = np.load(os.path.join(folder, "reference.npz"))
    enc, _ = encoded(processor.load_processor(folder, config, resize="pil"), ref, "single")
    logits, _ = jax.jit(functools.partial(model.forward, config=config))(p, enc.inputs)
    assert logits.dtype == jnp.bfloat16
    err = np.abs(np.asarray(logits, np.float32) - ref["single/logits"]).max()
    assert 1e-4 < err < 0.1  # bfloat16 rounding (8 bits of mantissa), not float32's


def test_windows_matter(checkpoint):
    """Qwen2.5-VL's window blocks are tested by the reference comparison only if removing the
    windows changes the output (it does, by ~0.1)."""
    import dataclasses

    config, p, proc, ref = checkpoint
    if not config.vit_window:
        pytest.skip("Qwen2-VL has no windows")
    enc, _ = encoded(proc, ref, "downscaled")
    unwindowed = dataclasses.replace(config, vit_window=0)
    full = jax.jit(functools.partial(model.image_features, config=unwindowed))(p, enc.inputs)
    assert (
        np.abs(np.asarray(full).reshape(-1, config.lm_width) - ref["downscaled/merged"]).max()
        > 100 * TOL
    )


def test_no_op_edits_are_exact(checkpoint):
    config, p, proc, ref = checkpoint
    enc, _ = encoded(proc, ref, "padded")
    x = enc.inputs
    plain, aux = model.forward(p, x, config=config, capture=("lm/resid_pre", "vit/resid_mid"))
    identity = Edits(
        add={"lm/resid_pre.1": jnp.zeros(()), "merger/out": jnp.zeros(())},
        replace={
            "vit/resid_mid.0": (True, aux["vit/resid_mid.0"]),
            "lm/resid_pre.0": (True, aux["lm/resid_pre.0"]),
        },
        vit_rows=x.rows_BxP[0].astype(np.float32),
        vit_cols=np.tile(x.cols_BxP[0], (config.vit_depth, 1)),
        lm_pos_ids=x.pos_Bx3xS,
        image_order=np.arange(x.image_BxI.shape[1]),
    )
    edited, _ = model.forward(p, x, identity, config=config)
    np.testing.assert_array_equal(np.asarray(edited), np.asarray(plain))


def test_position_edits_act(checkpoint):
    """The width mirror of the ViT's rotary columns (all blocks, or one), the LM's ids and
    the image order change the answer logits; mirroring one block differs from all."""
    config, p, proc, ref = checkpoint
    enc, _ = encoded(proc, ref, "padded")  # the no-op test's shapes: eager ops compiled once
    x = enc.inputs
    w = enc.grid[2]
    mirror = (w - 1 - x.cols_BxP[0]).astype(np.float32)
    one = np.tile(x.cols_BxP[0].astype(np.float32), (config.vit_depth, 1))
    one[0] = mirror
    last = lambda e: np.asarray(
        model.forward(p, x, e, config=config, rows=[x.tokens_BxS.shape[1] - 1])[0]
    )
    plain = last(None)
    outs = [
        last(Edits(vit_cols=mirror)),
        last(Edits(vit_cols=one)),
        last(Edits(lm_pos_ids=x.pos_Bx3xS[0, 0])),
        last(Edits(image_order=np.arange(x.image_BxI.shape[1])[::-1].copy())),
    ]
    for out in outs:
        assert np.abs(out - plain).max() > 1e-3
    assert np.abs(outs[0] - outs[1]).max() > 1e-3


def test_edit_errors(checkpoint):
    config, p, proc, ref = checkpoint
    enc, _ = encoded(proc, ref, "single")
    x = enc.inputs
    bad = {
        "lm/resid_pre.9": Edits(add={"lm/resid_pre.9": 0.0}),
        "Edits.term_keep": Edits(term_keep={"vit": np.ones((2, 16))}),
        "Edits.image_order: expected a permutation": Edits(
            image_order=np.zeros(x.image_BxI.shape[1], int)
        ),
        "Edits.vit_cols: shape": Edits(vit_cols=np.zeros(3)),
        "Edits.lm_pos_ids: shape": Edits(lm_pos_ids=np.zeros((2, 5))),
    }
    for message, edits in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").split(":")[0]):
            model.forward(p, x, edits, config=config)
    assert len(set(site_names(config))) == len(site_names(config))


def test_mrope_ids_by_hand():
    """Two text tokens, a 2 x 3 merged image (4 x 6 patches), two text tokens: the image
    gets (2, 2 + row, 2 + col); the text resumes at 2 + max(2, 3) = 5, not at 2 + 6."""
    ids = np.array([[7, 8, 9, 9, 9, 9, 9, 9, 7, 8]])
    got = positions.mrope_ids(ids, [(1, 4, 6)], image_token_id=9, merge=2)[0]
    want = np.array(
        [
            [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
        ]
    )
    np.testing.assert_array_equal(got, want)
    padded = positions.mrope_ids(
        np.array([[0, 0, *ids[0]]]),
        [(1, 4, 6)],
        9,
        2,
        valid_BxS=np.array([[False, False] + [True] * 10]),
    )[0]
    np.testing.assert_array_equal(padded, np.concatenate([np.zeros((3, 2), int), want], 1))
    with pytest.raises(ValueError, match="image tokens"):
        positions.mrope_ids(ids[:, :-3], [(1, 4, 6)], 9, 2)


def test_patch_order_and_windows_by_hand():
    rows, cols, frame = positions.patch_grid((1, 2, 4), merge=2)
    np.testing.assert_array_equal(rows, [0, 0, 1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(cols, [0, 1, 0, 1, 2, 3, 2, 3])
    win = positions.window_ids((1, 4, 6), merge=2, window=4)  # windows cut at column 4
    np.testing.assert_array_equal(win.reshape(-1, 4)[:, 0], [0, 0, 1, 0, 0, 1])


def test_smart_resize():
    r = lambda h, w, lo=56 * 56, hi=28 * 28 * 1280: processor.smart_resize(h, w, 28, lo, hi)
    assert r(70, 98) == (56, 112)  # round half to even: 2.5 -> 2, 3.5 -> 4
    assert r(20, 30) == (56, 84)  # too few pixels: scaled up
    assert r(1000, 2000, hi=28 * 28 * 16) == (56, 140)  # too many: floor(2000 / 12.6 / 28) = 5
    with pytest.raises(ValueError, match="aspect ratio"):
        r(10, 2500)


def test_qwen2_vl_2b_parameters():
    """The Hub's Qwen2-VL-2B-Instruct config.json (as the real-size stand-in writes it,
    `families.qwen2_vl.stand_in`): 2,208,985,600 parameters, 4,417,971,200 bytes in
    bfloat16 (its model.safetensors files), no lm_head (tied)."""
    from jaxmech.families.qwen2_vl.stand_in import QWEN2_VL_2B as hub

    c = from_hf(hub)
    assert params.n_params(c) == 2_208_985_600
    assert params.n_params(c) * 2 == 4_417_971_200
    names = load.key_map(c)
    assert "lm_head.weight" not in names and "visual.patch_embed.proj.weight" in names
    assert c.vit_head_dim == 80 and c.lm_mrope_section == (16, 24, 24)


def test_config_layouts_agree():
    """The Hub's flat config.json and transformers 5's nested one read alike."""
    import json

    with open(os.path.join(FIXTURES, "qwen2_vl", "config.json")) as f:
        hub = json.load(f)
    text = {
        k: hub.pop(k)
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "vocab_size",
        )
    }
    theta, section = hub.pop("rope_theta"), hub.pop("rope_scaling")["mrope_section"]
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": theta,
        "mrope_section": section,
    }
    nested = {**hub, "text_config": text, "dtype": hub.pop("torch_dtype")}
    assert from_hf(nested) == load.read_config(os.path.join(FIXTURES, "qwen2_vl"))


def test_init_params_match_the_loaded_layout(checkpoint):
    config, p, _, _ = checkpoint
    fresh = params.init_params(config, jax.random.PRNGKey(0))
    shape = lambda t: jax.tree_util.tree_map(lambda a: tuple(a.shape), t)
    assert shape(fresh) == shape(p) == params.param_shapes(config)


VIDEO_QUESTIONS = [  # make_fixtures.VIDEO_CASES
    "Is the red circle to the left or the right of the blue square? Answer with one word.",
    "Is the blue cross above or below the red triangle? Answer with one word.",
]


def test_video_equals_reference(checkpoint):
    """A batch of two 3-frame videos (the last frame repeated over the temporal patch,
    rows left-padded; Qwen2.5-VL's time ids spaced by tokens_per_second x seconds per
    temporal patch at 1 fps) through the processor and the forward, against the
    reference's `video_reference.npz` (make_fixtures.py videos)."""
    config, p, proc, _ = checkpoint
    folder = os.path.join(FIXTURES, config.variant)
    ref = np.load(os.path.join(folder, "video_reference.npz"))
    enc = processor.encode_video(proc, list(ref["video/frames"]), VIDEO_QUESTIONS,
                                 fps=float(ref["video/fps"]))  # fmt: skip
    np.testing.assert_array_equal(enc.inputs.tokens_BxS, ref["video/input_ids"])
    np.testing.assert_array_equal(enc.inputs.valid_BxS, ref["video/attention_mask"].astype(bool))
    assert enc.grid == tuple(ref["video/grid"][0]) and enc.grid[0] == 2
    pixels = reference_pixels({"v/levels": ref["video/levels"]}, "v", proc.videos)
    np.testing.assert_allclose(enc.inputs.pixels_BxPxF.reshape(pixels.shape), pixels, atol=1e-6)
    np.testing.assert_array_equal(enc.inputs.pos_Bx3xS, ref["video/rope"].transpose(1, 0, 2))
    if config.vit_tokens_per_second:  # the time ids are spaced: 2 s per temporal patch x 4
        t_ids = np.take_along_axis(enc.inputs.pos_Bx3xS[:, 0], enc.inputs.image_BxI, 1)
        assert (np.ptp(t_ids, 1) == 8).all()
    logits, aux = jax.jit(functools.partial(model.forward, config=config, capture=True))(
        p, enc.inputs
    )
    valid = enc.inputs.valid_BxS
    np.testing.assert_allclose(
        np.asarray(logits)[valid], ref["video/logits"][valid], atol=TOL, rtol=TOL
    )
    for i in range(config.lm_layers):
        np.testing.assert_allclose(np.asarray(aux[f"lm/resid_pre.{i}"])[valid],
                                   ref["video/hidden"][i][valid], atol=TOL, rtol=TOL)  # fmt: skip


def test_video_frames_the_processor_would_resize_are_refused(checkpoint):
    _, _, proc, _ = checkpoint
    frames = np.zeros((2, 56, 100, 3), np.uint8)
    with pytest.raises(ValueError, match="frames of 56 x 100 would be resized"):
        processor.encode_video(proc, [frames], ["Is the red circle to the left?"])
    with pytest.raises(ValueError, match="fps = 0"):
        processor.encode_video(proc, [frames[:, :, :56]], ["q"], fps=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_text_only_forward_equals_reference(variant):
    """A question without an image (the text-only prompt: paper 003's baseline) through
    `processor.encode_text` and the forward equals the reference's (`make_text_reference.py`):
    ids, mask, every hidden state, the logits."""
    folder = os.path.join(FIXTURES, variant)
    _, config, p = load_checkpoint(folder)
    ref = np.load(os.path.join(folder, "text_reference.npz"))
    enc = processor.encode_text(processor.load_processor(folder, config), list(ref["questions"]))
    np.testing.assert_array_equal(enc.inputs.tokens_BxS, ref["input_ids"])
    valid = ref["attention_mask"].astype(bool)
    np.testing.assert_array_equal(enc.inputs.valid_BxS, valid)
    assert enc.inputs.pixels_BxPxF.shape[1] == 0 and enc.inputs.image_BxI.shape[1] == 0
    logits, aux = jax.jit(functools.partial(model.forward, config=config, capture=True))(
        p, enc.inputs
    )
    close = lambda ours, theirs: np.testing.assert_allclose(  # noqa: E731
        np.asarray(ours)[valid], theirs[valid], atol=TOL, rtol=TOL
    )
    close(logits, ref["logits"])
    for i in range(config.lm_layers):
        close(aux[f"lm/resid_pre.{i}"], ref["hidden"][i])
    close(aux["lm/final"], ref["hidden"][-1])
