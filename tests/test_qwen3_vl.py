"""The Qwen3-VL variant of the Qwen-VL family on its fixture
(`tests/fixtures/qwen3_vl/make_fixtures.py`: a tiny random checkpoint written by Hugging
Face transformers 5.25 with DeepStack at two ViT blocks, a 6 x 6 position table,
interleaved M-RoPE and q / k norms): its two ViT position mechanisms as edits and
counterfactuals, the DeepStack injection's two sides, a run resumed inside the image,
its loader, and the 4B's parameter list. Processor and forward equal to the reference
(images, a video, text only), the sites, no-op edits and refusals: the contract test,
`tests/test_checkpoint_contract.py`."""

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

from jaxmech.analysis import counterfactuals as cfa
from jaxmech.analysis.patching import GROUPS, patch_logp, resume_plan, token_groups
from jaxmech.config import ConfigError
from jaxmech.data.spec import Grid, pair_questions
from jaxmech.families import load_checkpoint
from jaxmech.families.qwen2_vl import load, model, params, positions, processor
from jaxmech.families.qwen2_vl import view as view_module
from jaxmech.families.qwen2_vl.config import from_hf
from jaxmech.families.qwen2_vl.view import checkpoint_view, default_size
from jaxmech.families.vlm_view import examples, model_outline
from jaxmech.models.decoder import RESUME_SITES
from jaxmech.models.edits import Edits

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_vl")
FOLDER = os.path.join(HERE, "qwen3_vl")
REF = np.load(os.path.join(FOLDER, "reference.npz"))
quiet = lambda *_: None  # noqa: E731


@functools.lru_cache(maxsize=None)
def loaded(dtype=jnp.float32):
    _, config, p = load_checkpoint(FOLDER, dtype=dtype)
    return config, p, processor.load_processor(FOLDER, config, resize="pil")  # written by PIL


def questions(case):
    """The questions in the reference's prompts."""
    return [t.split("<|vision_end|>")[-1].split("<|im_end|>")[0].strip()
            for t in REF[f"{case}/prompt"]]  # fmt: skip


@functools.lru_cache(maxsize=None)
def encoded(case):
    """An image case of the reference through the processor."""
    images = [os.path.join(HERE, f"{case}{i}.png") for i in range(len(REF[f"{case}/prompt"]))]
    return processor.encode(loaded()[2], images, questions(case))


@functools.lru_cache(maxsize=None)
def run(case):
    config, p, _ = loaded()
    logits, aux = jax.jit(functools.partial(model.forward, config=config, capture=True))(
        p, encoded(case).inputs
    )
    return np.asarray(logits), jax.device_get(aux)


def test_deepstack_sites_name_both_sides_of_the_injection():
    """resid_post.{i} is before DeepStack feature i is added, resid_post_stack.{i} and
    resid_pre.{i + 1} after (equal); they differ at the image tokens only, and only
    for the first len(vit_deepstack) blocks. An edit at resid_post.0 is carried through
    the injection, one at resid_post_stack.0 replaces the sum."""
    config, p, _ = loaded()
    _, aux = run("single")
    x = encoded("single").inputs
    image = np.zeros(x.tokens_BxS.shape, bool)
    image[0, x.image_BxI[0]] = True
    for i in range(config.lm_layers - 1):
        before, after = aux[f"lm/resid_post.{i}"], aux[f"lm/resid_pre.{i + 1}"]
        moved = np.abs(after - before).max(-1) > 1e-3
        if i < len(config.vit_deepstack):
            np.testing.assert_array_equal(aux[f"lm/resid_post_stack.{i}"], after)
            np.testing.assert_array_equal(moved, image)
        else:
            np.testing.assert_array_equal(after, before)
    carried, replaced, _, _ = edited_runs()  # resid_pre.1 after zeros at either side
    ds = aux["vit/deepstack.0"][0]
    np.testing.assert_allclose(np.asarray(carried)[0, x.image_BxI[0]], ds, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(replaced), 0.0)


@functools.lru_cache(maxsize=None)
def edited_runs():
    """One program (the suite's time), on the single image: resid_pre.1 with zeros in
    place of resid_post.0, then of resid_post_stack.0, and the last row's logits of the
    plain run and of a run resumed at block 0 from the image's fourth token
    (`model.Resume`)."""
    config, p, _ = loaded()
    x = encoded("single").inputs

    def runs():
        plain, aux = model.forward(p, x, config=config, capture=("lm/resid_post_stack.0",))
        zero = jnp.zeros_like(aux["lm/resid_post_stack.0"])
        cut = [
            Edits(replace={site: (True, zero)})
            for site in ("lm/resid_post.0", "lm/resid_post_stack.0")
        ]
        after = [model.forward(p, x, e, config=config, capture=["lm/resid_pre.1"])[1] for e in cut]
        # resumed at block 0 from the middle of the image: DeepStack is added to the
        # image rows after it only, the rows before read from the run's own cache
        _, cache = model.forward(p, x, config=config, capture=("lm/resid_pre.0", *RESUME_SITES))
        s0 = int(x.image_BxI[0, 3])
        resume = model.Resume(0, s0, cache["lm/resid_pre.0"][:, s0:], cache)
        resumed = model.forward(p, x, config=config, resume=resume)[0]
        return *(a["lm/resid_pre.1"] for a in after), plain[:, -1], resumed[:, -1]

    return jax.device_get(jax.jit(runs)())


def test_a_run_resumed_inside_the_image_equals_the_plain_one():
    """A run resumed inside the image gives the plain run's last logits (to float
    rounding; DeepStack added to the resumed rows only: `edited_runs`); a [blocks, P]
    position edit is refused: with a table it is [1 + blocks, P]."""
    config, p, _ = loaded()
    _, _, plain, resumed = edited_runs()
    np.testing.assert_allclose(resumed, plain, atol=1e-5)
    x = encoded("single").inputs
    with pytest.raises(
        ValueError, match=r"vit_cols: shape \(3, 24\), expected \(24,\) or \(4, 24\)"
    ):
        model.forward(p, x, Edits(vit_cols=np.zeros((3, 24))), config=config)


@pytest.fixture(scope="module")
def scenes():
    """The fixture's view of 2 x 2 scenes at 128 px (8 x 8 patches: the 6 x 6 table is
    resampled), four left/right questions, and their counterfactual edits."""
    config, p, _ = loaded()
    view = checkpoint_view(FOLDER, config, Grid(2, 2), 128)
    specs = pair_questions(view.grid, 4, view.n_labels, view.n_colours, seed=1, relation=0)
    ex = examples(view, specs["examples"])
    names = ("plain", "vit_w", "vit_w_table", "vit_w_rotary", "vit_w@1", "vit_half",
             "vit_half_table", "lm_ids_w")  # fmt: skip
    return config, p, view, specs, ex, names, cfa.build(view, p, ex.spans, names)


def test_the_counterfactuals_mirror_each_mechanism(scenes):
    """With a position table the ViT's positions are [1 + blocks, P] (the table's row
    first): `vit_w` mirrors both mechanisms, `_table` / `_rotary` one, `@1` block 1's
    rotary; the table's half-cell shift moves the answer margins where a uniform rotary
    shift cancels (Qwen2-VL's `vit_half` is a no-op); mirrors applied twice are the
    plain run exactly, in the ViT and in the LM's ids."""
    config, p, view, specs, ex, names, cfs = scenes
    assert set(cfa.TABLE_CHANGES) <= set(cfa.names_for(view, p))
    pick = {
        n: jax.tree_util.tree_map(lambda a, i=i: np.asarray(a[i]), cfs) for i, n in enumerate(names)
    }
    cols, W = pick["plain"].vit_cols, 8
    assert cols.shape == (1 + config.vit_depth, 64)
    mirrored = {n: (pick[n].vit_cols != cols).any(1).tolist() for n in names}
    assert mirrored["vit_w"] == [True] * 4 and mirrored["vit_w_table"] == [True] + [False] * 3
    assert mirrored["vit_w_rotary"] == [False] + [True] * 3
    assert mirrored["vit_w@1"] == [False, False, True, False]
    np.testing.assert_array_equal(pick["vit_w"].vit_cols, W - 1 - cols)

    def margins(cf_list):
        stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *cf_list)
        versions = jax.tree_util.tree_map(lambda a: a[None], ex.inputs)
        return cfa.margins(view, p, versions, ex.answer_B, ex.other_B, stacked)

    twice = pick["plain"]._replace(vit_cols=W - 1 - pick["vit_w"].vit_cols)
    ids = pick["lm_ids_w"].lm_ids  # [B, 3, S]: the rows are left-padded
    assert ids.ndim == 3
    perm = cfa.token_mirrors(ex.spans)["w"]
    ids_twice = ids.copy()
    for row, img in zip(ids_twice, np.asarray(ex.spans.image_BxI)):
        row[:, img] = row[:, img[perm]]  # the LM ids' width mirror again
    twice_lm = pick["plain"]._replace(lm_ids=ids_twice)
    rotary_half = pick["plain"]._replace(vit_cols=np.concatenate([cols[:1], cols[1:] + 0.5]))
    m = np.asarray(jax.jit(margins)([pick[n] for n in names] + [twice, twice_lm, rotary_half]))
    plain = m[0]
    np.testing.assert_array_equal(m[len(names)], plain)  # the width mirror twice
    np.testing.assert_array_equal(m[len(names) + 1], plain)  # the LM's ids mirrored twice
    np.testing.assert_allclose(m[len(names) + 2], plain, atol=1e-4)  # rotary shift cancels
    for n in names[1:]:
        assert np.abs(m[names.index(n)] - plain).max() > 1e-4, n  # float noise: ~1e-6
    assert np.abs(m[names.index("vit_w_table")] - m[names.index("vit_w_rotary")]).max() > 1e-4
    np.testing.assert_allclose(
        m[names.index("vit_half")], m[names.index("vit_half_table")], atol=1e-4
    )


def test_patches_resumed_between_the_injections_equal_full_ones(scenes):
    """The view's resumed patches (`forward_from`) equal whole forwards at LM site 1
    (before DeepStack's second injection: the rows before the patch are rerun from the
    patched residual, not read from the twin's cache, whose later blocks saw the twin's
    features), for the object words and every token. ~10 s: one program of the plain,
    twin and 2 x 2 patched runs (a resumed one reruns the ViT). (After the injections the cache serves, as
    in Qwen2-VL's test; a `Resume` from a run of the same inputs: `edited_runs`.)"""
    config, p, view, specs, ex, names, cfs = scenes
    mirror = view.render(specs["mirror"], ask=specs["examples"])[0]
    groups = token_groups(ex.spans)[[GROUPS.index("objects"), GROUPS.index("all")]]
    plan = resume_plan(view, groups, np.asarray(ex.spans.image_BxI)[:, 0])
    assert plan[0][0] > np.asarray(ex.spans.image_BxI).max()  # after the image: resumed late

    def patch(v, plan):
        return patch_logp(v, p, ex.inputs, mirror, groups, ex.answer_B, ex.other_B, (1,),
                          plan=plan)  # fmt: skip

    got, full = jax.jit(
        lambda: (patch(view, plan), patch(view._replace(forward_from=None), None))
    )()
    np.testing.assert_allclose(got["patched"], full["patched"], atol=1e-5)
    # every token patched before an injection: the example's own DeepStack feature 1
    # still enters, so the answer is not the twin's
    assert np.abs(full["patched"][0, 1] - full["twin"]).max() > 1e-4


def test_interleaved_mrope_and_the_table_taps_by_hand():
    """The 4B's [24, 20, 20]: h on pairs 1, 4, ..., 58, w on 2, 5, ..., 59, t on the rest
    (0, 3, ..., 57 and 60..63); the table read at linspace(0, n - 1, h)[row], mirrored
    rows reading the mirrored cells, half a patch between them, the border clamped; the
    position basis holds the rotary features and each token's weight on the cells."""
    taps = jax.jit(positions.table_taps, static_argnums=3)
    axis = positions.mrope_axes([24, 20, 20], interleaved=True)
    assert np.flatnonzero(axis == 1).tolist() == list(range(1, 60, 3))
    assert np.flatnonzero(axis == 2).tolist() == list(range(2, 60, 3))
    assert np.flatnonzero(axis == 0).tolist() == list(range(0, 60, 3)) + [60, 61, 62, 63]
    assert positions.mrope_axes([2, 3, 3]).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    rows = np.zeros((1, 4), np.float32)
    index, weight = taps(rows, np.float32([[0, 1, 3, 3.5]]), np.int32([[1, 4]]), 4)
    # columns 0, 1, 3 of 4 map to 0, 1, 3 of 4 cells; 3.5 to 3.5, clamped to cell 3
    np.testing.assert_array_equal(np.asarray(index)[0, :, :2], [[0, 1], [1, 2], [3, 3], [3, 3]])
    np.testing.assert_allclose(np.asarray(weight)[0, :, :2], [[1, 0], [1, 0], [1, 0], [0.5, 0.5]])
    cols = np.float32([[0, 1, 2]])
    index, weight = taps(np.zeros((1, 3)), cols, np.int32([[1, 3]]), 6)
    back, back_w = taps(np.zeros((1, 3)), 2 - cols[:, ::-1], np.int32([[1, 3]]), 6)
    basis = np.asarray(view_module.position_basis(loaded()[0], (1, 8, 8)))
    assert basis.shape == (16, 4 * 2 * 4 + 36)  # 4 patches x cos, sin of 4 pairs; 6 x 6
    np.testing.assert_allclose(basis[:, -36:].sum(1), 4.0, rtol=1e-6)
    src = (np.asarray(index)[0, :, :2] * np.asarray(weight)[0, :, :2]).sum(1)  # 0, 2.5, 5
    np.testing.assert_allclose(src, [0, 2.5, 5])
    np.testing.assert_allclose((np.asarray(back)[0, :, :2] * np.asarray(back_w)[0, :, :2]).sum(1),
                               5 - src[::-1])  # fmt: skip


def test_video_view_ids_and_sizes():
    """A video view's LM ids (each frame's block its own image ids, the timestamps'
    text between them counting on) equal the processor's; frame sizes the video
    processor would resize (its budget counts the frames) are refused by name."""
    config, p, _ = loaded()
    view = checkpoint_view(FOLDER, config, Grid(2, 2), 128, video=True)
    specs = pair_questions(view.grid, 2, view.n_labels, view.n_colours, seed=2, relation=1)
    inputs, spans = view.render(specs["examples"])
    np.testing.assert_array_equal(view.lm_position_ids(p, spans), np.asarray(inputs.pos_Bx3xS))
    assert (np.asarray(inputs.tokens_BxS) == config.vision_start_token_id).sum(1).tolist() == [2, 2]
    with pytest.raises(ValueError, match="size = 192: the video processor would resize"):
        checkpoint_view(FOLDER, config, Grid(3, 3), 192, video=True)
    with pytest.raises(ValueError, match="size = 448: must be a multiple of 32 x the grid's 4"):
        checkpoint_view(FOLDER, config, Grid(4, 4), 448)  # Qwen2-VL's default: 16 px patches
    # no --size: the family's default, whole tokens per cell (Qwen2-VL's 448, here 512)
    proc = view.render.args[0]
    assert default_size(proc, Grid(4, 4)) == 512
    assert default_size(proc, Grid(2, 2), video=True) == 448
    proc14 = proc._replace(images=proc.images._replace(patch_size=14))
    assert default_size(proc14, Grid(4, 4)) == 448 and default_size(proc14, Grid(3, 3)) == 504


def copy_with(tmp_path, tensors: dict, config_edit=None, dtype=np.float32) -> str:
    """The fixture's folder with its weights replaced by `tensors` (one file)."""
    out = tmp_path / "ckpt"
    shutil.copytree(FOLDER, out, ignore=shutil.ignore_patterns("model*", "reference.npz"))
    save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(out / "model.safetensors"))
    if config_edit:
        raw = json.loads((out / "config.json").read_text())
        config_edit(raw)
        (out / "config.json").write_text(json.dumps(raw))
    return str(out)


def test_loader_dtypes_untied_and_errors(tmp_path):
    """A float16 copy loads to the rounded weights; an untied copy reads lm_head as W_U;
    a missing or misshapen tensor and a bad config field are errors naming them."""
    s = load.Stored(load.weight_files(FOLDER))
    tensors = {e[3]: np.asarray(s.array(k), np.float32) for k, e in s.entries.items()}
    config, want, _ = loaded()
    _, _, got = load_checkpoint(copy_with(tmp_path, tensors, dtype=np.float16))
    assert got["vit"]["pos_table"].dtype == jnp.float32
    w1 = np.asarray(want["deepstack"]["merger_1"]["W1"], np.float16)
    np.testing.assert_array_equal(got["deepstack"]["merger_1"]["W1"], w1)
    head = np.random.default_rng(0).normal(size=(config.lm_vocab, config.lm_width))
    untie = lambda raw: raw.update(tie_word_embeddings=False)  # noqa: E731
    shutil.rmtree(tmp_path / "ckpt")
    c2, p2 = load.load_checkpoint(copy_with(tmp_path, tensors | {"lm_head.weight": head}, untie))
    assert not c2.tie_embeddings
    np.testing.assert_allclose(p2["lm"]["W_U"], head.T.astype(np.float32))
    shutil.rmtree(tmp_path / "ckpt")
    broken = dict(tensors)
    del broken["model.visual.deepstack_merger_list.1.norm.bias"]
    broken["model.language_model.layers.0.self_attn.q_norm.weight"] = np.zeros(5, np.float32)
    with pytest.raises(
        load.LoadError, match="missing tensor visual.deepstack_merger_list.1.norm.bias"
    ):
        load.load_checkpoint(copy_with(tmp_path, broken))
    shutil.rmtree(tmp_path / "ckpt")
    broken = tensors | {"model.visual.deepstack_merger_list.1.norm.bias": np.zeros(5, np.float32)}
    with pytest.raises(
        load.LoadError, match=r"norm.bias: shape \(5,\) in the file, expected \(64,\)"
    ):
        load.load_checkpoint(copy_with(tmp_path, broken))
    raw = json.loads(open(os.path.join(FOLDER, "config.json")).read())
    raw["vision_config"]["deepstack_visual_indexes"] = [0, 3]
    with pytest.raises(ConfigError, match="vit_deepstack"):
        from_hf(raw)
    raw["vision_config"] |= {"deepstack_visual_indexes": [0], "num_position_embeddings": 30}
    with pytest.raises(ConfigError, match="vit_pos_table"):
        from_hf(raw)


# Qwen/Qwen3-VL-4B-Instruct's config.json (as third-party copies quote it; transformers
# 4.57's layout: rope_scaling and rope_theta in text_config)
QWEN3_VL_4B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
    "text_config": {
        "attention_bias": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
        "intermediate_size": 9728, "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 5000000,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default"},
        "tie_word_embeddings": True, "vocab_size": 151936, "dtype": "bfloat16",
    },
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024, "in_channels": 3, "intermediate_size": 4096, "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 2560, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
}  # fmt: skip


def test_qwen3_vl_4b_parameters():
    """Qwen3-VL-4B-Instruct's config gives the real checkpoint's index: 713 tensors
    (315 under model.visual., 830,695,424 bytes), 4,437,815,808 parameters,
    8,875,631,616 bytes in bfloat16 (its index's total_size), no lm_head (tied)."""
    c = from_hf(QWEN3_VL_4B)
    assert (c.vit_pos_side, c.vit_deepstack, c.lm_head_dim, c.vit_head_dim) == (
        48,
        (5, 11, 17),
        128,
        64,
    )
    assert c.lm_mrope_interleaved and c.tie_embeddings and not c.lm_qkv_bias
    names = {k.split("#")[0] for k in load.key_map(c)}
    shapes = {k.split("#")[0]: v[1] for k, v in load.key_map(c).items()}
    visual = [k for k in names if k.startswith("visual.")]
    assert len(names) == 713 and len(visual) == 315 and "lm_head.weight" not in names
    assert sum(int(np.prod(shapes[k])) for k in visual) * 2 == 830_695_424
    assert params.n_params(c) == 4_437_815_808
    assert sum(int(np.prod(s)) for s in shapes.values()) * 2 == 8_875_631_616


def test_the_counterfactual_report_runs_on_the_fixture(tmp_path):
    """The counterfactual report on the fixture as `--checkpoint` opens it (2 x 2 scenes
    of 128 px, two questions per relation) with `--per_block`: the per-mechanism rows,
    per-block rows and the note that the table's half-cell shift acts (without the
    flag, no per-block row). ~15 s: its table's program (every counterfactual, mapped)
    compiles once. (Every other report: the slow test below.)"""
    from jaxmech.reports import counterfactuals
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    run = open_checkpoint(FOLDER, grid=(2, 2), size=128, questions=2, batch=64, log=quiet,
                          per_block=True)  # fmt: skip
    cf = analyse_subject(counterfactuals.REPORT, run, str(tmp_path), log=quiet)
    assert os.path.isfile(tmp_path / "counterfactuals" / "summary.json")
    rows = {(r["counterfactual"], r["relation"]): r for r in cf["tables"]["table"]}
    assert rows[("plain", "horizontal")]["changed"] == 0.0
    for name in (*cfa.TABLE_CHANGES, "vit_w", "vit_w@2", "vit_half", "lm_ids_w", "order_w"):
        assert (name, "horizontal") in rows and (name, "vertical") in rows, name
    assert "table's shift acts" in cf["summary"]["notes"]["vit_half"]
    view, first = run.subject.vlm_view, model_outline(run.params)
    default = cfa.names_for(view, first, per_block=False)
    assert not [n for n in default if "@" in n] and set(cfa.TABLE_CHANGES) <= set(default)


@pytest.mark.slow
def test_every_paper_003_004_report_runs_on_the_fixture(tmp_path):
    """Every other paper 003 / 004 report (and `experiments.ask`'s calls) on the fixture
    as `--checkpoint` opens it (2 x 2 scenes of 128 px, two questions per relation, LM
    layer 1: a site between the DeepStack injections): patching, spatial IDs, steering,
    diagnostics on pictures (the authors' protocol: every question counts), temporal
    IDs on videos, the ID-loss fine-tune (two steps: the ViT's MLPs move, the table
    does not); and the bfloat16 forward near the float32 reference's. Slow set
    (minutes: each report compiles its own programs, at XLA's default level there)."""
    import jaxmech
    from jaxmech.reports import diagnostics, patching, spatial_ids, steering, temporal_ids
    from jaxmech.reports import id_finetune as idf
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    def opened(**kw):
        return open_checkpoint(FOLDER, grid=(2, 2), size=128, questions=2, layers=(1,),
                               log=quiet, **kw)  # fmt: skip

    out = str(tmp_path)
    run = opened(protocol="authors")
    results = {r.folder: analyse_subject(r, run, out, log=quiet)
               for r in (patching.REPORT, spatial_ids.REPORT, steering.REPORT,
                         diagnostics.REPORT)}  # fmt: skip
    video = analyse_subject(temporal_ids.REPORT, opened(video=True, batch=64), out, log=quiet)
    for folder in (*results, "temporal_ids"):
        assert os.path.isfile(os.path.join(out, folder, "summary.json")), folder
    assert {r["layer"] for r in results["patching"]["tables"]["shifts"]} == {1}
    assert {r["site"] for r in video["tables"]["ids"]} == {0, 1, 2, 3}
    tuned = idf.run_id_loss(opened(batch=64), os.path.join(out, "ft"), steps=2, lr=1e-2, log=quiet)
    before, after = loaded()[1]["vit"], tuned["params"][1.0]["vit"]  # the last blocks' MLPs
    assert not np.array_equal(before["block_2"]["W_in"], after["block_2"]["W_in"])
    np.testing.assert_array_equal(before["pos_table"], after["pos_table"])
    m = jaxmech.load(FOLDER)
    enc = m.encode([os.path.join(HERE, "single0.png")], questions("single"))
    want = jax.nn.log_softmax(REF["single/logits"][0, -1])
    np.testing.assert_allclose(m.next_token_logprobs(enc)[0], want, atol=1e-4)
    config, p, _ = loaded(jnp.bfloat16)  # norms, rotations, softmax still in float32
    logits, _ = jax.jit(functools.partial(model.forward, config=config))(
        p, encoded("single").inputs
    )
    assert logits.dtype == jnp.bfloat16
    assert 1e-4 < np.abs(np.asarray(logits, np.float32) - REF["single/logits"]).max() < 0.1
