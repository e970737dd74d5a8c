"""What is Llama-3.2-Vision's (`families.mllama`) own, on the tiny fixtures the reference
wrote (`tests/fixtures/mllama/make_fixtures.py`; the forward's equality with the
reference on every stored case is `tests/test_checkpoint_contract.py`'s): the tanh
gates, the cross-attention mask over tiles and the full-text-row mask, the text-only
forward, the tiled processor's canvas, the bfloat16 folder, the view sequence that
puts the image's cross-attention states beside the text (what patching's "image" group
means here), `experiments.ask`, the real size, and every paper 003 / 004 report through
`--checkpoint` (slow)."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np
import pytest
from conftest import quiet

import jaxmech
from jaxmech.data.spec import Grid, pair_questions
from jaxmech.families.mllama import model as mllama_model
from jaxmech.families.mllama import params as mllama_params
from jaxmech.families.mllama import positions, processor, view
from jaxmech.families.mllama.config import MllamaConfig
from jaxmech.families.vlm_view import examples
from jaxmech.models.edits import Edits

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "mllama")
FOLDER = os.path.join(HERE, "mllama")
CROSS = 2  # the fixture's cross-attention layer
BF16_BOUND = 0.05  # bfloat16 weights (and products) vs the float32 reference (seen 0.022)


@pytest.fixture(scope="module")
def model():
    return jaxmech.load(FOLDER)


@pytest.fixture(scope="module")
def batch(model):
    ref = np.load(os.path.join(FOLDER, "reference.npz"))
    qs = [t.split("<|image|>")[1].split("<|eot_id|>")[0] for t in ref["batch/prompt"]]
    return model.encode([os.path.join(HERE, f"batch{i}.png") for i in range(2)], qs), ref


def test_tanh_gates_scale_their_branches(model, batch):
    """Each gate multiplies its branch by tanh(gate): the cross-attention layer's
    attention and MLP, the global layer's, the tile and position embeddings'. A gate at
    0 removes its branch (the cross-attention layer becomes the identity)."""
    enc, _ = batch
    p, x = model.params, enc.inputs
    names = [f"lm/attn_out.{CROSS}", f"lm/mlp_out.{CROSS}", f"lm/resid_pre.{CROSS}",
             f"lm/resid_post.{CROSS}", "vit_global/attn_out.0", "vit_global/mlp_out.0"]  # fmt: skip

    def run(block_gates, vit_gates):
        q = jax.tree_util.tree_map(lambda a: a, p)  # new dicts, the same arrays
        q["lm"][f"block_{CROSS}"] |= block_gates
        q["vit"]["global_block_0"] |= vit_gates
        return _forward(model, q, x, names)

    blk, g = p["lm"][f"block_{CROSS}"], p["vit"]["global_block_0"]
    plain = run({}, {})
    half_lm = run({"attn_gate": blk["attn_gate"] / 2, "mlp_gate": blk["mlp_gate"] / 2}, {})
    half_vit = run({}, {"gate_attn": g["gate_attn"] / 2, "gate_ffn": g["gate_ffn"] / 2})
    for site, gate, half in ((f"lm/attn_out.{CROSS}", blk["attn_gate"], half_lm),
                             ("vit_global/attn_out.0", g["gate_attn"], half_vit)):  # fmt: skip
        ratio = np.tanh(float(gate[0]) / 2) / np.tanh(float(gate[0]))
        np.testing.assert_allclose(half[site], plain[site] * ratio, rtol=1e-4, atol=1e-6)
    off = run({"attn_gate": 0 * blk["attn_gate"], "mlp_gate": 0 * blk["mlp_gate"]}, {})
    np.testing.assert_array_equal(off[f"lm/resid_post.{CROSS}"], off[f"lm/resid_pre.{CROSS}"])
    assert np.abs(plain[f"lm/resid_post.{CROSS}"] - plain[f"lm/resid_pre.{CROSS}"]).max() > 1e-3
    # the position gate mixes the learned table and the tile table
    for gate in ("pos_gate", "pre_tile_gate", "post_tile_gate"):
        q = jax.tree_util.tree_map(lambda a: a, p)
        q["vit"][gate] = 0 * p["vit"][gate]
        moved = _forward(model, q, x, ["proj/out"])["proj/out"]
        assert np.abs(moved - _forward(model, p, x, ["proj/out"])["proj/out"]).max() > 1e-4, gate


_JITTED: dict = {}


def _forward(model, params, x, names):
    """The captured `names` of `model`'s forward with `params`: one compiled program per
    capture list (eager, each run dispatched op by op: ~2x the time)."""
    key = (id(model), tuple(names))
    if key not in _JITTED:
        f = lambda p, x: dataclasses.replace(model, params=p).forward(x, capture=list(key[1]))[1]  # noqa: E731
        _JITTED[key] = jax.jit(f)
    return _JITTED[key](params, x)


def test_the_cross_attention_mask_over_tiles(model, batch):
    """Row 1 of the batch has one tile of four: from its `<|image|>` token on, a token
    reads tile 0's 17 states only; before it (no tile allowed) it reads every state,
    padded tiles included, unmasked (the reference's), and its MLP branch is zeroed (the
    full-text-row mask). Row 0's image has all four tiles."""
    enc, ref = batch
    x = enc.inputs
    _, aux = model.forward(x, capture=[f"lm/pattern.{CROSS}", f"lm/mlp_out.{CROSS}"])
    pattern = np.asarray(aux[f"lm/pattern.{CROSS}"])  # [B, H, S, I]
    mlp = np.asarray(aux[f"lm/mlp_out.{CROSS}"])
    per_tile = model.config.n_patches + 1
    xattn = ref["batch/cross_attention_mask"][:, :, 0].astype(bool)
    np.testing.assert_array_equal(np.asarray(x.xattn_BxSxT), xattn)
    image_at = np.asarray(x.image_BxI)[:, 0]
    for b in range(2):
        after, before = slice(image_at[b], None), slice(0, image_at[b])
        tiles = xattn[b, image_at[b]]
        on = np.repeat(tiles, per_tile)
        assert (pattern[b][:, after][..., ~on] == 0).all()
        np.testing.assert_allclose(pattern[b][:, after][..., on].sum(-1), 1, rtol=1e-5)
        assert (pattern[b][:, before] > 0).all()  # every state, padded tiles included
        assert (mlp[b, before] == 0).all() and np.abs(mlp[b, after]).max() > 1e-4
    assert xattn[1, image_at[1]].tolist() == [True, False, False, False]


def test_a_text_only_batch_skips_the_cross_attention_layers(model):
    """Without an image the cross-attention layer is the identity (the reference skips
    it) and the text-only forward equals the reference's (also in the contract test);
    the same question with an image differs after that layer only."""
    ref = np.load(os.path.join(FOLDER, "reference.npz"))
    qs = [t.split("<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0] for t in ref["text/prompt"]]
    enc = processor.encode_text(model.processor, qs)
    logits, aux = model.forward(enc.inputs, capture=True)
    np.testing.assert_array_equal(aux[f"lm/resid_post.{CROSS}"], aux[f"lm/resid_pre.{CROSS}"])
    assert aux[f"lm/vision.{CROSS}"].shape == (2, 0, model.config.lm_width)
    valid = np.asarray(enc.inputs.valid_BxS)
    np.testing.assert_allclose(np.asarray(logits)[valid], ref["text/logits"][valid], atol=1e-4)


def test_the_processor_tiles_as_the_reference(model):
    """The canvas and resize of each fixture image (35 x 70: resized to 28 x 56, 1 x 2
    tiles, id 2; 45 x 30: 2 x 2 tiles, id 6; 20 x 25: one tile, enlarged to 22 x 28 (each
    side clipped to at least the tile first), then padded),
    and a squashed one-tile photograph; refusals name the argument."""
    s = model.processor.images
    assert processor.canvas(35, 70, s) == (1, 2) and processor.fitted(35, 70, 1, 2, 28) == (28, 56)
    assert processor.canvas(45, 30, s) == (2, 2) and processor.canvas(20, 25, s) == (1, 1)
    assert processor.fitted(20, 25, 1, 1, 28) == (22, 28)
    one = processor.encode(model.processor, [os.path.join(HERE, "single0.png")], ["Is it?"],
                           one_tile=True)  # fmt: skip
    assert one.n_tiles == [1] and int(one.inputs.aspect_B[0]) == 1
    with pytest.raises(ValueError, match=re.escape("questions: expected 1 <|image|> token")):
        model.encode([os.path.join(HERE, "single0.png")], ["a <|image|> here"])
    with pytest.raises(ValueError, match="resume: not supported by mllama"):
        mllama_model.forward(model.params, one.inputs, config=model.config, resume=object())


def test_the_bfloat16_folder_is_within_its_bound():
    """transformers 5's bfloat16 save loaded in bfloat16 (weights and products): the
    logits within `BF16_BOUND` of the float32 reference on the stored weights."""
    folder = os.path.join(HERE, "mllama_t5")
    m = jaxmech.load(folder, dtype="bfloat16")
    ref = np.load(os.path.join(folder, "reference.npz"))
    qs = [t.split("<|image|>")[1].split("<|eot_id|>")[0] for t in ref["batch/prompt"]]
    enc = m.encode([os.path.join(HERE, f"batch{i}.png") for i in range(2)], qs)
    logits = np.asarray(m.forward(enc.inputs)[0], np.float32)
    valid = np.asarray(enc.inputs.valid_BxS)
    assert np.abs(logits - ref["batch/logits"])[valid].max() < BF16_BOUND


def test_the_view_sequence_puts_the_image_states_before_the_text(model):
    """The view's `lm/resid_pre.{y}` is [the cross-attention states read from y on;
    the text]: its vision slots are `proj/out` in slot order; a replace there at a
    layer after the last cross-attention layer changes nothing, before it the answer;
    the whole sequence taken from the mirror twin gives the twin's logits (patching's
    "all" group), and the image group is the image's patch slots, last before the text."""
    c, p = model.config, model.params
    v = view.checkpoint_view(FOLDER, c, Grid(2, 2))
    specs = pair_questions(v.grid, 2, v.n_labels, v.n_colours, seed=1)
    ex = examples(v, specs["examples"])
    twin = v.render(specs["mirror"], ask=specs["examples"])[0]
    sites = [f"lm/resid_pre.{y}" for y in range(c.lm_layers)]
    logits, aux = v.forward(p, ex.inputs, capture=sites)
    t_logits, t_aux = v.forward(p, twin, capture=sites)
    I, S = c.n_vision_tokens, ex.inputs.tokens_BxS.shape[1]  # noqa: E741
    assert aux["lm/resid_pre.0"].shape == (2, I + S, c.lm_width)
    _, m_aux = model.forward(ex.inputs, capture=["proj/out"])
    np.testing.assert_array_equal(aux["lm/resid_pre.0"][:, :I],
                                  m_aux["proj/out"][:, view.slot_order(c)])  # fmt: skip
    image = np.asarray(ex.spans.image_BxI)[0]
    assert image.tolist() == list(range(I - c.n_patches, I))
    assert int(ex.spans.x_B.min()) >= I and int(ex.spans.answer_B[0]) == I + S - 1
    for y, moves in ((CROSS, True), (CROSS + 1, False)):
        name = f"lm/resid_pre.{y}"
        mixed = np.concatenate([t_aux[name][:, :I], aux[name][:, I:]], 1)
        patched = v.forward(p, ex.inputs, Edits(replace={name: (True, mixed)}))[0]
        assert (np.abs(patched - logits).max() > 1e-5) == moves, y
    for y in range(c.lm_layers):
        name = f"lm/resid_pre.{y}"
        whole = v.forward(p, ex.inputs, Edits(replace={name: (True, t_aux[name])}))[0]
        np.testing.assert_allclose(whole, t_logits, atol=1e-5)
    ids = v.lm_position_ids(p, ex.spans)
    np.testing.assert_array_equal(ids[:, 0, I:], np.asarray(ex.inputs.pos_BxS))


def test_the_real_size():
    """Llama-3.2-11B-Vision-Instruct's sizes (transformers 5.25's `MllamaVisionConfig` /
    `MllamaTextConfig` defaults, with the published 560 px tiles; nothing downloaded):
    10,670,220,835 parameters, the count the reference's model built on the meta device
    from the same config gives (and REFERENCE.md 1e's), so
    21.3 GB of bfloat16 weights: more than a 24 GB machine's default budget (9.4 GB),
    and with the runtime beside them more than the machine (BUILD_NOTES)."""
    c = MllamaConfig(vit_depth=32, vit_global_depth=8, vit_width=1280, vit_heads=16,
                     vit_mlp=5120, image_size=560, patch_size=14, max_tiles=4,
                     intermediate=(3, 7, 15, 23, 30), lm_vocab=128256, lm_width=4096,
                     lm_layers=40, lm_heads=32, lm_kv_heads=8, lm_mlp=14336,
                     lm_rope_llama3=(8.0, 1.0, 4.0, 8192.0),
                     cross_layers=(3, 8, 13, 18, 23, 28, 33, 38), image_token_id=128256)  # fmt: skip
    assert c.vision_dim == 7680 and c.n_vision_tokens == 4 * 1601 and c.tile_rows == 1608
    n = mllama_params.n_params(c)
    assert n == 10_670_220_835
    assert 2 * n / 2**30 > 19.8  # GiB of bfloat16 weights alone


def test_ask_answers(capsys):
    from experiments import ask

    image = os.path.join(HERE, "single0.png")
    for folder, extra in ((FOLDER, []), (os.path.join(HERE, "mllama_t5"), ["--dtype=bfloat16"])):
        try:
            ask.FLAGS([ask.__file__, f"--checkpoint={folder}", f"--image={image}", "--top=3",
                       "--question=Is the red circle above or below the blue square?", *extra])  # fmt: skip
            ask.main([])
        finally:
            ask.FLAGS.unparse_flags()
        out = capsys.readouterr().out
        assert "mllama, 4 LM layers (1 cross-attention), 4 tiles of 4 x 4 patches: tiles [2]" in out
        assert len(re.findall(r"^\s+[123]\s+0\.\d+", out, re.M)) == 3


@pytest.mark.slow  # ~65 s of compiles
def test_paper_003_004_reports_run_on_mllama(tmp_path):
    """Patching (authors' protocol), counterfactuals, spatial IDs, steering and
    diagnostics through `--checkpoint`'s path on the fixture. Patching at layer 1
    (before the cross-attention layer): the image group moves the belief, the text
    groups do not (the text has not read the image yet), "all" gives the twin's. The
    authors' "text" group also holds the image's last two slots
    (`questions.authors_groups`), so it moves too."""
    from jaxmech.reports import counterfactuals, diagnostics, patching, spatial_ids, steering
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    def run(protocol="jaxmech", layers=(1,)):
        return open_checkpoint(FOLDER, grid=(2, 2), size=28, questions=2, batch=8,
                               layers=layers, protocol=protocol, log=quiet)  # fmt: skip

    out = str(tmp_path)
    pat = analyse_subject(patching.REPORT, run("authors"), out, log=quiet)
    shift = np.asarray(pat["res"]["shifts"][("mirror", "both", "logp", "mean")])[0, 0]
    from jaxmech.analysis.patching import GROUPS

    text_only = [GROUPS.index(g) for g in ("question", "objects", "last")]
    assert abs(shift[-1] - 1) < 1e-2 and shift[0] > 0.1
    assert (np.abs(shift[text_only]) < 1e-6).all() and abs(shift[GROUPS.index("text")]) > 1e-3
    analyse_subject(counterfactuals.REPORT, run(), out, log=quiet)
    analyse_subject(spatial_ids.REPORT, run(), out, log=quiet)
    analyse_subject(steering.REPORT, run(), out, log=quiet)
    analyse_subject(diagnostics.REPORT, run("authors", (2,)), out, log=quiet)
    for folder in ("patching", "counterfactuals", "spatial_ids", "steering", "diagnostics"):
        assert os.path.isfile(os.path.join(out, folder, "summary.json")), folder


def test_the_position_mirror_reads_both_tables_mirrored(model, batch):
    """`Edits.vit_cols` = g - 1 - col (paper 004's width mirror on a learned table) is
    the run with both per-patch tables' columns reversed in every tile (the CLS row
    kept), exactly; a half-cell shift is a new code (it moves the vision states)."""
    enc, _ = batch
    c, p, x = model.config, model.params, enc.inputs
    g = c.grid
    rows, cols = positions.patch_grid(g)
    mirrored = model.forward(x, edits=Edits(vit_cols=g - 1 - cols), capture=["proj/out"])[1]

    def flip(table):  # [..., 1 + g g, E]: the patch rows' columns reversed
        t = np.asarray(table)
        grid = t[..., 1:, :].reshape(t.shape[:-2] + (g, g, t.shape[-1]))[..., ::-1, :]
        return np.concatenate([t[..., :1, :], grid.reshape(t[..., 1:, :].shape)], -2)

    q = jax.tree_util.tree_map(lambda a: a, p)
    q["vit"]["pos"], q["vit"]["tile_pos"] = flip(p["vit"]["pos"]), flip(p["vit"]["tile_pos"])
    np.testing.assert_allclose(mirrored["proj/out"], _forward(model, q, x, ["proj/out"])["proj/out"],
                               atol=1e-6)  # fmt: skip
    plain = model.forward(x, capture=["proj/out"])[1]["proj/out"]
    half = model.forward(x, edits=Edits(vit_cols=cols + 0.5), capture=["proj/out"])[1]["proj/out"]
    assert np.abs(half - plain).max() > 1e-4


def test_layouts_and_refusals_by_name():
    """Every key layout maps to one canonical name; config.json fields the family does
    not reproduce are refused by name."""
    import json

    from jaxmech.config import ConfigError
    from jaxmech.families.mllama import config as mllama_config
    from jaxmech.families.mllama import load

    for stored in ("vision_model.", "model.vision_model."):
        assert load.canonical(stored + "class_embedding") == "vision.class_embedding"
    for stored in ("language_model.model.", "model.language_model."):
        assert load.canonical(stored + "norm.weight") == "lm.norm.weight"
    assert load.canonical("lm_head.weight") == load.canonical("language_model.lm_head.weight")
    with open(os.path.join(FOLDER, "config.json")) as f:
        raw = json.load(f)
    bad = {
        "rope type 'dynamic'": {"text_config": raw["text_config"] | {"rope_parameters": {
            "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}},
        "supported_aspect_ratios": {"vision_config": raw["vision_config"] | {
            "supported_aspect_ratios": [[1, 1], [1, 2]]}},
        "vision_output_dim = 64": {"vision_config": raw["vision_config"] | {
            "vision_output_dim": 64}},
        "model_type = 'llava'": {"model_type": "llava"},
    }  # fmt: skip
    for message, change in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            mllama_config.from_hf(raw | change)
