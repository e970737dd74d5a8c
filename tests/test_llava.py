"""The LLaVA-1.5 family's own behaviour on its fixtures
(`tests/fixtures/llava/make_fixtures.py`: two tiny random checkpoints written by Hugging
Face transformers 5.25 in llava-hf's Hub layout and in transformers 5's): its position
edits on the learned table, the refusals particular to it, the legacy Llama tokenizer,
its loader's and config's errors, the crop / pad geometry, and LLaVA-1.5-7B's size.
Processor and forward equal to the reference, the sites, no-op edits and the refusals
every family shares: the contract test, `tests/test_checkpoint_contract.py`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.config import ConfigError
from jaxmech.families import load_checkpoint
from jaxmech.families.llava import load, model, params, positions, processor
from jaxmech.families.llava.config import from_hf
from jaxmech.models.edits import Edits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "llava")


@functools.lru_cache(maxsize=None)
def checkpoint(name):
    folder = os.path.join(FIXTURES, name)
    _, config, p = load_checkpoint(folder)
    proc = processor.load_processor(folder, config)
    return config, p, proc, np.load(os.path.join(folder, "reference.npz"))


def encoded(proc, ref, case):
    """The case's batch through our processor, its questions read off the reference's
    chat prompts."""
    qs = [t.split("USER: ")[1].replace("<image>\n", "").rsplit(" ASSISTANT:", 1)[0]
          for t in ref[f"{case}/prompt"]]  # fmt: skip
    if case == "text":
        return processor.encode_text(proc, qs), qs
    images = [os.path.join(FIXTURES, f"{case}{i}.png") for i in range(len(qs))]
    return processor.encode(proc, images, qs), qs


def test_table_reads_by_hand():
    """The table read at integer positions is its rows exactly; a mirror is a column
    permutation; half a cell is the mean of two neighbours; past the edge is clamped."""
    g, E = 3, 2
    table = jnp.asarray(np.random.default_rng(0).normal(size=(1 + g * g, E)), jnp.float32)
    grid = np.asarray(table[1:]).reshape(g, g, E)
    rows, cols = positions.patch_grid(g)
    np.testing.assert_array_equal(positions.table_at(table, rows, cols), table[1:])
    mirrored = positions.table_at(table, rows, g - 1 - cols)
    np.testing.assert_array_equal(np.asarray(mirrored).reshape(g, g, E), grid[:, ::-1])
    half = np.asarray(positions.table_at(table, rows, cols + 0.5)).reshape(g, g, E)
    np.testing.assert_allclose(half[:, :2], (grid[:, :2] + grid[:, 1:]) / 2, rtol=1e-6)
    np.testing.assert_array_equal(half[:, 2], grid[:, 2])  # clamped at the last column


def test_position_edits_act():
    """The width mirror of the table's columns, applied twice, is the plain run exactly;
    once it changes the logits, as the LM's ids and the image order do; the half-cell
    shift (the table interpolated) changes them too, where under rotary positions a
    uniform shift cancels (`test_qwen2_vl_view`). (One program: the edits vmapped, each
    the identity but for one field; the identity edits are the plain run: the contract
    test.)"""
    config, p, proc, ref = checkpoint("llava")
    enc, _ = encoded(proc, ref, "batch")
    x = enc.inputs
    rows, cols = (a.astype(np.float32) for a in positions.patch_grid(config.grid))
    W, S = config.grid, x.tokens_BxS.shape[1]
    ids = np.repeat(np.asarray(x.pos_BxS)[:, None], 3, 1)
    order = np.arange(config.n_patches)
    same = dict(vit_rows=rows, vit_cols=cols, lm_pos_ids=ids, image_order=order)
    changes = [{}, {"vit_cols": W - 1 - (W - 1 - cols)}, {"vit_cols": W - 1 - cols},
               {"vit_rows": rows + 0.5}, {"vit_cols": cols + 0.5},
               {"lm_pos_ids": np.broadcast_to(ids[:1] + 1, ids.shape)},  # row 0's for both
               {"image_order": order[::-1].copy()}]  # fmt: skip
    edits = jax.tree_util.tree_map(lambda *a: np.stack(a), *[Edits(**same | c) for c in changes])
    last = lambda p, x, e: model.forward(p, x, e, config=config, rows=[S - 1] * 2)[0]  # noqa: E731
    plain, twice, *outs = np.asarray(jax.jit(jax.vmap(last, (None, None, 0)))(p, x, edits))
    np.testing.assert_array_equal(twice, plain)
    for out in outs:
        assert np.abs(out - plain).max() > 1e-4


def test_edit_errors():
    """What LLaVA refuses beyond the contract's refusals: a rotary site in its ViT (it
    has none), per-block ViT positions (they enter once), LM ids whose three rows differ
    (1-D rotary), a patch count off the grid, a resume past the last block."""
    config, p, proc, ref = checkpoint("llava")
    enc, _ = encoded(proc, ref, "single")
    x, S = enc.inputs, enc.inputs.tokens_BxS.shape[1]
    bad = {
        "vit/rot_q.0": Edits(add={"vit/rot_q.0": 0.0}),  # no rotary in the ViT
        "Edits.vit_cols: shape": Edits(vit_cols=np.zeros((2, 16))),
        "Edits.lm_pos_ids: the (t, row, col) rows differ": Edits(
            lm_pos_ids=np.stack([np.arange(S), np.arange(S), np.zeros(S)])),
    }  # fmt: skip
    for message, edits in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            model.forward(p, x, edits, config=config)
    with pytest.raises(ValueError, match="pixels_BxPxF: 5 patches"):
        model.forward(p, x._replace(pixels_BxPxF=x.pixels_BxPxF[:, :5]), config=config)
    with pytest.raises(ValueError, match="Resume.layer = 7"):
        model.forward(p, x, config=config, resume=model.Resume(7, 1, np.zeros((1, 3, 32)), {}))


def test_a_llama_tokenizer_reads_as_the_reference_reads_it():
    """A tokenizer.json in llava-hf's legacy Llama layout, read as transformers 5 reads it
    (its LlamaTokenizer rebuilds the pipeline): the chat prompts' ids (with and without
    image tokens) and the answer words' equal the reference's; the file as it is would
    put a "▁" after the image tokens."""
    from tokenizers import Tokenizer

    from jaxmech.data.inputs.prompts import token_rows

    folder = os.path.join(FIXTURES, "llama_tokenizer")
    with open(os.path.join(folder, "reference.json")) as f:
        ref = json.load(f)
    tok = processor.load_tokenizer(folder)
    for text, ids in zip(ref["texts"], ref["ids"]):
        assert token_rows(tok, [text], 0, add_special_tokens=True).tokens_BxS[0].tolist() == ids
    for word, ids in ref["words"].items():
        assert tok.encode(word, add_special_tokens=False).ids == ids
    raw = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert raw.encode(ref["texts"][0]).ids != ref["ids"][0]


def test_llava_1_5_7b_parameters():
    """llava-hf/llava-1.5-7b-hf's config.json (sparse: the class defaults fill the LM and
    the ViT's activation): 7,063,427,072 stored parameters (what the reference's
    LlavaForConditionalGeneration counts from it; a third-party count of the loaded
    checkpoint says the same), 14,126,854,144 bytes in float16, of which the forward
    reads all but the ViT's 2,048 post_layernorm parameters."""
    c = from_hf(LLAVA_1_5_7B)
    vit = (c.vit_depth, c.vit_width, c.grid, c.n_patches, c.vit_act)
    assert vit == (24, 1024, 24, 576, "quick_gelu")
    lm = (c.lm_layers, c.lm_width, c.lm_heads, c.lm_kv_heads, c.lm_mlp)
    assert lm == (32, 4096, 32, 32, 11008)
    assert (c.lm_eps, c.lm_rope_theta, c.lm_vocab, c.feature_block) == (1e-5, 10000.0, 32064, 23)
    assert params.n_stored(c) == 7_063_427_072 and params.n_stored(c) * 2 == 14_126_854_144
    assert params.n_params(c) == params.n_stored(c) - 2048
    names = load.key_map(c)
    assert "lm_head.weight" in names and len(names) + len(load.UNUSED) == 686  # the reference's
    assert load.canonical("language_model.model.layers.0.mlp.up_proj.weight") in names


LLAVA_1_5_7B = {  # llava-hf/llava-1.5-7b-hf config.json (transformers 4.36 wrote it)
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100,
    "image_token_index": 32000, "model_type": "llava", "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                      "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}  # fmt: skip


def test_config_errors():
    for change, field in (({"vision_feature_select_strategy": "full"}, "select_strategy"),
                          ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer"),
                          ({"model_type": "llava_next"}, "model_type"),
                          ({"text_config": {"model_type": "mistral"}}, "model_type = 'mistral'"),
                          ({"text_config": {"rope_scaling": {"type": "linear", "factor": 2}}},
                           "rope type 'linear'")):  # fmt: skip
        with pytest.raises(ConfigError, match=field):
            from_hf(LLAVA_1_5_7B | change)


def test_key_layouts_load_alike(tmp_path):
    """Every name layout met (llava-hf's Hub names, transformers 5's saves, its in-memory
    names with and without `vision_model`) loads the same params (the unused
    post_layernorm accepted in each)."""
    from safetensors.numpy import load_file, save_file

    src = os.path.join(FIXTURES, "llava")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    _, want = load.load_checkpoint(src)
    for old, new in (("vision_tower.vision_model.", "model.vision_tower."),
                     ("vision_tower.vision_model.", "model.vision_tower.vision_model."),
                     ("language_model.model.", "model.language_model."),
                     ("language_model.lm_head.", "lm_head."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):  # fmt: skip
        folder = tmp_path / new.strip(".")
        shutil.copytree(src, folder)
        renamed = {new + k[len(old) :] if k.startswith(old) else k: v for k, v in tensors.items()}
        save_file(renamed, str(folder / "model.safetensors"))
        _, got = load.load_checkpoint(str(folder))
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(a, b)


def test_bad_tensors_and_folders(tmp_path):
    from safetensors.numpy import load_file, save_file

    src = os.path.join(FIXTURES, "llava")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    pos = "vision_tower.vision_model.embeddings.position_embedding.weight"
    cases = {
        "missing tensor vision.embeddings.position_embedding.weight":
            {k: v for k, v in tensors.items() if k != pos},
        f"tensor {pos}: shape \\(16, 32\\) in the file, expected \\(17, 32\\)":
            tensors | {pos: tensors[pos][1:]},
        "unexpected tensor vision_tower.vision_model.extra": tensors | {
            "vision_tower.vision_model.extra": np.zeros(2, np.float32)},
    }  # fmt: skip
    for message, stored in cases.items():
        folder = tmp_path / str(len(os.listdir(tmp_path)))
        shutil.copytree(src, folder)
        save_file(stored, str(folder / "model.safetensors"))
        with pytest.raises(load.LoadError, match=message):
            load.load_checkpoint(str(folder))
    with pytest.raises(load.LoadError, match="no config.json"):
        load.load_checkpoint(str(tmp_path))
    config = load.read_config(src)
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        processor.load_processor(str(empty), config)
    for name, value in (("resize", "lanczos"), ("square", "stretch")):
        with pytest.raises(ValueError, match=f"{name} = '{value}'"):
            processor.load_processor(src, config, **{name: value})
    small = tmp_path / "small_crop"
    shutil.copytree(src, small)
    pre = small / "preprocessor_config.json"
    pre.write_text(
        json.dumps(json.loads(pre.read_text()) | {"crop_size": {"height": 21, "width": 21}})
    )
    with pytest.raises(ValueError, match="images become 21 x 21 px, config.json's ViT reads 28"):
        processor.load_processor(str(small), config)


def test_crop_and_pad_geometry_maps_boxes():
    """A 40 x 60 photograph under the reference's processor at 28 px: resized to 28 x 42,
    7 columns cut each side, so the processed image shows columns 10..50 of the
    photograph; a box centred in a cut side has no cell. Padded to a square instead,
    the window is the whole 60 x 60 square around it. The processed pixels are the
    window's: the centre column of the photograph lands at the image's centre."""
    from jaxmech.data.datasets.questions import ImageQuestion
    from jaxmech.reports.batches import box_cells, framed

    crop = processor.ImageSettings(shortest_edge=28, crop=(28, 28))
    f = processor.frame(40, 60, crop)
    assert (f.resized, f.top, f.left, f.out) == ((28, 42), 0, 7, (28, 28))
    np.testing.assert_allclose(f.window(), (0.0, 10.0, 40.0, 40.0))
    pad = crop._replace(square="pad")
    np.testing.assert_allclose(processor.frame(40, 60, pad).window(), (-10.0, 0.0, 60.0, 60.0))
    # a white photograph with a black column at x = 30: centred in the processed image
    x = np.full((40, 60, 3), 255, np.uint8)
    x[:, 29:31] = 0
    out = processor.processed(x, crop)
    assert out.shape == (28, 28, 3) and out[:, 13:15].mean() < out.mean() - 50
    padded = processor.processed(x, pad)  # the mean colour above and below
    np.testing.assert_array_equal(padded[0, 0], [122, 116, 104])
    _, config, _ = load_checkpoint(os.path.join(FIXTURES, "llava"))
    from jaxmech.data.spec import Grid
    from jaxmech.families.llava.view import checkpoint_view

    view = checkpoint_view(os.path.join(FIXTURES, "llava"), config, Grid(2, 2))
    q = ImageQuestion("x.png", None, ("left", "right"), ("cup", "dog"), "left",
                      ([11, 2, 6, 6], [1, 30, 6, 6]), "m:1")  # fmt: skip
    moved, size = framed(view, q, (40, 60))
    assert size == (40.0, 40.0) and moved.boxes[0] == [1.0, 2.0, 6, 6] and moved.boxes[1] is None
    np.testing.assert_array_equal(box_cells(view, moved, size), [0, -1])  # Y's centre cut off
    np.testing.assert_array_equal(box_cells(view, q, (40, 60)), [0, 2])  # without the frame
