"""An InternVL checkpoint's VLM view (`families.vlm_view`): scene specs drawn as pictures
(`data.pictures`), asked through the checkpoint's own processor, and its forward,
sites and positions.

One picture per scene, drawn at the tile size (`size` must equal the image processor's
tile, 448 for the -hf checkpoints): a square picture of one tile, which the
reference's default processor keeps whole (no resize, no tiling, no thumbnail), each
cell whole LM tokens (448 px: 32 x 32 patches, 16 x 16 tokens; a 4 x 4 grid's cell is 4
x 4 tokens). The view refuses other sizes by name.

Photographs (`render_images`) are squashed to one tile (the processor with
`tiles=False`; the reference's default would tile them, up to 12 tiles and a
thumbnail): every photograph is then one 448 x 448 token grid (`image_grid` is the same
for every size, so the reports hold them in one batch) and a box maps to cells by
scaling. `render_text`: the question without an image (the authors' text-only
baseline).

Positions, as the paper 004 methods read them: `vit_positions` are the (row, col) each
patch of the tile reads on the learned position table (s x s, s = size / patch), patches
row-major, so a mirror is s - 1 - col (a permutation of the table's columns, the CLS
row fixed) and a half-cell shift interpolates the table (`models.positions.read_table`);
`vit_blocks` is 0 (positions enter once). `image_trc_Ix3` are the LM tokens' (0, row,
col) on the (s / 2) x (s / 2) token grid in the LM's order; each token packs the 2 x 2
patches (2 row + m, 2 col + k) in channel block 2m + k (`positions`), so a token-order
mirror (`image_order`, the counterfactuals' order_w) moves whole tokens and keeps each
token's blocks as packed, where the picture's mirror (image_w) also swaps them.
`position_basis` is each LM token's four patches' table rows side by side in that
block order: the pixel shuffle of the table. `lm_position_ids` are the 1-D rotary ids
(each row's real tokens counted from 0) as [B, 3, S], three equal rows.

`generate`: greedy replies to a rendered batch (`vlm_view.generate_rendered`, the
folder's end-of-sequence ids), what the authors' steering judges.

Answer words as the Qwen view's: the first token of "Left" / "Right", "Above" /
"Below", "Yes" / "No" (jaxmech's wording), or of "left" / "right" ... (`wording=
"authors"`, their prompt 'Answer "left" or "right" only.').

Axis names (`jaxmech.shapes`): B scenes, S LM tokens, P patches, I LM image tokens.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxmech.data import pictures, prompts
from jaxmech.data.pixels import decoded
from jaxmech.data.spec import Grid, SceneSpec
from jaxmech.families.internvl import encode, model, positions, processor
from jaxmech.families.internvl.config import InternVLConfig
from jaxmech.families.vlm_view import VLMView, generate_rendered, one_image_grid, placed
from jaxmech.models.decoder import RESUME_SITES, answer_forward
from jaxmech.models.positions import view_ids

GRID = Grid(4, 4)


def check_size(proc: processor.Processor, grid: Grid, size: int) -> None:
    """Refuses (ValueError naming `size`) a picture that is not one whole tile, or whose
    cells are not whole LM tokens."""
    tile, patch = proc.images.size, proc.config.patch_size
    if size != tile:
        raise ValueError(f"size = {size}: expected the tile size {tile} (a picture of one "
                         "tile, which the processor keeps as it is)")  # fmt: skip
    tokens = size // patch // 2
    if tokens % grid.h or tokens % grid.w:
        raise ValueError(f"size = {size}: its {tokens} x {tokens} LM tokens do not split "
                         f"into the grid's {grid.h} x {grid.w} cells")  # fmt: skip


def _placed(enc, words, grid: Grid):
    """(Inputs on the device, Spans) of an encoded batch whose object words are `words`."""
    return placed(enc.inputs, encode.spans(enc, words, cells=(grid.h, grid.w)))


def render(proc, grid: Grid, size: int, specs: SceneSpec, ask=None, templates=pictures.TEMPLATES):
    """(Inputs, Spans) of `specs` drawn and asked (`pictures.asked`); `ask`: the specs
    whose questions are asked (default `specs`'), so a twin keeps its example's question."""
    return render_images(proc, grid, *pictures.asked(grid, specs, size, ask, templates))


def render_images(proc, grid: Grid, images, questions, words):
    """(Inputs, Spans) of photographs asked `questions`, their object words `words`
    [(X, Y)]; `proc` squashes each to one tile."""
    enc = encode.encode(proc, list(images), list(questions), codes=True)
    return _placed(enc, [tuple(w) for w in words], grid)


def render_text(proc, grid: Grid, questions, words):
    """(Inputs, Spans) of `questions` asked without an image (`encode.encode_text`)."""
    enc = encode.encode_text(proc, list(questions))
    return _placed(enc, [tuple(w) for w in words], grid)


def decode(config: InternVLConfig, table, inputs):
    """Rendered `inputs` with their uint8 pixel levels normalised by `table`
    (`data.pixels.decoded`), as `forward` reads them."""
    return decoded(inputs, "pixels_BxTxPxF", table, config.patch_size**2)


def forward(config: InternVLConfig, table, params, inputs, edits=None, capture=False,
            resume=None):  # fmt: skip
    """(logits [B, V] at the last token, intermediates): `model.forward` at the answer
    row (`models.decoder.answer_forward`), uint8 pixel levels normalised by `table`
    first (`decode`)."""
    return answer_forward(functools.partial(model.forward, config=config), config.lm_layers,
                          params, decode(config, table, inputs), edits, capture, resume)  # fmt: skip


def forward_from(config: InternVLConfig, table, params, inputs, layer, start, x_BxTxD, aux):
    """The answer's logits [B, V] of a run resumed at LM block `layer` (`model.Resume`)."""
    resume = model.Resume(layer, start, x_BxTxD, aux)
    return forward(config, table, params, inputs, resume=resume)[0]


def position_basis(params, side: int) -> jnp.ndarray:
    """[I, 4E] each LM token's ViT position features: its four patches' table rows in
    the pixel shuffle's block order."""
    table = positions.resample_table(params["vit"]["pos"], side)
    return positions.pixel_shuffle(table.reshape(1, side * side, -1), side)[0]


def checkpoint_view(folder: str, config: InternVLConfig, grid: Grid = GRID, size: int | None = None,
                    video: bool = False, wording: str = "jaxmech") -> VLMView:  # fmt: skip
    """The view of the checkpoint in `folder` (module docstring), scenes drawn `size`
    pixels square (None: the processor's tile, the only size allowed). Raises ValueError
    naming `video`, `size`, `wording` or the tokenizer before any compute."""
    if video:
        raise ValueError("video = True: the internvl family has no video view")
    templates, answers = pictures.wording(wording)
    proc = processor.load_processor(folder, config)
    size = proc.images.size if size is None else size
    check_size(proc, grid, size)
    words = prompts.answer_ids(proc.tokenizer, answers)
    side = size // config.patch_size
    table = processor.pixel_table(proc.images)
    decoder = functools.partial(decode, config, table)  # a rendered batch as the model reads it
    one_tile = proc._replace(images=proc.images._replace(tiles=False))
    rows, cols = positions.patch_grid(side)
    view = VLMView(
        name="internvl",
        grid=grid,
        n_labels=len(pictures.SHAPES),
        n_colours=len(pictures.COLOURS),
        render=functools.partial(render, proc, grid, size, templates=templates),
        forward=functools.partial(forward, config, table),
        answer_words=words,
        n_lm_blocks=lambda params: config.lm_layers,
        lm_position_ids=lambda params, spans: view_ids(
            spans.first_B, *np.shape(spans.question_BxS)
        ),
        vit_positions=lambda params: (rows, cols, (side, side)),
        vit_blocks=lambda params: 0,
        position_basis=lambda params: position_basis(params, side),
        forward_from=functools.partial(forward_from, config, table),
        resume_any_layer=True,
        cache_sites=RESUME_SITES,
        generate=functools.partial(generate_rendered, model.decoding, config, folder, decoder),
        render_images=functools.partial(render_images, one_tile, grid),
        render_text=functools.partial(render_text, proc, grid),
        image_grid=lambda height, width: (1, side, side),
        size=size,
    )
    return one_image_grid(view)  # one tile: every photograph's grid the same
