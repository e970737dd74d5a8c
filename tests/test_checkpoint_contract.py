"""The contract every checkpoint family keeps, on each of its fixtures: tiny random
checkpoints the reference (Hugging Face transformers) wrote with its outputs beside them
(`tests/fixtures/*/make_fixtures.py`), opened through the one handle, `jaxmech.load`.

For every registered checkpoint family (`families.registry.FAMILIES`, those with
`checkpoint_types`) and every case its fixtures store:

- the processor's output equals the reference's: the prompts, token ids, mask, pixels
  and position ids / grids where it stores them;
- the forward equals the reference within 1e-4 absolute + 1e-4 relative (float32): the
  logits and the LM's hidden states at the valid rows, and the vision side's stored
  stages (every ViT block, the projector or merger, DeepStack's features);
- a capture of every site holds exactly `model.sites()` (with an image; without one,
  the LM's sites and none the model does not name), and `sites()` has no repeats;
- no-op edits are exact no-ops: zeros added at every site, the last site replaced by
  its own value and the family's identity position / order edits give the plain run's
  logits bit for bit, and a named capture holds those sites only, equal to the plain
  run's;
- every refusal names what it refuses (bad `Edits` fields and sites, inputs of the
  wrong shape, a bare string as `capture`, a processor asked the impossible);
- the params keep their layout: the loaded and the random params have exactly the
  shapes `params.param_shapes` names and `params.n_params` counts the loaded leaves
  (every checkpoint family's package has its `params.py`, `families.hf_vlm`).

A new family is covered by one entry in `FIXTURES` (its fixture folders and how they
store the reference's outputs; a chat-template family with a square patch grid reuses
`chat_encode`, `grid_identity` and `nchw`); a registered checkpoint family without one, or a
`model_type` it reads with no fixture, fails `test_every_checkpoint_family_has_fixtures`
by name. What is particular to one family (DeepStack's two sides, pixel shuffle, tiling,
crop geometry, the position edits' effects) stays in its own test file.

Each fixture is loaded once and each case's forward compiled once (cached per folder);
the no-op edits run in the same program as their case's reference forward.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import json
import os
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import jaxmech
from jaxmech.families.registry import FAMILIES, checkpoint_family
from jaxmech.models import layout
from jaxmech.models.edits import Edits

HERE = os.path.join(os.path.dirname(__file__), "fixtures")
TOL = 1e-4  # the bound in float32 (BUILD_NOTES, "Equal to the reference"); seen <= 2.4e-5


class Fixtures(NamedTuple):
    """How one family's fixture checkpoints store the reference's outputs. Every case
    (`cases`) holds `prompt` (optional), `input_ids`, `attention_mask`, `logits` [B, S,
    V] and `hidden` [L + 1, B, S, D] (entering block 0, leaving blocks 0 .. L - 2 before
    anything is added after them, after the final norm); the rest is the family's."""

    folders: dict  # {folder under tests/fixtures: the case the no-op edits run on}
    encode: Callable  # (model, folder, case, ref) -> encoded: the case through our processor
    processed: Callable  # (model, ref, encoded) -> {what: (ours, the reference's)}
    vision: Callable  # (config, ref) -> {site: the reference's value}, compared as [-1, D]
    identity: Callable  # (model, inputs) -> Edits fields that change nothing
    unexpand: Callable  # an encoded prompt as the reference stores it (image tokens once)
    processor: Callable | None = None  # (folder, config) -> the processor the reference
    # used, where it is not the folder's default


def cases(folder: str) -> dict:
    """{case: {key: array}} from every `*reference.npz` of a fixture folder (keys
    `case/key`; a file without prefixes is the case its name starts with)."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(folder, "*reference.npz"))):
        ref = np.load(path)
        bare = os.path.basename(path).split("_reference")[0]
        for key in ref.files:
            case, _, name = key.rpartition("/")
            out.setdefault(case or bare, {})[name] = ref[key]
    return out


def images(folder: str, case: str, n: int) -> list:
    """The case's images, `{case}{i}.png` beside the fixture checkpoints."""
    return [os.path.join(os.path.dirname(folder), f"{case}{i}.png") for i in range(n)]


def as_levels(levels, settings, n: int):
    """The reference's normalised pixels from its stored 0..255 levels: its arithmetic
    (divide, then subtract the mean, then divide by the std, in float32)."""
    mean, std = np.repeat(np.float32(settings.mean), n), np.repeat(np.float32(settings.std), n)
    return ((levels.astype(np.float64) / 255).astype(np.float32) - mean) / std


def chat_encode(family: str, question):
    """The `Fixtures.encode` of a family whose stored prompts are its chat template
    around one question (`question(prompt)` cuts it out): the case's images and
    questions through the handle, or the family's `encode_text` where no pixels are
    stored."""

    def encode(model, folder, case, ref):
        qs = [question(str(t)) for t in ref["prompt"]]
        if "pixel_values" not in ref:
            processor = importlib.import_module(f"jaxmech.families.{family}.processor")
            return processor.encode_text(model.processor, qs)
        return model.encode(images(folder, case, len(qs)), qs)

    return encode


def grid_identity(family: str):
    """The `Fixtures.identity` of a family with a square patch grid and one LM position
    id per token: the grid's own rows and columns (`positions.patch_grid`), the image
    tokens in order, the LM ids repeated on the three rows."""

    def identity(model, x):
        positions = importlib.import_module(f"jaxmech.families.{family}.positions")
        rows, cols = positions.patch_grid(model.config.grid)
        return dict(vit_rows=rows, vit_cols=cols, image_order=np.arange(x.image_BxI.shape[1]),
                    lm_pos_ids=np.repeat(np.asarray(x.pos_BxS)[:, None], 3, 1))  # fmt: skip

    return identity


def nchw(pixels, config, want) -> tuple:
    """(ours, the reference's): our [B, (T,) P, C p p] pixels as the reference's [B, C, H,
    W] (or [B, 1, T, C, H, W]), `want` that array."""
    g, p = config.grid, config.patch_size
    px = np.asarray(pixels).reshape(-1, g, g, 3, p, p).transpose(0, 3, 1, 4, 2, 5)
    return px.reshape(want.shape), want


# ---- Qwen2-VL, Qwen2.5-VL, Qwen3-VL (families/qwen2_vl) ----------------------------

QWEN2_VIDEO = [  # tests/fixtures/qwen2_vl/make_fixtures.py VIDEO_CASES (not stored)
    "Is the red circle to the left or the right of the blue square? Answer with one word.",
    "Is the blue cross above or below the red triangle? Answer with one word.",
]


def qwen_questions(ref):
    return [t.split("<|vision_end|>")[-1].split("<|im_end|>")[0].strip() for t in ref["prompt"]]


def qwen_encode(model, folder, case, ref):
    from jaxmech.families.qwen2_vl import processor

    proc = model.processor
    if case == "text":
        return processor.encode_text(proc, [str(q) for q in ref["questions"]])
    if case == "video":
        if "frames" in ref:  # Qwen2-VL's: two videos stored, questions as written
            videos, questions = list(ref["frames"]), QWEN2_VIDEO
        else:  # Qwen3-VL's: one video's frames as pictures
            frames = sorted(glob.glob(os.path.join(os.path.dirname(folder), "video0_*.png")))
            videos = [np.stack([np.asarray(Image.open(f)) for f in frames])]
            questions = qwen_questions(ref)
        return processor.encode_video(proc, videos, questions, fps=float(ref["fps"]))
    return model.encode(images(folder, case, len(ref["prompt"])), qwen_questions(ref))


def qwen_processed(model, ref, enc):
    x = enc.inputs
    s = model.processor.videos if enc.video else model.processor.images
    out = {}
    if "rope" in ref:  # (not stored for the text-only prompts)
        out["pos_Bx3xS"] = (x.pos_Bx3xS, ref["rope"].transpose(1, 0, 2))
    if "levels" in ref:
        assert float(ref["levels_err"]) <= 1e-6  # the levels hold the reference's floats
        want = as_levels(ref["levels"], s, s.temporal_patch_size * s.patch_size**2)
        out["pixels_BxPxF"] = (np.asarray(x.pixels_BxPxF).reshape(want.shape), want)
        out["grid"] = ([tuple(enc.grid)] * len(ref["grid"]), [tuple(g) for g in ref["grid"]])
    return out


def qwen_vision(config, ref):
    out = {f"vit/resid_post.{i}": block for i, block in enumerate(ref.get("vit_blocks", ()))}
    out |= {f"vit/deepstack.{k}": d for k, d in enumerate(ref.get("deepstack", ()))}
    return out | ({"merger/out": ref["merged"]} if "merged" in ref else {})


def qwen_identity(model, x):
    n = model.config.vit_depth + bool(model.config.vit_pos_table)  # the table's row first
    rows, cols = (np.asarray(a[0], np.float32) for a in (x.rows_BxP, x.cols_BxP))
    return dict(vit_rows=rows, vit_cols=np.tile(cols, (n, 1)), lm_pos_ids=np.asarray(x.pos_Bx3xS),
                image_order=np.arange(x.image_BxI.shape[1]))  # fmt: skip


def qwen_pil(folder, config):
    from jaxmech.families.qwen2_vl import processor

    return processor.load_processor(folder, config, resize="pil")  # the fixtures' backend


QWEN = Fixtures(
    folders={
        "qwen2_vl/qwen2_vl": "padded",
        "qwen2_vl/qwen2_5_vl": "padded",
        "qwen3_vl/qwen3_vl": "single",
    },
    encode=qwen_encode,
    processed=qwen_processed,
    vision=qwen_vision,
    identity=qwen_identity,
    unexpand=lambda p: re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", p),
    processor=qwen_pil,
)


# ---- LLaVA-1.5 (families/llava) ------------------------------------------------------


def llava_processed(model, ref, enc):
    out = {"pos_BxS": (enc.inputs.pos_BxS, ref["position_ids"])}
    if "pixel_values" in ref:
        out["pixels_BxPxF"] = nchw(enc.inputs.pixels_BxPxF, model.config, ref["pixel_values"])
    return out


def llava_vision(config, ref):
    if "vit_hidden" not in ref:
        return {}
    vit = ref["vit_hidden"]  # entering each block, then the last block's output
    out = {f"vit/resid_pre.{i}": vit[i] for i in range(config.vit_depth)}
    return out | {f"vit/resid_post.{config.vit_depth - 1}": vit[-1], "proj/out": ref["projected"]}


LLAVA = Fixtures(
    folders={"llava/llava": "batch", "llava/llava_t5": "batch"},
    encode=chat_encode(
        "llava", lambda t: t.split("USER: ")[1].replace("<image>\n", "").rsplit(" ASSISTANT:", 1)[0]
    ),
    processed=llava_processed,
    vision=llava_vision,
    identity=grid_identity("llava"),
    unexpand=lambda p: re.sub(r"(<image>)+", "<image>", p),
)


# ---- InternVL3 (families/internvl) ----------------------------------------------------


def internvl_encode(model, folder, case, ref):
    from jaxmech.families.internvl import encode

    proc = model.processor  # at the case's tile size
    proc = proc._replace(images=proc.images._replace(size=int(ref["tile"])))
    qs = [t.split("user\n")[1].replace("<IMG_CONTEXT>\n", "").split("<|im_end|>")[0]
          for t in ref["prompt"]]  # fmt: skip
    if "levels" not in ref:
        return encode.encode_text(proc, qs)
    return dataclasses.replace(model, processor=proc).encode(images(folder, case, len(qs)), qs)


def internvl_processed(model, ref, enc):
    from jaxmech.families.internvl import processor

    if "levels" not in ref:
        return {}
    assert float(ref["levels_err"]) == 0.0  # the levels hold the reference's floats
    levels, p = ref["levels"], model.config.patch_size  # [tiles, 3, t, t]
    n = levels.shape[-1] // p
    want = processor.pixel_table(model.processor.images)[np.arange(3)[:, None, None], levels]
    want = want.reshape(-1, 3, n, p, n, p).transpose(0, 2, 4, 1, 3, 5).reshape(len(want), n * n, -1)
    px = np.asarray(enc.inputs.pixels_BxTxPxF)
    return {"pixels_BxTxPxF": (px.reshape(want.shape), want),
            "n_tiles": (enc.n_tiles, int(ref["tiles"][0]))}  # fmt: skip


def internvl_vision(config, ref):
    if "vit" not in ref:
        return {}
    vit = ref["vit"]  # the embeddings, then each block's output
    out = {"vit/resid_pre.0": vit[0], "proj/out": ref["proj"]}
    return out | {f"vit/resid_post.{i}": vit[i + 1] for i in range(config.vit_depth)}


def internvl_identity(model, x):
    from jaxmech.families.internvl import positions

    side = positions.tile_side(x.pixels_BxTxPxF.shape[2])
    rows, cols = (a.astype(np.float32) for a in positions.patch_grid(side))
    return dict(vit_rows=rows, vit_cols=cols, image_order=np.arange(x.image_BxI.shape[1]),
                lm_pos_ids=np.repeat(np.asarray(x.pos_BxS)[:, None], 3, 1))  # fmt: skip


INTERNVL = Fixtures(
    folders={"internvl/internvl": "batch"},
    encode=internvl_encode,
    processed=internvl_processed,
    vision=internvl_vision,
    identity=internvl_identity,
    unexpand=lambda p: re.sub(r"<img>(<IMG_CONTEXT>)+</img>", "<IMG_CONTEXT>", p),
)


# ---- Llama-3.2-Vision (families/mllama) ---------------------------------------------


def mllama_processed(model, ref, enc):
    x = enc.inputs
    out = {"pos_BxS": (x.pos_BxS, ref["position_ids"])}
    if "pixel_values" in ref:
        out |= {"pixels_BxTxPxF": nchw(x.pixels_BxTxPxF, model.config, ref["pixel_values"]),
                "aspect_B": (x.aspect_B, ref["aspect_ratio_ids"][:, 0]),
                "tiles_BxT": (x.tiles_BxT, ref["aspect_ratio_mask"][:, 0].astype(bool)),
                "xattn_BxSxT": (x.xattn_BxSxT, ref["cross_attention_mask"][:, :, 0].astype(bool))}  # fmt: skip
    return out


def mllama_vision(config, ref):
    if "vit_local" not in ref:
        return {}
    out = {"vit/resid_pre.0": ref["vit_embed"], "vit/out": ref["vision_out"],
           "proj/out": ref["projected"]}  # fmt: skip
    out |= {f"vit/resid_post.{i}": h for i, h in enumerate(ref["vit_local"])}
    return out | {f"vit_global/resid_post.{i}": h for i, h in enumerate(ref["vit_global"])}


MLLAMA = Fixtures(
    folders={"mllama/mllama": "batch", "mllama/mllama_t5": "batch"},
    encode=chat_encode(
        "mllama",
        lambda t: (
            t.split("<|end_header_id|>\n\n")[1].replace("<|image|>", "").split("<|eot_id|>")[0]
        ),
    ),
    processed=mllama_processed,
    vision=mllama_vision,
    identity=grid_identity("mllama"),
    unexpand=lambda p: p,
)


# ---- Gemma-3 (families/gemma3) --------------------------------------------------------


def gemma3_processed(model, ref, enc):
    x = enc.inputs
    image = np.zeros(np.shape(x.valid_BxS), np.int64)  # the image block: token_type_ids
    for b, row in enumerate(np.asarray(x.image_BxI)):
        image[b, row] = 1
    out = {"pos_BxS": (x.pos_BxS, ref["position_ids"]),
           "token_type_ids": (image, ref["token_type_ids"])}  # fmt: skip
    if "pixel_values" in ref:
        out["pixels_BxPxF"] = nchw(x.pixels_BxPxF, model.config, ref["pixel_values"])
    return out


def gemma3_vision(config, ref):
    if "vit_hidden" not in ref:
        return {}
    vit = ref["vit_hidden"]  # the embeddings, then each block's output
    out = {"vit/embed": vit[0], "vit/final": ref["vit_out"], "proj/out": ref["projected"]}
    return out | {f"vit/resid_post.{i}": vit[i + 1] for i in range(config.vit_depth)}


GEMMA3 = Fixtures(
    folders={"gemma3/gemma3": "batch", "gemma3/gemma3_t5": "batch"},
    encode=chat_encode(
        "gemma3",
        lambda t: (
            t.split("<start_of_turn>user\n")[1]
            .replace("<start_of_image>", "")
            .split("<end_of_turn>")[0]
        ),
    ),
    processed=gemma3_processed,
    vision=gemma3_vision,
    identity=grid_identity("gemma3"),
    unexpand=lambda p: re.sub(
        r"\n\n<start_of_image>(<image_soft_token>)+<end_of_image>\n\n", "<start_of_image>", p
    ),
)

# {registered family name: its fixtures}: one entry per checkpoint family
FIXTURES = {"qwen2_vl": (QWEN,), "llava": (LLAVA,), "internvl": (INTERNVL,),
            "mllama": (MLLAMA,), "gemma3": (GEMMA3,)}  # fmt: skip

FOLDERS = {folder: (name, fx) for name, fxs in FIXTURES.items() for fx in fxs
           for folder in fx.folders}  # fmt: skip
CASES = [(folder, case) for folder in FOLDERS for case in cases(os.path.join(HERE, folder))]


def checkpoint_families() -> list:
    return [f for f in FAMILIES.values() if getattr(f, "checkpoint_types", ())]


def test_every_checkpoint_family_has_fixtures():
    """Every registered checkpoint family has an entry in FIXTURES, every `model_type` it
    reads a fixture checkpoint, and every fixture is read by its family."""
    for family in checkpoint_families():
        assert family.name in FIXTURES, f"family {family.name!r} has no contract fixture"
    for name in FIXTURES:
        assert name in FAMILIES, f"FIXTURES names {name!r}, not a registered family"
    types = {}
    for folder, (name, _) in FOLDERS.items():
        assert checkpoint_family(os.path.join(HERE, folder)) is FAMILIES[name], folder
        with open(os.path.join(HERE, folder, "config.json")) as f:
            types.setdefault(name, set()).add(json.load(f)["model_type"])
    for family in checkpoint_families():
        missing = set(family.checkpoint_types) - types[family.name]
        assert not missing, f"family {family.name!r}: no contract fixture of {sorted(missing)}"


@pytest.fixture(scope="module", autouse=True)
def _release():
    """The loaded checkpoints and their runs are kept for this module's tests only."""
    yield
    for cached in (opened, encoded, run):
        cached.cache_clear()


@functools.lru_cache(maxsize=None)
def opened(folder: str):
    """(model, its Fixtures, {case: reference}) of a fixture folder, loaded once."""
    name, fx = FOLDERS[folder]
    path = os.path.join(HERE, folder)
    model = jaxmech.load(path)
    assert model.family is FAMILIES[name] and model.folder == path
    if fx.processor is not None:
        model = dataclasses.replace(model, processor=fx.processor(path, model.config))
    return model, fx, cases(path)


@functools.lru_cache(maxsize=None)
def encoded(folder: str, case: str):
    model, fx, refs = opened(folder)
    return fx.encode(model, os.path.join(HERE, folder), case, refs[case])


def identity_edits(model, fx, x, aux_last):
    """The no-op edits on inputs `x`: zeros added at every site but the last, the last
    replaced by its own value `aux_last`, and the family's identity position / order
    edits."""
    sites = model.sites()
    return Edits(add={s: jnp.zeros(()) for s in sites[:-1]},
                 replace={sites[-1]: (True, aux_last)}, **fx.identity(model, x))  # fmt: skip


def named(sites) -> tuple:
    """The sites the edited run captures by name: the first, a middle and the last but one."""
    return (sites[0], sites[len(sites) // 2], sites[-2])


@functools.lru_cache(maxsize=None)
def run(folder: str, case: str):
    """(logits, aux, edited) of the case through the handle's forward, capturing every
    site (one program); on the folder's no-op case the same program also runs the
    no-op edits (`identity_edits`), capturing `named` sites: `edited` is (logits, aux)."""
    model, fx, _ = opened(folder)
    x = encoded(folder, case).inputs

    def forward(params, inputs):
        m = dataclasses.replace(model, params=params)
        logits, aux = m.forward(inputs, capture=True)
        if case != fx.folders[folder]:
            return logits, aux, None
        e = identity_edits(m, fx, x, aux[m.sites()[-1]])  # (positions from the concrete x)
        return logits, aux, m.forward(inputs, edits=e, capture=named(m.sites()))

    return jax.device_get(jax.jit(forward)(model.params, x))


def compared(ours, theirs, what: str):
    if isinstance(theirs, np.ndarray) and theirs.dtype.kind == "f":
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-6, rtol=0, err_msg=what)
    elif isinstance(theirs, np.ndarray):
        np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=what)
    else:
        assert ours == theirs, what


@pytest.mark.parametrize("folder,case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_processor_equals_the_reference(folder, case):
    model, fx, refs = opened(folder)
    ref, enc = refs[case], encoded(folder, case)
    compared(enc.inputs.tokens_BxS, ref["input_ids"], "tokens_BxS")
    compared(enc.inputs.valid_BxS, ref["attention_mask"].astype(bool), "valid_BxS")
    if "prompt" in ref and not case.startswith("video"):  # (a video's: decoded tokens)
        compared([fx.unexpand(p) for p in enc.prompts], [str(p) for p in ref["prompt"]], "prompts")
    for what, (ours, theirs) in fx.processed(model, ref, enc).items():
        compared(ours, theirs, what)


@pytest.mark.parametrize("folder,case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_forward_equals_the_reference(folder, case):
    """The logits and the LM's hidden states at the valid rows, the vision side's stored
    stages at every row; every site captured, and only the model's."""
    model, fx, refs = opened(folder)
    ref, x = refs[case], encoded(folder, case).inputs
    logits, aux, _ = run(folder, case)
    valid, L = np.asarray(x.valid_BxS), model.config.lm_layers

    def close(site, ours, theirs, rows=valid):
        np.testing.assert_allclose(np.asarray(ours)[rows], theirs[rows], atol=TOL, rtol=TOL,
                                   err_msg=f"{folder} {case}: {site}")  # fmt: skip

    close("logits", logits, ref["logits"])
    hidden = ref["hidden"]
    assert len(hidden) == L + 1
    lm = ["lm/resid_pre.0", *(f"lm/resid_post.{i}" for i in range(L - 1)), "lm/final"]
    for site, theirs in zip(lm, hidden):
        close(site, aux[site], theirs)
    for site, theirs in fx.vision(model.config, ref).items():
        flat = lambda a: np.asarray(a).reshape(-1, np.shape(a)[-1])  # noqa: E731
        close(site, flat(aux[site]), flat(theirs), slice(None))
    sites = model.sites()
    assert len(set(sites)) == len(sites), "sites() repeats a name"
    want = set(sites) if x.image_BxI.shape[1] else {s for s in sites if s.startswith("lm/")}
    unnamed, missing = set(aux) - set(sites), want - set(aux)  # no image: the LM's sites
    assert not unnamed and not missing, (
        f"captured, not in sites(): {sorted(unnamed)}; in sites(), not captured: {sorted(missing)}"
    )


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_op_edits_are_exact(folder):
    """Zeros added at every site, the last site replaced by its own value and the
    identity position / order edits: the plain run's logits bit for bit; a named capture
    holds those sites, whole, equal to the plain run's."""
    model, fx, _ = opened(folder)
    logits, aux, (edited, edited_aux) = run(folder, fx.folders[folder])
    np.testing.assert_array_equal(edited, logits)
    assert set(edited_aux) == set(named(model.sites()))
    for site, value in edited_aux.items():
        np.testing.assert_array_equal(value, aux[site], err_msg=site)
    assert model.describe() and "\n" not in model.describe()  # one line for logs


@pytest.mark.parametrize("folder", FOLDERS)
def test_refusals_name_what_they_refuse(folder):
    """Bad edits and inputs are refused, each error naming the argument (and the site);
    so are a bare string as `capture` and a processor asked for a file that is not there
    or for one image for two questions."""
    model, fx, _ = opened(folder)
    x = encoded(folder, fx.folders[folder]).inputs
    L, n_image = model.config.lm_layers, x.image_BxI.shape[1]
    pixels = next(name for name in x._fields if name.startswith("pixels_"))
    bad_edits = {
        f"Edits.add['lm/resid_pre.{L + 7}']": Edits(add={f"lm/resid_pre.{L + 7}": 0.0}),
        "Edits.replace['vit/nowhere.0']": Edits(replace={"vit/nowhere.0": (True, 0.0)}),
        "Edits.term_keep": Edits(term_keep={"vit": np.ones((2, 16))}),
        "Edits.image_order: expected a permutation": Edits(image_order=np.zeros(n_image, int)),
        "Edits.image_order: shape": Edits(image_order=np.arange(n_image + 1)),
        "Edits.vit_rows: shape": Edits(vit_rows=np.zeros(3)),
        "Edits.vit_cols: shape": Edits(vit_cols=np.zeros(3)),
        "Edits.lm_pos_ids: shape": Edits(lm_pos_ids=np.zeros((2, 5))),
    }
    for message, edits in bad_edits.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            model.forward(x, edits=edits)
    bad_inputs = {
        pixels: x._replace(**{pixels: getattr(x, pixels)[..., :-1]}),  # a feature short
        "valid_BxS": x._replace(valid_BxS=x.valid_BxS[:, :-1]),
    }
    for message, inputs in bad_inputs.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            model.forward(inputs)
    with pytest.raises(ValueError, match=re.escape("capture = 'lm/final'")):
        model.forward(x, capture="lm/final")
    picture = images(os.path.join(HERE, folder), fx.folders[folder], 1)
    with pytest.raises(ValueError, match="'/nonexistent.png': no such file"):
        model.encode(["/nonexistent.png"], ["Is it?"])
    with pytest.raises(ValueError, match="images: 1 images for 2 questions"):
        model.encode(picture, ["Is it?", "Is it?"])


@pytest.mark.parametrize("folder", FOLDERS)
def test_params_keep_their_layout(folder):
    """The loaded params have exactly the shapes the family's `params.param_shapes` names,
    random ones (`init_params`) the same tree and shapes, and `params.n_params` counts
    the loaded leaves (tied embeddings once): the key map, the layout and the count agree."""
    model, _, _ = opened(folder)
    shapes = importlib.import_module(f"jaxmech.families.{model.family.name}.params")
    want = jax.tree.map(tuple, shapes.param_shapes(model.config), is_leaf=layout.is_shape)
    assert jax.tree.map(np.shape, model.params) == want
    fresh = model.family.init_params(model.config, jax.random.PRNGKey(0))
    assert jax.tree.map(np.shape, fresh) == want
    assert shapes.n_params(model.config) == sum(np.size(a) for a in jax.tree.leaves(model.params))
