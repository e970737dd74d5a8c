"""Strict inputs at the public boundary: each bad input a new user met is a ValueError
that names the argument, the value and what was expected (checked before any compute).

Shares test_dual_encoder's small config and inputs (vocabulary: 20 labels, so image ids
0..20 with CLS = 21, text ids 0..28 with EOT = 28; L = 8, T = 9).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dual_encoder import CAPTIONS, IMAGES, SMALL, H, L, random_params

from jaxmech.analysis.decompose import decompose
from jaxmech.analysis.rope import rope_logit_parts
from jaxmech.families.dual_encoder.checks import with_static
from jaxmech.families.dual_encoder.model import encode_images, encode_texts, forward
from jaxmech.models.edits import Edits, term_mask
from jaxmech.shapes import check_int_array, check_positions

PARAMS = random_params(SMALL)
CLS_PARAMS = random_params(SMALL.replace(cls_position=True))
ROPE_PARAMS = random_params(SMALL.replace(vision_pos="rope", rope_base=10.0))


def test_an_image_one_pixel_short_is_not_read_as_a_cls_position_image():
    with pytest.raises(ValueError, match=r"images_BxL has length 7.*without a CLS.*length 8"):
        encode_images(PARAMS, IMAGES[:, :7])
    # a model with a CLS position row (P has L + 1 = 9 rows) takes length 8, not 9 or 7
    encode_images(CLS_PARAMS, IMAGES)
    with pytest.raises(ValueError, match=r"length 7.*with a CLS position row.*length 8"):
        encode_images(CLS_PARAMS, IMAGES[:, :7])
    # the same check through forward and decompose
    with pytest.raises(ValueError, match="images_BxL has length 7"):
        forward(PARAMS, IMAGES[:, :7], CAPTIONS)
    with pytest.raises(ValueError, match="images_BxL has length 7"):
        decompose(PARAMS, IMAGES[:, :7])


@pytest.mark.parametrize("bad", [21, 22, 1000, -1], ids=["cls", "vocab", "1000", "neg"])
def test_image_ids_out_of_range(bad):
    images = IMAGES.at[0, 3].set(bad)
    with pytest.raises(ValueError, match=rf"images_BxL contains {bad}: .*\[0, 20\]"):
        encode_images(PARAMS, images)
    with pytest.raises(ValueError, match="images_BxL contains"):
        forward(PARAMS, images, CAPTIONS)


@pytest.mark.parametrize("bad", [29, 1000, -1])
def test_caption_ids_out_of_range(bad):
    captions = CAPTIONS.at[1, 4].set(bad)
    with pytest.raises(ValueError, match=rf"captions_CxT contains {bad}: .*\[0, 28\]"):
        encode_texts(PARAMS, captions)
    with pytest.raises(ValueError, match="captions_CxT contains"):
        decompose(PARAMS, captions, tower="text")


def test_captions_too_long_or_without_eot():
    long = jnp.concatenate([CAPTIONS, CAPTIONS[:, :2]], axis=1)  # T = 11 > 9 position rows
    with pytest.raises(ValueError, match=r"captions_CxT has length 11.*9 position rows"):
        encode_texts(PARAMS, long)
    eot_at = np.argmax(np.asarray(CAPTIONS) == 28, axis=1)
    no_eot = CAPTIONS.at[2, int(eot_at[2])].set(0)
    with pytest.raises(ValueError, match=r"rows \[2\] have no EOT token \(id 28\)"):
        forward(PARAMS, IMAGES, no_eot)


def test_positions_are_checked():
    # learned P: integer or float positions in [0, L - 1]; fractional ones interpolate
    encode_images(PARAMS, IMAGES, positions=jnp.arange(L, dtype=jnp.float32) * 0.5 + 3.5)
    for bad in (jnp.arange(L) + 1, jnp.arange(L) - 1, jnp.arange(L) + 0.5):
        with pytest.raises(ValueError, match=r"vision_positions contains .*\[0, 7\]"):
            forward(PARAMS, IMAGES, CAPTIONS, vision_positions=bad)
    with pytest.raises(ValueError, match=r"vision_positions has shape \(7,\): expected \[8\]"):
        forward(PARAMS, IMAGES, CAPTIONS, vision_positions=jnp.arange(7))
    with pytest.raises(ValueError, match=r"positions has shape \(3, 8\).*\[4, 8\]"):
        encode_images(PARAMS, IMAGES, positions=jnp.zeros((3, L), jnp.int32))
    with pytest.raises(ValueError, match=r"text_positions contains 9: .*\[0, 8\]"):
        forward(PARAMS, IMAGES, CAPTIONS, text_positions=jnp.arange(9) + 1)
    # rotary positions are angles, not rows of a table: any value, but the right shape
    encode_images(ROPE_PARAMS, IMAGES, positions=jnp.arange(L) + 3.0)
    with pytest.raises(ValueError, match=r"positions has shape \(9,\)"):
        encode_images(ROPE_PARAMS, IMAGES, positions=jnp.arange(L + 1))


@pytest.mark.parametrize("ndim", [1, 3])
def test_inputs_of_the_wrong_rank(ndim):
    images = IMAGES[0] if ndim == 1 else IMAGES[None]
    captions = CAPTIONS[0] if ndim == 1 else CAPTIONS[None]
    with pytest.raises(ValueError, match=r"images_BxL has shape .*expected \[B, L\]"):
        forward(PARAMS, images, CAPTIONS)
    with pytest.raises(ValueError, match=r"captions_CxT has shape .*expected \[C, T\]"):
        forward(PARAMS, IMAGES, captions)
    with pytest.raises(ValueError, match=r"images_BxL has shape"):
        decompose(PARAMS, images)
    with pytest.raises(ValueError, match=r"images_BxL has shape"):
        rope_logit_parts(ROPE_PARAMS, images)


def test_float_token_ids_are_refused():
    with pytest.raises(ValueError, match="images_BxL has dtype float32"):
        encode_images(PARAMS, IMAGES.astype(jnp.float32))


def test_decompose_checks_tower_and_layer_before_reading_params():
    for tower in ("Vision", "image"):
        with pytest.raises(ValueError, match=rf"tower = '{tower}': expected 'vision' or 'text'"):
            decompose(PARAMS, IMAGES, tower=tower)
    with pytest.raises(ValueError, match=r"layer = 1: the vision tower has layers 0..0"):
        decompose(PARAMS, IMAGES, layer=1)
    with pytest.raises(ValueError, match=r"layer = 2: the vision tower has layers 0..0"):
        rope_logit_parts(ROPE_PARAMS, IMAGES, layer=2)


def test_params_missing_keys_or_stacked():
    no_proj = {**PARAMS, "vision": {k: v for k, v in PARAMS["vision"].items() if k != "W_proj"}}
    with pytest.raises(ValueError, match=r"params\['vision'\] is missing 'W_proj'"):
        forward(no_proj, IMAGES, CAPTIONS)
    block = {k: v for k, v in PARAMS["text"]["block_0"].items() if k != "b_K"}
    no_bias = {**PARAMS, "text": {**PARAMS["text"], "block_0": block}}
    with pytest.raises(ValueError, match=r"params\['text'\]\['block_0'\] is missing 'b_K'"):
        encode_texts(no_bias, CAPTIONS)
    with pytest.raises(ValueError, match=r"params is missing 'text'"):
        encode_texts({k: v for k, v in PARAMS.items() if k != "text"}, CAPTIONS)
    # the switches: without params["static"], or without one of its keys
    no_static = {k: v for k, v in PARAMS.items() if k != "static"}
    with pytest.raises(ValueError, match=r"no 'static' subtree \(needed for 'cls_position'\)"):
        forward(no_static, IMAGES, CAPTIONS)
    static = {k: v for k, v in PARAMS["static"].items() if k != "causal_text"}
    with pytest.raises(ValueError, match=r"params\['static'\] is missing 'causal_text'"):
        encode_texts({**PARAMS, "static": static}, CAPTIONS)
    with pytest.raises(ValueError, match=r"'causal_text'\] = 0.5: expected 0.0 or 1.0"):
        encode_texts(with_static(PARAMS, causal_text=0.5), CAPTIONS)
    # stacked over K models without vmap: say so (not "P has 2 rows")
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), PARAMS)
    for f in (
        lambda: forward(stacked, IMAGES, CAPTIONS),
        lambda: encode_images(stacked, IMAGES),
        lambda: decompose(stacked, IMAGES),
    ):
        with pytest.raises(ValueError, match="stacked over K models: vmap over them"):
            f()


def test_edits_are_checked():
    with pytest.raises(ValueError, match=r"edits.term_keep has keys \['Vision'\]"):
        forward(PARAMS, IMAGES, CAPTIONS, edits=Edits(term_keep={"Vision": term_mask(H)}))
    with pytest.raises(ValueError, match=r"term_keep\['vision'\] has shape \(3, 9\).*\[4, 9\]"):
        forward(PARAMS, IMAGES, CAPTIONS, edits=Edits(term_keep={"vision": term_mask(3)}))
    with pytest.raises(ValueError, match=r"vp_keep\['text'\] has shape \(4, 9\)"):
        forward(PARAMS, IMAGES, CAPTIONS, edits=Edits(vp_keep={"text": term_mask(H)}))
    # a misspelt or absent point would edit nothing: refused
    for name in ("vision/resid_post.1", "vision/resid.0", "Vision/embed", "text/readout.0"):
        with pytest.raises(ValueError, match=f"edit name '{name}'"):
            forward(PARAMS, IMAGES, CAPTIONS, edits=Edits(add={name: 0.0}))
    forward(PARAMS, IMAGES, CAPTIONS, edits=Edits(add={"text/readout": 0.0}))
    # term_mask itself
    with pytest.raises(ValueError, match=r"remove = 'EP': expected a list"):
        term_mask(H, "EP")
    with pytest.raises(ValueError, match=r"heads = \[4\]: expected indices in \[0, 3\]"):
        term_mask(H, ["EP"], heads=[4])
    with pytest.raises(ValueError, match="n_heads = 0"):
        term_mask(0)


def test_checks_stay_out_of_traced_code():
    # under jit, values are unknown: shapes are still checked, value checks are skipped
    # (so the checked functions stay jittable); eager calls check values
    fwd = jax.jit(forward, static_argnames="readout_only")
    sims, _ = fwd(PARAMS, IMAGES, CAPTIONS)
    np.testing.assert_allclose(sims, forward(PARAMS, IMAGES, CAPTIONS)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="images_BxL has shape"):
        fwd(PARAMS, IMAGES[0], CAPTIONS)
    fwd(PARAMS, IMAGES.at[0, 0].set(21), CAPTIONS)  # traced ids: not checked


def test_shape_validators():
    check_int_array("x", np.zeros((2, 3), np.int32), 2, 0, 5)
    with pytest.raises(ValueError, match=r"x has shape \(3,\): expected an int array with 2"):
        check_int_array("x", np.zeros(3, np.int32), 2)
    with pytest.raises(ValueError, match=r"x contains 7: expected values in \[0, 5\]"):
        check_int_array("x", np.asarray([[1, 7]]), 2, 0, 5)
    with pytest.raises(ValueError, match="x contains -2"):
        check_int_array("x", np.asarray([[-2, 1]]), 2, 0, None)
    check_positions("p", np.asarray([[0.0, 2.5]]), 2, 1, 0, 3)
    with pytest.raises(ValueError, match=r"p has shape \(2, 2\): expected \[2\] or \[1, 2\]"):
        check_positions("p", np.zeros((2, 2)), 2, 1)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "internvl"])
def test_several_images_for_one_question_are_refused_by_name(family):
    """`encode([[img0, img1]], [q])`: a list where one image is expected is refused
    naming `images[0]`, not numpy's "setting an array element with a sequence"; a
    video given as a list of frames is not an image list."""
    import importlib
    import os

    from PIL import Image

    from jaxmech.families.registry import read_checkpoint_config

    here = os.path.join(os.path.dirname(__file__), "fixtures", family)
    folder = os.path.join(here, family)
    _, config = read_checkpoint_config(folder)
    processor = importlib.import_module(f"jaxmech.families.{family}.processor")
    proc = processor.load_processor(folder, config)
    encode = (
        importlib.import_module(f"jaxmech.families.{family}.encode")
        if family == "internvl"
        else processor
    )
    img0 = Image.new("RGB", (30, 20))
    img1 = Image.new("RGB", (20, 30))
    with pytest.raises(ValueError, match=r"images\[0\]: a list of 2, expected one image"):
        encode.encode(proc, [[img0, img1]], ["Is the cup left or right of the plate?"])
    with pytest.raises(ValueError, match=r"images\[1\]: a tuple of 2"):
        encode.encode(proc, [img0, (img0, img1)], ["a?", "b?"])
    from jaxmech.data.inputs.prompts import check_batch

    frames = [np.zeros((28, 28, 3), np.uint8)] * 2
    check_batch([frames], ["q?"], what="videos")  # a video's frames may come as a list
