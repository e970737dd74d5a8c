"""The checkpoint-family contract (`families.contract.CheckpointFamily`): a stand-in family
written here, registered from the test, loads with `jaxmech.load`, answers through
`experiments.ask` and runs the paper 003 / 004 reports (patching, spatial IDs, the
counterfactual table) with no change to `analysis/`, `reports/` or `experiments/`.

The stand-in ("pix_vlm"): a ViT of one block over p x p pixel patches whose position
enters once, as a learned absolute table [h, w, D] read bilinearly (so a half-cell
shift is a real change, as in LLaVA's or InternVL's ViT), a linear projector, and a
two-block causal LM over [padding][image tokens][question] with learned positions. Its
folder holds config.json, model.safetensors (flat names, '.'-joined) and a word-level
tokenizer.json, as a Hub checkpoint does.
"""

import dataclasses
import json
import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quiet

import jaxmech
from jaxmech.data.inputs import pictures
from jaxmech.families import FAMILIES, register
from jaxmech.families.contract import CheckpointFamily
from jaxmech.families.vlm_view import Spans, VLMView
from jaxmech.models.attention import block_forward
from jaxmech.models.edits import NO_EDITS

PAD, IMAGE = "<pad>", "<image>"
ANSWERS = (("left", "right"), ("above", "below"), ("yes", "no"))


@dataclasses.dataclass(frozen=True)
class PixConfig:
    vocab: int
    patch: int = 4
    table: int = 4  # the position table's side, in patches
    width: int = 16
    heads: int = 2
    lm_layers: int = 2
    max_len: int = 64


def read_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    return PixConfig(
        **{k: c[k] for k in ("vocab", "patch", "table", "width", "heads", "lm_layers")}
    )


def _block(key, D, H):
    k = jax.random.split(key, 4)
    w = {f"W_{n}": 0.3 * jax.random.normal(k[i], (H, D, D // H)) for i, n in enumerate("QKV")}
    b = {f"b_{n}": jnp.zeros((H, D // H)) for n in "QKV"}
    return w | b | {"W_O": 0.3 * jax.random.normal(k[3], (H, D // H, D)), "b_O": jnp.zeros(D)}


def init_params(c: PixConfig, key, dtype=jnp.float32):
    D, k = c.width, jax.random.split(key, 8)
    p = {
        "vit": {"W_patch": 0.3 * jax.random.normal(k[0], (3 * c.patch**2, D)),
                "pos": jax.random.normal(k[1], (c.table, c.table, D)), "block_0": _block(k[2], D, c.heads)},
        "proj": {"W": 0.3 * jax.random.normal(k[3], (D, D))},
        "lm": {"E": jax.random.normal(k[4], (c.vocab, D)), "pos": 0.3 * jax.random.normal(k[5], (c.max_len, D)),
               "W_U": 0.3 * jax.random.normal(k[6], (D, c.vocab))}
        | {f"block_{i}": _block(jax.random.fold_in(k[7], i), D, c.heads) for i in range(c.lm_layers)},
    }  # fmt: skip
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), p)


def load(folder, dtype=jnp.float32, place="auto"):
    from safetensors.numpy import load_file

    params: dict = {}
    for name, x in load_file(os.path.join(folder, "model.safetensors")).items():
        *path, leaf = name.split(".")
        node = params
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(x, dtype)
    return read_config(folder), params


def write_checkpoint(folder, seed=0):
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    text = " ".join(pictures.TEMPLATES + pictures.AUTHORS_TEMPLATES + pictures.SHAPES)
    text += " " + " ".join((*pictures.COLOURS, pictures.MIDDLE, *sum(ANSWERS, ())))
    words = sorted(set(re.findall(r"\w+|[^\w\s]", text)) - {"x", "y", "a"}) + ["a", "an"]
    vocab = {w: i for i, w in enumerate([PAD, IMAGE, "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([PAD, IMAGE])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = PixConfig(vocab=len(vocab))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "pix_vlm"} | dataclasses.asdict(config), f)
    flat = jax.tree_util.tree_flatten_with_path(init_params(config, jax.random.key(seed)))[0]
    save_file({".".join(k.key for k in path): np.asarray(x) for path, x in flat},
              os.path.join(folder, "model.safetensors"))  # fmt: skip
    return folder


# --- processor -----------------------------------------------------------------------


class Inputs(NamedTuple):
    patches_BxPxF: Any
    tokens_BxS: Any
    valid_BxS: Any
    image_BxI: Any


class Encoded(NamedTuple):
    inputs: Inputs
    offsets: list  # per row: each token's character range in its question (image: -1)
    side: int  # patches per side

    def describe(self):
        return f"{self.side} x {self.side} patches, {self.inputs.tokens_BxS.shape[1]} tokens"


def processor(folder, config):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")), config


def encode(proc, images, questions):
    from PIL import Image

    tok, c = proc
    px = np.stack(
        [np.asarray(Image.open(i).convert("RGB")) if isinstance(i, str) else i for i in images]
    )
    side = px.shape[1] // c.patch
    if px.shape[1] != px.shape[2] or px.shape[1] % c.patch or side > c.table:
        raise ValueError(f"images: {px.shape[1]} x {px.shape[2]} px; expected square, a multiple of "
                         f"{c.patch} px, at most {c.table * c.patch}")  # fmt: skip
    patches = px.reshape(len(px), side, c.patch, side, c.patch, 3).transpose(0, 1, 3, 2, 4, 5)
    encs = [tok.encode(q, add_special_tokens=False) for q in questions]
    S = side * side + max(len(e.ids) for e in encs)
    tokens, offsets = np.zeros((len(encs), S), np.int32), []
    for b, e in enumerate(encs):
        row = [tok.token_to_id(IMAGE)] * side**2 + e.ids
        tokens[b, S - len(row) :] = row
        offsets.append([(-1, -1)] * (S - len(e.ids)) + list(e.offsets))
    first = S - np.asarray([side**2 + len(e.ids) for e in encs])
    inputs = Inputs(
        jnp.asarray(patches.reshape(len(px), side * side, -1) / 255.0 - 0.5, jnp.float32),
        jnp.asarray(tokens), jnp.asarray(np.arange(S) >= first[:, None]),
        jnp.asarray(first[:, None] + np.arange(side * side), jnp.int32),
    )  # fmt: skip
    return Encoded(inputs, offsets, side)


# --- the forward, with named sites -----------------------------------------------------


def _bilinear(table, r, c):
    """table [h, w, D] read at fractional (r, c) [P] (clamped): a shift by half a cell
    is an interpolation of the table, a real change."""
    h, w = table.shape[:2]
    r, c = jnp.clip(r, 0, h - 1), jnp.clip(c, 0, w - 1)
    r0, c0 = jnp.floor(r).astype(jnp.int32), jnp.floor(c).astype(jnp.int32)
    r1, c1 = jnp.minimum(r0 + 1, h - 1), jnp.minimum(c0 + 1, w - 1)
    fr, fc = (r - r0)[:, None], (c - c0)[:, None]
    top = table[r0, c0] * (1 - fc) + table[r0, c1] * fc
    return top * (1 - fr) + (table[r1, c0] * (1 - fc) + table[r1, c1] * fc) * fr


def _positions(side):
    rows, cols = np.divmod(np.arange(side * side), side)
    return jnp.asarray(rows, jnp.float32), jnp.asarray(cols, jnp.float32)


def forward(p, inputs, *, edits=None, capture=(), config=None):
    """(logits [B, S, V], aux): every site computed; aux keeps those in `capture`."""
    e = NO_EDITS if edits is None else edits
    side = int(round(inputs.patches_BxPxF.shape[1] ** 0.5))
    r, c = _positions(side)
    r = r if e.vit_rows is None else jnp.asarray(e.vit_rows, jnp.float32)
    c = c if e.vit_cols is None else jnp.asarray(e.vit_cols, jnp.float32)
    x = inputs.patches_BxPxF @ p["vit"]["W_patch"] + _bilinear(p["vit"]["pos"], r, c)
    aux = {"vit/resid_pre.0": (x := e("vit/resid_pre.0", x))}
    x, more = block_forward(
        p["vit"]["block_0"], x, causal=False, edits=e, prefix="vit/", suffix=".0"
    )
    aux |= more | {"proj/out": (img := e("proj/out", x @ p["proj"]["W"]))}
    if e.image_order is not None:
        img = jnp.take(img, jnp.asarray(e.image_order), axis=1)
    B, S = inputs.tokens_BxS.shape
    x = p["lm"]["E"][inputs.tokens_BxS].at[jnp.arange(B)[:, None], inputs.image_BxI].set(img)
    ids = jnp.arange(S) if e.lm_pos_ids is None else jnp.asarray(e.lm_pos_ids)[..., 0, :]
    x = x + jnp.take(p["lm"]["pos"], jnp.asarray(ids).astype(jnp.int32), axis=0)
    # padding sees itself only (no all-masked row); the rest skip it
    visible = inputs.valid_BxS[:, None, None, :] | jnp.eye(S, dtype=bool)
    for i in range(config.lm_layers):
        aux[f"lm/resid_pre.{i}"] = x = e(f"lm/resid_pre.{i}", x)
        x, more = block_forward(p["lm"][f"block_{i}"], x, causal=True, edits=e, prefix="lm/",
                                suffix=f".{i}", visible=visible)  # fmt: skip
        aux |= more
    keep = aux if capture is True else {k: v for k, v in aux.items() if k in tuple(capture)}
    return x @ p["lm"]["W_U"], keep


def sites(config, params=None):
    names = ["vit/resid_pre.0"] + [f"vit/{s}.0" for s in BLOCK_SITES] + ["proj/out"]
    for i in range(config.lm_layers):
        names += [f"lm/resid_pre.{i}"] + [f"lm/{s}.{i}" for s in BLOCK_SITES]
    return tuple(names)


BLOCK_SITES = ("q", "k", "v", "attn_scores", "pattern", "z", "attn_out", "resid_mid", "resid_post")


def next_token(config, params, encoded):
    logits = jax.jit(lambda p, x: forward(p, x, config=config)[0][:, -1])(params, encoded.inputs)
    return np.asarray(jax.nn.log_softmax(logits))


# --- the VLM view: drawn scenes through the processor ----------------------------------


def view(folder, config, grid, size, video=False, wording="jaxmech"):
    if video:
        raise ValueError("video = True: the pix_vlm family has no video view")
    if (
        size % (config.patch * grid.w)
        or size % (config.patch * grid.h)
        or size > config.table * config.patch
    ):
        raise ValueError(f"size = {size}: expected whole patches per cell, at most "
                         f"{config.table * config.patch} px")  # fmt: skip
    proc, side = processor(folder, config), size // config.patch
    templates = pictures.AUTHORS_TEMPLATES if wording == "authors" else pictures.TEMPLATES
    rows, cols = _positions(side)

    def render(specs, ask=None):
        ask = specs if ask is None else ask
        qs = pictures.questions(ask, templates)
        enc = encode(proc, list(pictures.draw(grid, specs, size)), qs)
        xy = [[_last_token(enc.offsets[b], q, w or x) for w in (x, y)]
              for b, (q, (x, y)) in enumerate(zip(qs, pictures.object_names(ask)))]  # fmt: skip
        S = enc.inputs.tokens_BxS.shape[1]
        question = np.asarray([[o[0] >= 0 for o in offs] for offs in enc.offsets])
        r, c = np.asarray(rows, int), np.asarray(cols, int)
        cell = (r * grid.h // side) * grid.w + c * grid.w // side
        xy = np.asarray(xy, np.int32)
        spans = Spans(enc.inputs.image_BxI, np.stack([0 * r, r, c], 1).astype(np.int32),
                      cell.astype(np.int32), xy[:, 0], xy[:, 1], question,
                      np.full(len(qs), S - 1, np.int32), np.argmax(np.asarray(enc.inputs.valid_BxS), 1))  # fmt: skip
        return enc.inputs, spans

    def view_forward(params, inputs, edits=None, capture=False):
        logits, aux = forward(
            params, inputs, edits=edits, capture=True if capture else (), config=config
        )
        return logits[:, -1], aux

    return VLMView(
        name="pix_vlm",
        grid=grid,
        n_labels=len(pictures.SHAPES),
        n_colours=len(pictures.COLOURS),
        render=render,
        forward=view_forward,
        answer_words=np.asarray([[proc[0].token_to_id(w) for w in pair] for pair in ANSWERS]),
        n_lm_blocks=lambda params: config.lm_layers,
        lm_position_ids=lambda params, sp: jnp.broadcast_to(jnp.arange(sp.length, dtype=jnp.float32), (3, sp.length)),
        vit_positions=lambda params: (rows, cols, (side, side)),
        vit_blocks=lambda params: 0,
        position_basis=lambda params: _bilinear(params["vit"]["pos"], rows, cols),
    )  # fmt: skip


def _last_token(offsets, question, word):
    lo = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", question).start()
    hi = lo + len(word)
    return max(i for i, (a, b) in enumerate(offsets) if a >= 0 and a < hi and b > lo)


PIX = CheckpointFamily(
    name="pix_vlm",
    checkpoint_types=("pix_vlm",),
    read_config=read_config,
    load=load,
    init_params=init_params,
    view=view,
    processor=processor,
    encode=encode,
    tokenizer=lambda proc: proc[0],
    next_token=next_token,
    describe=lambda c: f"pix_vlm, {c.lm_layers} LM blocks",
    trainable=lambda params: "vit/block_0",
    forward=forward,
    sites=sites,
)

# ---------------------------------------------------------------------------


@pytest.fixture
def pix(tmp_path):
    register(PIX)
    try:
        yield write_checkpoint(str(tmp_path / "pix"))
    finally:
        FAMILIES.pop("pix_vlm")


def test_a_checkpoint_family_loads_and_names_its_sites(pix):
    model = jaxmech.load(pix)
    assert model.describe() == "pix_vlm, 2 LM blocks"
    image = pictures.draw(_grid(), _spec(), 16)
    enc = model.encode(list(image), ["Is the circle to the left or the right of the square?"])
    logits, aux = model.forward(enc.inputs, capture=True)
    assert set(aux) == set(model.sites())  # the sites it lists are the ones it names
    # a no-op edit is a no-op; a replace at a site changes what follows it
    from jaxmech.models.edits import Edits

    site = "lm/resid_pre.1"
    same, _ = model.forward(enc.inputs, edits=Edits(replace={site: (jnp.ones(1, bool), aux[site])}))
    np.testing.assert_allclose(same, logits, atol=1e-6)
    moved, _ = model.forward(enc.inputs, edits=Edits(add={site: jnp.ones_like(aux[site])}))
    assert np.abs(np.asarray(moved - logits)).max() > 1e-3
    lp = model.next_token_logprobs(enc)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits[:, -1]), atol=1e-5)


def _grid():
    from jaxmech.data.spec import Grid

    return Grid(2, 2)


def _spec():
    from jaxmech.data.spec import pair_questions

    return pair_questions(_grid(), 1, len(pictures.SHAPES), len(pictures.COLOURS))["examples"]


def test_ask_answers_on_a_checkpoint_family(pix, tmp_path, capsys):
    from PIL import Image

    from experiments import ask

    path = str(tmp_path / "scene.png")
    Image.fromarray(pictures.draw(_grid(), _spec(), 16)[0]).save(path)
    try:
        ask.FLAGS([ask.__file__, f"--checkpoint={pix}", f"--image={path}", "--top=3",
                   "--question=Is the circle above or below the square?"])  # fmt: skip
        ask.main([])
    finally:
        ask.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "pix_vlm, 2 LM blocks: 4 x 4 patches" in out
    assert len(re.findall(r"^\s+[123]\s+0\.\d+", out, re.M)) == 3


def test_paper_003_004_reports_run_on_a_checkpoint_family(pix, tmp_path):
    """~20 s: three reports, each one compiled table, on the stand-in checkpoint."""
    from jaxmech.analysis.patching import GROUPS
    from jaxmech.reports import counterfactuals, patching, spatial_ids
    from jaxmech.reports.common import analyse_subject, open_checkpoint

    def run(protocol="jaxmech"):
        return open_checkpoint(pix, grid=(2, 2), size=16, questions=3, batch=4,
                               protocol=protocol, log=quiet)  # fmt: skip

    out = str(tmp_path / "out")
    # the authors' protocol counts every question (a random model answers few right)
    pat = analyse_subject(patching.REPORT, run("authors"), out, log=quiet)
    ids = analyse_subject(spatial_ids.REPORT, run(), out, log=quiet)
    cf = analyse_subject(counterfactuals.REPORT, run(), out, log=quiet)
    sh = pat["res"]["shifts"][("mirror", "both", "logp", "mean")]  # [1, Y, G]
    assert sh.shape[0] == 1 and sh.shape[2:] == (len(GROUPS),) and np.isfinite(sh).all()
    assert any(np.isfinite(r["r2"]) for r in ids["tables"]["r2"])
    rows = {(r["counterfactual"], r["relation"]): r for r in cf["tables"]["table"]}
    assert rows[("plain", "horizontal")]["changed"] == 0.0  # the unedited run is the model's
    for folder in ("patching", "spatial_ids", "counterfactuals"):
        assert os.path.isfile(os.path.join(out, folder, "summary.json"))
    for figure in ("patching/shifts_paper.png", "spatial_ids/spatial_ids_paper.png"):
        assert os.path.isfile(os.path.join(out, figure))  # the paper's figure, beside
