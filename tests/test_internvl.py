"""The InternVL (-hf) family's own behaviour on its fixture
(`tests/fixtures/internvl/make_fixtures.py`: a tiny random checkpoint written by Hugging
Face transformers 5.25): `next_token`, the pixel shuffle and its mirror, tiling, the
position table's reads and edits, the refusals particular to it, its loader's and
processor's errors, and InternVL3-2B's size. Processor and forward equal to the
reference, the sites, no-op edits and the refusals every family shares: the contract
test, `tests/test_checkpoint_contract.py`."""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxmech.families import load_checkpoint
from jaxmech.families.internvl import encode, load, model, params, positions, processor
from jaxmech.families.internvl.config import from_hf
from jaxmech.models.edits import Edits

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "internvl")
FOLDER = os.path.join(HERE, "internvl")
CASES = {"batch": 2, "tiled": 1, "resampled": 1, "text": 0}  # images per row
TOL = 1e-4  # the bound in float32; seen: <= 2.9e-6 (notes)


@pytest.fixture(scope="module")
def checkpoint():
    family, config, p = load_checkpoint(FOLDER)
    assert family.name == "internvl"
    return config, p, np.load(os.path.join(FOLDER, "reference.npz"))


def questions(ref, case):
    """The questions in the reference's chat prompts (after the image's line)."""
    return [t.split("user\n")[1].replace("<IMG_CONTEXT>\n", "").split("<|im_end|>")[0]
            for t in ref[f"{case}/prompt"]]  # fmt: skip


def encoded(config, ref, case, codes=False):
    """The case through jaxmech's processor, at the case's tile size."""
    proc = processor.load_processor(FOLDER, config)
    proc = proc._replace(images=proc.images._replace(size=int(ref[f"{case}/tile"])))
    if not CASES[case]:
        return proc, encode.encode_text(proc, questions(ref, case))
    images = [os.path.join(HERE, f"{case}{i}.png") for i in range(CASES[case])]
    return proc, encode.encode(proc, images, questions(ref, case), codes=codes)


@functools.partial(jax.jit, static_argnames="config")
def edited_forward(p, x, vit_cols, ids_BxS, order, *, config):
    """(logits, aux) of the forward under the given position and order edits (one
    program per shape); the LM's ids given as [B, 3, S]."""
    e = Edits(vit_cols=vit_cols, lm_pos_ids=jnp.repeat(ids_BxS[:, None], 3, 1), image_order=order)
    return model.forward(p, x, e, config=config)


def identity(x):
    """The identity edits of `edited_forward` for inputs `x`."""
    P = x.pixels_BxTxPxF.shape[2]
    cols = positions.patch_grid(positions.tile_side(P))[1].astype(np.float32)
    return cols, x.pos_BxS, np.arange(x.image_BxI.shape[1])


def test_next_token_equals_reference(checkpoint):
    """`next_token` (what `experiments.ask` prints): the log-softmax of the reference's
    logits after each prompt (the text-only case: the cheapest program)."""
    from jaxmech.families.internvl.family import FAMILY

    config, p, ref = checkpoint
    _, enc = encoded(config, ref, "text")
    want = np.asarray(jax.nn.log_softmax(ref["text/logits"][:, -1]))
    np.testing.assert_allclose(FAMILY.next_token(config, p, enc), want, atol=TOL, rtol=TOL)


def test_pixel_shuffle_order_and_the_mirror():
    """Token (i, j) holds patches (2i + m, 2j + k) in block 2m + k (the reference's
    order, whose stored projector outputs the forward matches); a picture mirrored
    along its width gives the tokens mirrored with their blocks swapped left for
    right (`mirror_channels`), along its height likewise."""
    s, E = 4, 3
    x = np.random.default_rng(0).normal(size=(1, s, s, E)).astype(np.float32)
    out = np.asarray(positions.pixel_shuffle(jnp.asarray(x.reshape(1, s * s, E)), s))
    out = out.reshape(s // 2, s // 2, 4, E)
    for i, j, m, k in np.ndindex(2, 2, 2, 2):
        np.testing.assert_array_equal(out[i, j, 2 * m + k], x[0, 2 * i + m, 2 * j + k])
    for axis, flip in (("w", 2), ("h", 1)):
        flipped = np.flip(x, flip).reshape(1, s * s, E)
        got = np.asarray(positions.pixel_shuffle(jnp.asarray(flipped), s))[0]
        rows, cols = positions.token_grid(s)
        h = s // 2
        src = rows * h + (h - 1 - cols) if axis == "w" else (h - 1 - rows) * h + cols
        shuffled = np.asarray(positions.pixel_shuffle(jnp.asarray(x.reshape(1, s * s, E)), s))[0]
        np.testing.assert_array_equal(got, shuffled[src][:, positions.mirror_channels(E, axis)])


def test_tile_grid_by_hand():
    """The reference's tile choice: the nearest aspect ratio, ties to more tiles while
    the image's area exceeds half of theirs; off: one tile."""
    s = processor.ImageSettings(size=448)
    assert processor.tile_grid(448, 448, s) == (1, 1)  # a drawn scene: one tile
    assert processor.tile_grid(480, 640, s) == (4, 3)  # COCO's 640 x 480: 12 tiles + 1
    assert processor.tile_grid(700, 700, s) == (2, 2)  # the tie broken by the area
    assert processor.tile_grid(1000, 1000, s) == (3, 3)
    assert processor.n_tiles(480, 640, s) == 13
    assert processor.tile_grid(480, 640, s._replace(tiles=False)) == (1, 1)


def test_a_tiled_pictures_mirror():
    """A picture two tiles wide, mirrored: its LM tokens (here the raw pixels, pixel-
    shuffled) are the original's in the mirrored tile and token order
    (`mirror_order`: tiles reversed, each tile and the thumbnail mirrored in place),
    each token's 2 x 2 blocks swapped left for right (`mirror_channels`) and every
    patch's pixels flipped."""
    from PIL import Image

    x = np.asarray(Image.open(os.path.join(HERE, "tiled0.png")).convert("RGB"))
    s, p = processor.ImageSettings(size=56), 7

    def tokens(image):  # [T I, 4, 3, p, p]: each LM token's four patches' pixels
        px, grid = processor.patches(image, s, p, codes=True)
        return np.asarray(positions.pixel_shuffle(jnp.asarray(px), 8)).reshape(-1, 4, 3, p, p), grid

    (orig, (cols, rows)), (flipped, _) = tokens(x), tokens(np.ascontiguousarray(x[:, ::-1]))
    assert (cols, rows) == (2, 1) and len(orig) == 3 * 16
    want = orig[positions.mirror_order(cols, rows, 8)][:, [1, 0, 3, 2], :, :, ::-1]
    np.testing.assert_array_equal(flipped, want)
    np.testing.assert_array_equal(positions.mirror_channels(1), [1, 0, 3, 2])


def test_the_position_table_reads(checkpoint):
    """The position codes (eagerly): under identity and twice-mirrored positions the
    plain run's bit for bit (the whole forward's no-op edits: the contract test); a
    mirror reads the table's columns reversed, a half step the mean of two neighbours,
    clamped at the edge; the bicubic resampling's weights sum to 1 per output."""
    config, p, ref = checkpoint
    vit = p["vit"]
    rows, cols = (a.astype(np.float32) for a in positions.patch_grid(8))
    plain = np.asarray(model.position_codes(vit, 8))
    for e in (Edits(vit_rows=rows, vit_cols=cols), Edits(vit_cols=7 - (7 - cols))):
        np.testing.assert_array_equal(np.asarray(model.position_codes(vit, 8, e)), plain)
    table = np.asarray(vit["pos"])
    mirrored = np.asarray(model.position_codes(vit, 8, Edits(vit_cols=7 - cols)))[1:]
    np.testing.assert_array_equal(mirrored, table[:, ::-1].reshape(64, -1))
    half = np.asarray(model.position_codes(vit, 8, Edits(vit_cols=cols + 0.5)))[1:]
    np.testing.assert_allclose(half[0], (table[0, 0] + table[0, 1]) / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(half[7], table[0, 7])  # clamped at the edge
    np.testing.assert_allclose(positions.bicubic_matrix(8, 6).sum(1), 1.0, rtol=1e-6)


def test_position_edits_act(checkpoint):
    """The width mirror of the position table, a half-column shift (an interpolation of
    the table, not a permutation), the LM's ids and the image order each change the
    answer logits; the mirror applied twice is the plain run, exactly (one program, the
    edits its arguments)."""
    config, p, ref = checkpoint
    _, enc = encoded(config, ref, "batch")
    x = enc.inputs
    same = identity(x)
    cols, n = same[0], x.image_BxI.shape[1]

    def last(*args):
        return np.asarray(edited_forward(p, x, *args, config=config)[0][:, -1])

    plain = last(*same)
    np.testing.assert_array_equal(last(7 - (7 - cols), *same[1:]), plain)
    for i, changed in ((0, 7 - cols), (0, cols + 0.5), (1, x.pos_BxS[:, ::-1].copy()),
                       (2, np.arange(n)[::-1].copy())):  # fmt: skip
        args = list(same)
        args[i] = changed
        assert np.abs(last(*args) - plain).max() > 1e-3


def test_edit_and_input_errors(checkpoint):
    """What InternVL refuses beyond the contract's refusals: per-block ViT positions
    (they enter once), LM ids whose three rows differ (1-D rotary), a tile whose patch
    count is not a square."""
    config, p, ref = checkpoint
    _, enc = encoded(config, ref, "batch")
    x = enc.inputs
    S = x.tokens_BxS.shape[1]
    bad = {
        "Edits.vit_cols: shape": Edits(vit_cols=np.zeros((2, 64))),
        "its three rows must be equal": Edits(lm_pos_ids=np.arange(3 * S).reshape(3, S)),
    }
    for message, edits in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            model.forward(p, x, edits, config=config)
    with pytest.raises(ValueError, match="patches per tile"):
        model.forward(p, x._replace(pixels_BxTxPxF=x.pixels_BxTxPxF[:, :, :49]), config=config)


def copy_with(tmp_path, tensors=None, config=None) -> str:
    """The fixture's folder with its weights and / or config.json replaced."""
    out = tmp_path / "ckpt"
    shutil.copytree(FOLDER, out, ignore=shutil.ignore_patterns("reference.npz"))
    if tensors is not None:
        save_file(tensors, str(out / "model.safetensors"))
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    return str(out)


def stored() -> dict:
    s = load.Stored(load.weight_files(FOLDER))
    return {e[3]: np.asarray(s.array(k)) for k, e in s.entries.items()}


def test_transformers_5_layout_and_an_older_config(tmp_path, checkpoint):
    """The layout transformers 5 saves (model.vision_tower.*, model.language_model.*,
    lm_head.weight), in float16, with a transformers-4 config.json (rope_theta and
    rope_scaling, torch_dtype), loads to the same params (rounded to float16)."""
    config, p, _ = checkpoint
    renamed = {}
    for k, v in stored().items():
        for old, new in (("language_model.model.", "model.language_model."),
                         ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):  # fmt: skip
            if k.startswith(old):
                k = new + k[len(old) :]
                break
        renamed[k] = v.astype(np.float16)
    with open(os.path.join(FOLDER, "config.json")) as f:
        raw = json.load(f)
    rope = raw["text_config"].pop("rope_parameters")
    raw["text_config"] |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    raw["torch_dtype"] = "bfloat16"
    _, c2, p2 = load_checkpoint(copy_with(tmp_path, renamed, raw))
    assert c2 == config.__class__(**{**config.__dict__, "dtype": "bfloat16"})
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a, np.float16), np.asarray(b))


def test_bad_folders_and_configs_are_refused_by_name(tmp_path, checkpoint):
    config = checkpoint[0]
    tensors = stored()
    missing = {k: v for k, v in tensors.items() if "lambda_2" not in k}
    with pytest.raises(
        load.LoadError, match="missing tensor vision_tower.encoder.layer.0.lambda_2"
    ):
        load.load_checkpoint(copy_with(tmp_path / "a", missing))
    wrong = dict(tensors, **{"vision_tower.embeddings.position_embeddings": np.zeros((1, 50, 16),
                                                                                np.float32)})  # fmt: skip
    with pytest.raises(load.LoadError, match=r"position_embeddings: shape \(1, 50, 16\)"):
        load.load_checkpoint(copy_with(tmp_path / "b", wrong))
    with open(os.path.join(FOLDER, "config.json")) as f:
        raw = json.load(f)
    for change, message in (
        ({"model_type": "internvl_chat"}, "original OpenGVLab layout"),
        ({"downsample_ratio": 0.25}, "downsample_ratio = 0.25"),
        ({"vision_feature_layer": -2}, "vision_feature_layer = -2"),
        ({"vision_config": {**raw["vision_config"], "use_qk_norm": True}}, "use_qk_norm"),
        ({"text_config": {**raw["text_config"], "model_type": "qwen3"}}, "'qwen3' is not supported"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            from_hf({**raw, **change})
    with pytest.raises(ValueError, match="not a folder"):
        load.load_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="they tile differently"):
        proc = processor.load_processor(FOLDER, config)
        encode.encode(proc, [os.path.join(HERE, "batch0.png"), os.path.join(HERE, "tiled0.png")],
                      ["Is it?", "Is it?"])  # fmt: skip


def test_processor_config_layouts(tmp_path):
    """The Hub's flat preprocessor_config.json reads as transformers 5's nested
    processor_config.json does; the reference's default tiles."""
    with open(os.path.join(FOLDER, "processor_config.json")) as f:
        nested = json.load(f)
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "preprocessor_config.json").write_text(json.dumps(nested["image_processor"]))
    want = processor.image_settings(FOLDER)
    assert processor.image_settings(str(flat)) == want
    assert want.size == 56 and want.tiles and want.max_tiles == 12 and want.resize == "torchvision"


def test_internvl3_2b_parameters():
    """InternVL3-2B-hf's config (InternViT-300M at 448 px, Qwen2.5-1.5B with InternVL's
    151,674 tokens, an untied unembedding): 2,088,957,440 parameters, 4,177,914,880
    bytes in bfloat16, counted from the config's shapes (notes: what was checked)."""
    c = from_hf(INTERNVL3_2B_HF)
    assert params.n_params(c) == 2_088_957_440 and params.n_params(c) * 2 == 4_177_914_880
    assert c.table_side == 32 and c.lm_head_dim == 128 and c.proj_width == 4096
    names = load.key_map(c)
    assert names["vision_tower.embeddings.position_embeddings#1"][1] == (1, 1025, 1024)
    assert "lm_head.weight" in names


def test_init_params_match_the_loaded_layout(checkpoint):
    config, p, _ = checkpoint
    fresh = params.init_params(config, jax.random.PRNGKey(0))
    shape = lambda t: jax.tree_util.tree_map(lambda a: tuple(a.shape), t)  # noqa: E731
    assert shape(fresh) == shape(p) == params.param_shapes(config)


# InternVL3-2B-hf's config.json, its architecture fields (from the converter's
# InternVLConfig of OpenGVLab/InternVL3-2B: InternViT-300M-448px-V2_5 and Qwen2.5-1.5B)
INTERNVL3_2B_HF = {
    "model_type": "internvl",
    "downsample_ratio": 0.5,
    "image_token_id": 151667,
    "image_seq_length": 256,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151674, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"factor": 2.0, "rope_type": "dynamic", "type": "dynamic"},
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    "vision_config": {
        "model_type": "internvl_vision", "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": [448, 448],
        "patch_size": [14, 14], "attention_bias": True, "use_qk_norm": False,
        "norm_type": "layer_norm", "layer_norm_eps": 1e-6, "hidden_act": "gelu",
    },
}  # fmt: skip
