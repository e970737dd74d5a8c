"""A Llama-3.2-Vision (mllama) checkpoint's VLM view (`families.vlm_view`), and what the
paper 003 / 004 methods mean where the image is not in the LM's sequence.

Mllama's LM reads the image only through the keys and values of its cross-attention
layers: the projected vision states (`proj/out`, I = tiles x (CLS + patches) rows),
which every cross-attention layer reads unchanged. The methods speak of image tokens at
LM positions, so the view shows each row as a **view sequence**: the I vision states
first (the "vision slots"), then the S text tokens. At a view site `lm/resid_pre.{y}`
(and `resid_post`, `resid_mid`, `lm/final`) the vision slots hold the states the
cross-attention layers from y on read (the model's `lm/vision.{i}` of the first
cross-attention layer i >= y; `proj/out` where none is left), the text rows the
model's residual stream. An edit there (a replace, an add) reaches the text rows at
that site and the vision states of every cross-attention layer i >= y, not the earlier
ones: the layers before y already read the example's image, as a token-sequence VLM's
image tokens before block y are the example's.

So, per method:

* patching (paper 003): the "image" group is the cross-attention keys' and values'
  input at the image's patches (the one tile's P patch states), taken from the twin for
  every cross-attention layer at or after the patched layer; chosen over the `<|image|>`
  token (an ordinary embedding, the same in both twins) and over the keys / values of
  one layer (the states are what every later layer reads, so the patch says what the
  image contributes from layer y on, as a token VLM's patch at `resid_pre.y` does). The
  tiles' CLS states and the padded tiles' rows (they also change with the picture,
  through the encoder's attention) are patched by the "all" group only; "text" is every
  text token (each, before the `<|image|>` token too, reads the image: the reference's
  unmasked rows); "question", "objects", "last" as for any family.
* steering, diagnostics, spatial IDs: the object words are text tokens, read and
  steered as in any family; an image token's state (a spatial-ID probe reading its
  cell) is the projected vision state, the same at every layer.
* counterfactuals: `vit_rows` / `vit_cols` move where each patch reads both learned
  per-patch tables (`positions.tables_at`: the per-patch table and the tile's table,
  the CLS row fixed); the LM has no positions for the image (cross-attention has no
  rotary), so the LM-side position mirrors are no-ops by construction (the view's ids
  for vision slots are dropped); `image_order` permutes the cross-attention keys with
  their values, which attention without positions cannot see within one tile's mask:
  also a no-op but for float summation order.

Drawn scenes are drawn at one tile's size (config.json's `image_size`), which the
processor keeps as one 1 x 1 tile (aspect-ratio id 1), so the image tokens are that
tile's g x g patches; photographs are squashed to one tile (`processor.encode(...,
one_tile=True)`), as InternVL's reports take them, so every photograph is one patch
grid. `ask` and `encode` tile as the reference.

Axis names (`jaxmech.shapes`): B scenes, S text tokens, I vision states, P patches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from jaxmech.data.inputs import pictures, prompts
from jaxmech.data.spec import Grid
from jaxmech.families import hf_vlm
from jaxmech.families.mllama import model, processor
from jaxmech.families.mllama.config import MllamaConfig
from jaxmech.families.vlm_view import Spans, VLMView, placed
from jaxmech.models.decoder import answer_forward
from jaxmech.models.edits import Edits

GRID = Grid(4, 4)
RESIDUALS = ("resid_pre", "resid_mid", "resid_post")


def slot_order(c: MllamaConfig) -> np.ndarray:
    """[I] the vision state each vision slot shows: tile 0's CLS, the other tiles' rows,
    then tile 0's patches row-major (the image tokens, last, so "text" starts after)."""
    n = c.n_patches + 1
    patches = np.arange(1, n)
    return np.concatenate([[0], np.arange(n, c.n_vision_tokens), patches]).astype(np.int32)


def n_slots(c: MllamaConfig, inputs) -> int:
    """The vision slots of a batch: I with an image, 0 without."""
    return c.n_vision_tokens if np.shape(inputs.pixels_BxTxPxF)[1] else 0


def check_size(config: MllamaConfig, grid: Grid, size: int) -> None:
    """Refuses (ValueError naming `size` / `grid`) a drawn scene that is not one whole
    tile or whose cells are not whole patches."""
    if size != config.image_size:
        raise ValueError(f"size = {size}: drawn scenes must be one tile, {config.image_size} px "
                         "(config.json's image_size), so that the picture is one patch grid")  # fmt: skip
    g = config.grid
    hf_vlm.check_cells(grid, g, f"a tile's {g} x {g} patches", "patches")


def spans(c: MllamaConfig, enc: processor.Encoded, words, cells) -> Spans:
    """The view-sequence `Spans` (module docstring) of an encoded batch."""
    I = n_slots(c, enc.inputs)  # noqa: E741
    xy = prompts.word_positions(enc.prompts, enc.question_Bx2, enc.offsets_BxSx2, words) + I
    question = prompts.question_mask(enc.offsets_BxSx2, enc.question_Bx2)
    B, S = question.shape
    question = np.concatenate([np.zeros((B, I), bool), question], 1)
    g = c.grid if I else 0
    r, col = np.divmod(np.arange(g * g), max(g, 1))
    image = np.broadcast_to(np.arange(I - g * g, I, dtype=np.int32), (B, g * g))
    cell = (r * cells[0] // max(g, 1)) * cells[1] + col * cells[1] // max(g, 1)
    return Spans(np.ascontiguousarray(image), np.stack([0 * r, r, col], 1).astype(np.int32),
                 cell.astype(np.int32), xy[:, 0], xy[:, 1], question,
                 np.full(B, I + S - 1, np.int32))  # fmt: skip


def _placed(c, enc, words, grid: Grid):
    """`hf_vlm.Rendering.place`: (inputs on the device, view-sequence Spans), each
    row's first real token counted after the vision slots."""
    inputs, sp = placed(enc.inputs, spans(c, enc, words, (grid.h, grid.w)))
    return inputs, sp._replace(first_B=sp.first_B + n_slots(c, enc.inputs))


def rendering(c: MllamaConfig) -> hf_vlm.Rendering:
    """Drawn scenes encoded as the reference tiles them (one tile at their size),
    photographs each squashed to one tile."""
    return hf_vlm.Rendering(processor.encode, processor.encode_text,
                            functools.partial(_placed, c),
                            functools.partial(processor.encode, one_tile=True))  # fmt: skip


def _cross_after(c: MllamaConfig, y: int):
    """The cross-attention layers at or after block y."""
    return [i for i in c.cross_layers if i >= y]


def _split(c: MllamaConfig, I: int, name: str, order):  # noqa: E741
    """(the model's text site, the model sites its vision slots stand for) of a view
    site `name`, or None where it is not a view-sequence site."""
    part, _, block = name.partition(".")
    point = part.split("/", 1)[-1]
    if not part.startswith("lm/") or not (point in RESIDUALS or name == "lm/final"):
        return None
    y = c.lm_layers if name == "lm/final" else int(block) + (point != "resid_pre")
    return name, [f"lm/vision.{i}" for i in _cross_after(c, y)]


def _to_model(x, I, inverse):  # noqa: E741
    """(the vision part in model order, the text part) of a view-sequence array."""
    return x[:, :I][:, inverse], x[:, I:]


def model_edits(c: MllamaConfig, I: int, edits: Edits | None) -> Edits | None:  # noqa: E741
    """The model's `Edits` of a view's (module docstring)."""
    if edits is None:
        return None
    order = slot_order(c)
    inverse = np.argsort(order)
    replace, add = {}, {}
    for src, dst in ((edits.replace, replace), (edits.add, add)):
        for name, e in src.items():
            split = _split(c, I, name, order) if I else None
            if split is None:  # (a text-only batch: the view sequence is the text)
                dst[name] = e
                continue
            text_name, vision_names = split
            if dst is replace:
                where, value = e
                value = jnp.asarray(value)
                w = jnp.asarray(where)
                wv, wt = (w, w) if w.ndim < 2 else _to_model(w, I, inverse)
                vv, vt = _to_model(value, I, inverse)
                dst[text_name] = (wt, vt)
                for v in vision_names:
                    dst[v] = (wv, vv)
            else:
                value = jnp.asarray(e)
                if value.ndim < 3:
                    dst[name] = value
                    continue
                vv, vt = _to_model(value, I, inverse)
                dst[text_name] = vt
                for v in vision_names:
                    dst[v] = vv
    ids = edits.lm_pos_ids
    if ids is not None and I:
        ids = jnp.asarray(ids)[..., I:]
    image_order = edits.image_order
    if image_order is not None and I:
        full = jnp.arange(c.n_vision_tokens)
        patches = jnp.asarray(order[-c.n_patches :])
        image_order = full.at[patches].set(patches[jnp.asarray(image_order)])
    return dataclasses.replace(edits, replace=replace, add=add, lm_pos_ids=ids,
                               image_order=image_order)  # fmt: skip


def forward(c: MllamaConfig, params, inputs, edits=None, capture=False, resume=None):
    """(logits [B, V] at the last token, intermediates) on the view sequence (module
    docstring): the model's forward at the answer row (`answer_forward`) with the view's
    edits and captures translated."""
    if resume is not None:
        raise ValueError("resume: the mllama view has no forward_from")
    I = n_slots(c, inputs)  # noqa: E741
    names = c.cross_layers
    want = list(capture) if capture not in (True, False) else capture
    extra = [f"lm/vision.{i}" for i in names] + ["proj/out"] if I and want else []
    full = want if want in (True, False) else list(want) + extra
    logits, aux = answer_forward(functools.partial(model.forward, config=c), c.lm_layers,
                                 params, inputs, model_edits(c, I, edits), full)  # fmt: skip
    if not I or not want:
        return logits, aux
    order = slot_order(c)
    out = {}
    for name, x in aux.items():
        split = _split(c, I, name, order)
        if split is None:
            if want is True or name in want or name.split(".")[0] in want:
                out[name] = x
            continue
        _, vision = split
        v = aux[vision[0]] if vision else aux["proj/out"]
        out[name] = jnp.concatenate([v[:, order].astype(x.dtype), x], 1)
    return logits, out


def position_basis(params):
    """[P, E] the position embedding a one-tile image's patches get: (1 - tanh(g)) x
    the learned table + tanh(g) x aspect-ratio id 1's tile-0 table (patch rows)."""
    vit = params["vit"]
    g = jnp.tanh(vit["pos_gate"].astype(jnp.float32))
    return ((1 - g) * vit["pos"][1:] + g * vit["tile_pos"][1, 0, 1:]).astype(vit["pos"].dtype)


def checkpoint_view(folder: str, config: MllamaConfig, grid: Grid = GRID, size: int | None = None,
                    video: bool = False, wording: str = "jaxmech") -> VLMView:  # fmt: skip
    """The view of the checkpoint in `folder`, scenes on `grid` drawn one tile square
    (`size` None: config.json's image_size, the only one allowed). Raises ValueError
    naming `size`, `grid`, `video`, `wording` or the tokenizer before any compute."""
    hf_vlm.refuse_video(video, "mllama")
    templates, answers = pictures.wording(wording)
    size = config.image_size if size is None else size
    check_size(config, grid, size)
    proc = processor.load_processor(folder, config)
    return hf_vlm.decoder_view(
        "mllama", config=config, folder=folder, proc=proc, model=model,
        rendering=rendering(config), grid=grid, size=size, templates=templates,
        forward=functools.partial(forward, config), forward_from=False, generates=False,
        answer_words=prompts.answer_ids(proc.tokenizer, answers),
        position_basis=position_basis,
        **hf_vlm.patch_square(config.grid),
    )  # fmt: skip
