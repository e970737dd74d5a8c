"""What is Gemma-3's own (`families.gemma3`), on the tiny random fixtures the reference
wrote (`tests/fixtures/gemma3/make_fixtures.py`; the contract test holds the family to
the reference's processor and forward): the sliding window and the image blocks'
bidirectional attention each matter, the masks by hand, the pooling projector, the
bfloat16 folder, the config's two layouts and refusals, the real gemma-3-4b-it's size,
the position edits on SigLIP's learned table, the resumed forward, greedy generation,
`experiments.ask` and the paper 003 / 004 reports through `--checkpoint`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quiet

import jaxmech
from jaxmech.config import ConfigError
from jaxmech.families.gemma3 import config as gconfig
from jaxmech.families.gemma3 import load, model, params, positions, processor
from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.models.edits import Edits

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma3")
FOLDER = os.path.join(HERE, "gemma3")
T5 = os.path.join(HERE, "gemma3_t5")


def _questions(ref):
    return [t.split("<start_of_turn>user\n")[1].replace("<start_of_image>", "")
            .split("<end_of_turn>")[0] for t in ref["prompt"]]  # fmt: skip


@pytest.fixture(scope="module")
def batch():
    """(model, encoded batch case, its reference outputs) of the float32 Hub folder."""
    m = jaxmech.load(FOLDER)
    ref = dict(np.load(os.path.join(FOLDER, "reference.npz")))
    ref = {k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith("batch/")}
    images = [os.path.join(HERE, f"batch{i}.png") for i in range(2)]
    return m, m.encode(images, _questions(ref)), ref


def _logit_gap(logits, ref, valid):
    return float(np.abs(np.asarray(logits, np.float32)[valid] - ref["logits"][valid]).max())


def test_the_window_and_the_image_blocks_matter(batch):
    """The reference's logits (5e-6 here) are not those of a mask without the sliding
    window (every layer global: 8.0 off) nor of one without the image tokens'
    bidirectional block (the reference without token_type_ids: 6.4 off)."""
    m, enc, ref = batch
    x, c, valid = enc.inputs, m.config, np.asarray(enc.inputs.valid_BxS)

    def run(params, inputs):
        everywhere = dataclasses.replace(c, lm_window=10**6)
        return (model.forward(params, inputs, config=c)[0],
                model.forward(params, inputs, config=everywhere)[0],
                model.forward(params, inputs, config=c, bidirectional=False)[0])  # fmt: skip

    plain, everywhere, causal = jax.jit(run)(m.params, x)
    assert _logit_gap(plain, ref, valid) < 1e-4
    assert _logit_gap(everywhere, ref, valid) > 1.0
    assert _logit_gap(causal, ref, valid) > 1.0


def test_masks_by_hand():
    """Ten tokens, image tokens at 3..8, window 3: a sliding layer's token sees itself,
    the W - 1 = 2 tokens before it and every later token of its image; a global layer's
    sees every earlier token and its whole image; padding is seen by no other token."""
    c = Gemma3Config(lm_window=3)
    valid = np.ones((1, 10), bool)
    valid[0, 0] = False
    masks = model.lm_masks(valid, np.arange(3, 9)[None], c)
    full, sliding = (np.asarray(masks[k][0]) for k in ("full_attention", "sliding_attention"))
    seen = lambda mask, q: np.flatnonzero(mask[q]).tolist()  # noqa: E731
    assert seen(sliding, 4) == [2, 3, 4, 5, 6, 7, 8]
    assert seen(sliding, 8) == [6, 7, 8] and seen(sliding, 9) == [7, 8, 9]
    assert seen(full, 3) == list(range(1, 9)) and seen(full, 9) == list(range(1, 10))
    assert seen(full, 2) == [1, 2] and seen(full, 0) == [0]  # a padding row: itself only
    causal = model.lm_masks(valid, np.arange(3, 9)[None], c, bidirectional=False)
    assert seen(np.asarray(causal["sliding_attention"][0]), 4) == [2, 3, 4]


def test_the_projector_pools_then_norms_then_projects(batch):
    """proj/pooled is the mean of each 2 x 2 square of the 8 x 8 patches after
    post_layernorm, row-major on the 4 x 4 token grid; proj/out is Gemma's RMSNorm (x
    (1 + w), eps of the ViT) of it times W [E, D]."""
    m, enc, _ = batch
    c = m.config
    sites = ("vit/final", "proj/pooled", "proj/out")
    aux = jax.jit(lambda p, x: model.forward(p, x, config=c, capture=sites)[1])(
        m.params, enc.inputs
    )
    v = np.asarray(aux["vit/final"], np.float64).reshape(2, 8, 8, -1)
    pooled = v.reshape(2, 4, 2, 4, 2, -1).mean((2, 4)).reshape(2, 16, -1)
    np.testing.assert_allclose(aux["proj/pooled"], pooled, atol=1e-6)
    p = jax.tree_util.tree_map(np.asarray, m.params["proj"])
    normed = pooled / np.sqrt((pooled**2).mean(-1, keepdims=True) + c.vit_eps)
    want = (normed * (1 + p["norm_w"])) @ p["W"]
    np.testing.assert_allclose(aux["proj/out"], want, atol=1e-5)
    assert positions.pooled_patches(c)[5].tolist() == [18, 19, 26, 27]  # token (1, 1)


def test_the_bfloat16_folder_loads_within_its_bound():
    """The transformers-5 folder (bfloat16, two shards) loaded in bfloat16 gives logits
    within 0.2 of the float32 reference's (seen 0.13; |logits| <= 8.9), and in float32
    the reference's within 1e-4."""
    ref = np.load(os.path.join(T5, "reference.npz"))
    for dtype, bound in ((jnp.float32, 1e-4), (jnp.bfloat16, 0.2)):
        m = jaxmech.load(T5, dtype=dtype)
        images = [os.path.join(HERE, f"batch{i}.png") for i in range(2)]
        enc = m.encode(images, _questions({"prompt": ref["batch/prompt"]}))
        valid = np.asarray(enc.inputs.valid_BxS)
        forward = jax.jit(lambda p, x: model.forward(p, x, config=m.config)[0])  # noqa: B023
        logits = forward(m.params, enc.inputs)
        got = _logit_gap(logits, {"logits": ref["batch/logits"]}, valid)
        assert got < bound, (dtype, got)


def test_the_two_config_layouts_read_alike():
    """The Hub's sparse config.json (sliding_window_pattern, rope_scaling,
    rope_local_base_freq) and transformers 5's (layer_types, rope_parameters per layer
    type) give one config: layers sliding, sliding, global; the global rotary linear x 8."""
    with open(os.path.join(FOLDER, "config.json")) as f:
        hub = gconfig.from_hf(json.load(f))
    with open(os.path.join(T5, "config.json")) as f:
        t5 = gconfig.from_hf(json.load(f))
    assert dataclasses.replace(t5, dtype="float32") == hub
    assert hub.lm_layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert (hub.lm_global_factor, hub.lm_global_theta, hub.lm_local_theta) == (8.0, 1e6, 1e4)
    assert (hub.lm_window, hub.lm_query_scale, hub.pool, hub.token_grid) == (6, 12.0, 2, 4)


def test_config_errors():
    with open(os.path.join(FOLDER, "config.json")) as f:
        raw = json.load(f)
    text = raw["text_config"]
    bad = {
        "rope type 'yarn'": raw | {"text_config": text | {"rope_scaling": {"rope_type": "yarn"}}},
        "use_bidirectional_attention": raw | {"text_config": text | {
            "use_bidirectional_attention": True}},
        "vision_use_head": raw | {"vision_config": raw["vision_config"] | {
            "vision_use_head": True}},
        "mm_tokens": raw | {"mm_tokens_per_image": 9},
        "model_type = 'gemma3_text'": {"model_type": "gemma3_text"},
    }  # fmt: skip
    for message, r in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            gconfig.from_hf(r)


def test_processor_refusals(tmp_path):
    """Pan-and-scan turned on, or a size other than the ViT's, are refused naming the
    file; a token id that disagrees with config.json names both."""
    c = jaxmech.load(FOLDER).config
    folder = str(tmp_path / "g")
    shutil.copytree(FOLDER, folder)
    path = os.path.join(folder, "preprocessor_config.json")
    with open(path) as f:
        pre = json.load(f)
    for change, message in (({"do_pan_and_scan": True}, "do_pan_and_scan"),
                            ({"size": {"height": 28, "width": 28}}, "images become 28 x 28")):  # fmt: skip
        with open(path, "w") as f:
            json.dump(pre | change, f)
        with pytest.raises(ValueError, match=message):
            processor.load_processor(folder, c)
    with open(path, "w") as f:
        json.dump(pre, f)
    with pytest.raises(ValueError, match="image_token_index = 3"):
        processor.load_processor(folder, dataclasses.replace(c, image_token_id=3))


def test_a_gemma_tokenizer_reads_as_the_reference_reads_it():
    """The Hub's Gemma tokenizer.json layout (byte-fallback BPE, " " -> "▁") read as it is
    stored gives the ids transformers 5's GemmaTokenizer (which rebuilds the pipeline)
    gives, for chat prompts with image tokens and for the answer words."""
    from jaxmech.data.inputs import prompts

    folder = os.path.join(HERE, "gemma_tokenizer")
    with open(os.path.join(folder, "reference.json")) as f:
        ref = json.load(f)
    assert ref["class"] == "GemmaTokenizer"
    tok, _ = prompts.read_tokenizer(folder)
    rows = prompts.token_rows(tok, ref["texts"], 0)
    for row, valid, want in zip(rows.tokens_BxS, rows.valid_BxS, ref["ids"]):
        assert row[valid].tolist() == want
    for word, want in ref["words"].items():
        assert tok.encode(word, add_special_tokens=False).ids == want


def test_gemma_3_4b_it_parameters():
    """google/gemma-3-4b-it's config.json (sparse: the class defaults fill the rest):
    4,300,079,472 parameters in 883 tensors, 8,600,158,944 bytes in bfloat16 (what the
    reference's Gemma3ForConditionalGeneration, built from this dict on the meta device,
    counts; lm_head tied, not stored). 34 LM layers, 5 of them global (5:1)."""
    c = gconfig.from_hf(GEMMA_3_4B_IT)
    assert (c.vit_depth, c.vit_width, c.grid, c.pool, c.mm_tokens) == (27, 1152, 64, 4, 256)
    assert (c.lm_layers, c.lm_width, c.lm_heads, c.lm_kv_heads, c.lm_head_dim) == (
        34, 2560, 8, 4, 256)  # fmt: skip
    assert c.lm_layer_types.count("full_attention") == 5 and c.lm_window == 1024
    assert (c.lm_query_scale, c.lm_global_factor, c.lm_vocab) == (256.0, 8.0, 262_208)
    assert params.n_params(c) == 4_300_079_472 and len(load.key_map(c)) == 883


def test_the_authors_steering_window_for_gemma_3_4b(tmp_path):
    """A folder with gemma-3-4b-it's config.json is their `gemma-4b`: layers 10:22."""
    from jaxmech.reports.steering import AUTHORS_WINDOWS, checkpoint_identity

    with open(tmp_path / "config.json", "w") as f:
        json.dump(GEMMA_3_4B_IT, f)
    identity = checkpoint_identity(str(tmp_path))
    assert identity == ("gemma3", 34, 2560)
    assert AUTHORS_WINDOWS[identity] == ("gemma-4b", "google/gemma-3-4b-it", (10, 22))


GEMMA_3_4B_IT = {  # google/gemma-3-4b-it config.json (transformers 4.50 wrote it)
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}  # fmt: skip


def test_position_edits_on_the_learned_table(batch):
    """`Edits.vit_cols` = g - 1 - col is the run with the table's columns reversed (bit
    for bit); a half-cell shift (col + 0.5) is a new code that moves the logits."""
    m, enc, _ = batch
    g = m.config.grid
    rows, cols = positions.patch_grid(g)
    plain = np.asarray(m.forward(enc.inputs)[0])
    mirrored = np.asarray(m.forward(enc.inputs, edits=Edits(vit_cols=g - 1 - cols))[0])
    p = jax.tree_util.tree_map(lambda a: a, m.params)
    p["vit"] = dict(p["vit"], pos=p["vit"]["pos"].reshape(g, g, -1)[:, ::-1].reshape(g * g, -1))
    np.testing.assert_array_equal(np.asarray(dataclasses.replace(m, params=p).forward(
        enc.inputs)[0]), mirrored)  # fmt: skip
    half = np.asarray(m.forward(enc.inputs, edits=Edits(vit_cols=np.minimum(cols + 0.5, g - 1)))[0])
    assert np.abs(half - plain).max() > 1e-3 and np.abs(mirrored - plain).max() > 1e-3


def test_a_resumed_run_equals_the_full_one():
    """The view's `forward_from` (the LM resumed at block 1 from the rows after the
    image, the rows before read from the run's key / value cache, the sliding and
    global masks cut alike) gives the full run's answer logits."""
    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.families.vlm_view import examples

    m = jaxmech.load(FOLDER)
    view = m.view(Grid(2, 2), 56)
    specs = pair_questions(view.grid, 2, view.n_labels, view.n_colours, seed=1)
    ex = examples(view, specs["examples"])
    start = int(np.asarray(ex.spans.image_BxI).max()) + 1

    def run():
        logits, aux = view.forward(m.params, ex.inputs, capture=view.cache_sites + (
            "lm/resid_pre.1",))  # fmt: skip
        x = aux["lm/resid_pre.1"][:, start:]
        return logits, view.forward_from(m.params, ex.inputs, 1, start, x, aux)

    full, resumed = jax.jit(run)()
    np.testing.assert_allclose(resumed, full, atol=1e-5)


def test_generate_equals_the_reference(batch):
    """Greedy `generate` (Gemma-3's own step: `Decoding.step`) token for token and each
    step's logits within 1e-4 as the reference's `generate(do_sample=False)` on the
    left-padded batch (53-token prompts, window 6: every new token's sliding layers cut
    the cache); the prefill with the image block, the steps without, as the reference."""
    m, enc, _ = batch
    ref = np.load(os.path.join(FOLDER, "generate_reference.npz"))
    np.testing.assert_array_equal(enc.inputs.tokens_BxS, ref["batch/input_ids"])
    out = m.generate(enc, max_new_tokens=8, eos_token_id=int(ref["batch/eos"]),
                     pad_token_id=int(ref["batch/pad"]), logits=True)  # fmt: skip
    np.testing.assert_array_equal(out.tokens_BxN, ref["batch/tokens"])
    np.testing.assert_allclose(out.logits_BxNxV, ref["batch/logits"], atol=1e-4, rtol=1e-4)


def test_ask_answers(capsys):
    from experiments import ask

    for folder in (FOLDER, T5):
        try:
            ask.FLAGS([ask.__file__, f"--checkpoint={folder}", "--top=3", "--dtype=bfloat16",
                       f"--image={os.path.join(HERE, 'single0.png')}",
                       "--question=Is the red circle above or below the blue square?"])  # fmt: skip
            ask.main([])
        finally:
            ask.FLAGS.unparse_flags()
        out = capsys.readouterr().out
        assert "gemma3, 3 LM blocks (1 global, window 6), 8 x 8 patches pooled to 16" in out
        assert len(re.findall(r"^\s+[123]\s+0\.\d+", out, re.M)) == 3


def test_the_view_renders_on_the_pooled_token_grid():
    """Drawn scenes through the view: the 16 image tokens on the 4 x 4 pooled grid, a
    2 x 2 scene grid's cells 2 x 2 tokens each, the object words found, the 1-D ids as
    [B, 3, S]; SigLIP's positions are the 8 x 8 patch grid's (entering once), the
    position basis each token's 2 x 2 patches' table rows; bad views refused by name."""
    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.families.gemma3.view import checkpoint_view
    from jaxmech.families.vlm_view import examples

    m = jaxmech.load(FOLDER)
    view = m.view(Grid(2, 2), 56)
    specs = pair_questions(view.grid, 2, view.n_labels, view.n_colours, seed=1)
    ex = examples(view, specs["examples"])
    tokens = np.asarray(ex.inputs.tokens_BxS)
    assert (tokens[:, np.asarray(ex.spans.image_BxI)[0]] == m.config.image_token_id).all()
    np.testing.assert_array_equal(np.asarray(ex.spans.cell_I).reshape(4, 4),
                                  [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]])  # fmt: skip
    assert np.asarray(ex.spans.image_trc_Ix3)[5].tolist() == [0, 1, 1]
    ids = view.lm_position_ids(m.params, ex.spans)
    np.testing.assert_array_equal(ids[:, 0], np.asarray(ex.inputs.pos_BxS))
    rows, cols, extent = view.vit_positions(m.params)
    assert extent == (8, 8) and view.vit_blocks(m.params) == 0 and len(rows) == 64
    basis = np.asarray(view.position_basis(m.params))
    pos = np.asarray(m.params["vit"]["pos"])
    assert basis.shape == (16, 4 * 32)
    np.testing.assert_array_equal(basis[5], pos[[18, 19, 26, 27]].reshape(-1))
    with pytest.raises(ValueError, match="size = 112: the processor makes every picture 56"):
        checkpoint_view(FOLDER, m.config, Grid(2, 2), 112)
    with pytest.raises(ValueError, match="grid = 3 x 3: must divide the 4 x 4 image tokens"):
        checkpoint_view(FOLDER, m.config, Grid(3, 3))
    with pytest.raises(ValueError, match="video = True"):
        checkpoint_view(FOLDER, m.config, Grid(2, 2), video=True)


def _run(protocol="jaxmech", layers=(1,)):
    """The fixture as `--checkpoint` opens it: 2 x 2 cells at 56 px, 2 questions per
    relation, one LM layer."""
    from jaxmech.reports.common import open_checkpoint

    return open_checkpoint(FOLDER, grid=(2, 2), size=56, questions=2, batch=8, layers=layers,
                           protocol=protocol, log=quiet)  # fmt: skip


def test_the_counterfactual_report_runs_on_gemma3(tmp_path):
    """Paper 004's counterfactual table through `--checkpoint`'s path: the plain run is
    the model's, and on the learned table the half-cell shift moves the answer margins."""
    from jaxmech.reports import counterfactuals
    from jaxmech.reports.common import analyse_subject

    cf = analyse_subject(counterfactuals.REPORT, _run(), str(tmp_path), log=quiet)
    rows = {(r["counterfactual"], r["relation"]): r for r in cf["tables"]["table"]}
    assert rows[("plain", "horizontal")]["changed"] == 0.0
    m, names = np.asarray(cf["res"]["margins"])[0], list(cf["res"]["names"])
    assert np.abs(m[names.index("vit_half")] - m[names.index("plain")]).min() > 1e-5
    assert os.path.isfile(os.path.join(str(tmp_path), "counterfactuals", "summary.json"))


@pytest.mark.slow
def test_paper_003_004_reports_run_on_gemma3(tmp_path):
    """The patching (authors' protocol), spatial-ID, steering and diagnostics reports
    with `--checkpoint` on the fixture; the temporal-ID report is not the family's."""
    from jaxmech.families.gemma3.family import FAMILY
    from jaxmech.reports import diagnostics, patching, spatial_ids, steering
    from jaxmech.reports.common import analyse_subject

    out = str(tmp_path)
    assert "temporal_ids" not in FAMILY.reports
    pat = analyse_subject(patching.REPORT, _run("authors"), out, log=quiet)
    assert np.isfinite(pat["res"]["shifts"][("mirror", "both", "logp", "mean")]).all()
    ids = analyse_subject(spatial_ids.REPORT, _run(), out, log=quiet)
    assert any(np.isfinite(r["r2"]) for r in ids["tables"]["r2"])
    analyse_subject(steering.REPORT, _run(), out, log=quiet)
    analyse_subject(diagnostics.REPORT, _run("authors", (2,)), out, log=quiet)
    for folder in ("patching", "spatial_ids", "steering", "diagnostics"):
        assert os.path.isfile(os.path.join(out, folder, "summary.json")), folder
