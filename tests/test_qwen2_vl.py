"""The Qwen2-VL / Qwen2.5-VL family's own behaviour on its fixtures
(`tests/fixtures/qwen2_vl/make_fixtures.py`: tiny random checkpoints written by Hugging
Face transformers 5.24): the bfloat16 forward, Qwen2.5-VL's windows, its position edits,
the M-RoPE ids, patch order and resize by hand, the 2B's size, its config layouts.
Processor and forward equal to the reference (images, videos, text only), the sites,
no-op edits and refusals: the contract test, `tests/test_checkpoint_contract.py`.
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


def test_position_edits_act(checkpoint):
    """The width mirror of the ViT's rotary columns (all blocks, or one), the LM's ids and
    the image order change the answer logits; mirroring one block differs from all. (One
    program: the edits vmapped, each the identity but for one field; the identity edits
    are the plain run: the contract test.)"""
    config, p, proc, ref = checkpoint
    enc, _ = encoded(proc, ref, "padded")
    x = enc.inputs
    B, _, S = x.pos_Bx3xS.shape
    cols = np.tile(x.cols_BxP[0].astype(np.float32), (config.vit_depth, 1))
    mirror = enc.grid[2] - 1 - cols
    one = cols.copy()
    one[0] = mirror[0]
    order = np.arange(x.image_BxI.shape[1])
    same = dict(vit_cols=cols, lm_pos_ids=np.asarray(x.pos_Bx3xS), image_order=order)
    changes = [{}, {"vit_cols": mirror}, {"vit_cols": one},
               {"lm_pos_ids": np.broadcast_to(x.pos_Bx3xS[0, 0], (B, 3, S))},
               {"image_order": order[::-1].copy()}]  # fmt: skip
    edits = jax.tree_util.tree_map(lambda *a: np.stack(a), *[Edits(**same | c) for c in changes])
    last = lambda p, x, e: model.forward(p, x, e, config=config, rows=[S - 1])[0]  # noqa: E731
    plain, *outs = np.asarray(jax.jit(jax.vmap(last, (None, None, 0)))(p, x, edits))
    for out in outs:
        assert np.abs(out - plain).max() > 1e-3
    assert np.abs(outs[0] - outs[1]).max() > 1e-3


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


def test_video_frames_the_processor_would_resize_are_refused(checkpoint):
    _, _, proc, _ = checkpoint
    frames = np.zeros((2, 56, 100, 3), np.uint8)
    with pytest.raises(ValueError, match="frames of 56 x 100 would be resized"):
        processor.encode_video(proc, [frames], ["Is the red circle to the left?"])
    with pytest.raises(ValueError, match="fps = 0"):
        processor.encode_video(proc, [frames[:, :, :56]], ["q"], fps=0)
