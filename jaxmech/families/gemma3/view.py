"""A Gemma-3 checkpoint's VLM view (`families.vlm_view`): scene specs drawn as pictures
(`data.pictures`), asked in the papers' wording through the checkpoint's own processor,
and its forward, sites and positions.

Pictures are drawn at the ViT's own size (config.json's `image_size`: 896 px for
gemma-3, 64 x 64 patches pooled to 16 x 16 image tokens), which the processor keeps as
it is; the scene grid must divide the image-token grid (4 x 4: 4 x 4 tokens per cell at
gemma-3's size); other sizes are refused by name. Photographs all become that one size
(resized, no crop), so `image_grid` is constant and `image_frame` is the whole
photograph.

Positions (paper 004): SigLIP's are a learned table added once at the input
(`vit_blocks` 0); `vit_positions` are each patch's (row, col) on the g x g grid, which
`Edits.vit_rows / vit_cols` replace (read bilinearly: `positions.table_at`), and
`position_basis` is each image token's pooled patches' table rows
(`positions.position_basis`). The LM's are 1-D rotary ids, each row's real tokens
counted from 0 (`lm_position_ids`: [B, 3, S], the three rows equal).

Answer words (`answer_words`): the first token of "Left" / "Right", "Above" / "Below",
"Yes" / "No" in the checkpoint's tokenizer; `wording="authors"` asks in paper 003's
authors' words and reads "left" / "right" ....

Axis names (`jaxmech.shapes`): B scenes, S LM tokens, P patches, I image tokens.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxmech.data import pictures, prompts
from jaxmech.data.pixels import decoded
from jaxmech.data.spec import Grid, SceneSpec
from jaxmech.families.gemma3 import model, positions, processor
from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.families.vlm_view import VLMView, generate_rendered, one_image_grid, placed
from jaxmech.models.decoder import RESUME_SITES, answer_forward
from jaxmech.models.positions import view_ids

GRID = Grid(4, 4)  # gemma-3's 16 x 16 image tokens: 4 x 4 per cell


def check_size(config: Gemma3Config, grid: Grid, size: int) -> None:
    """Refuses (ValueError naming `size` or `grid`) a picture size the processor would
    resize, or a grid whose cells are not whole image tokens."""
    if size != config.image_size:
        raise ValueError(f"size = {size}: the processor makes every picture {config.image_size} "
                         f"x {config.image_size} px (the ViT's size), resizing others; draw at "
                         f"size = {config.image_size}")  # fmt: skip
    t = config.token_grid
    if t % grid.h or t % grid.w:
        raise ValueError(f"grid = {grid.h} x {grid.w}: must divide the {t} x {t} image tokens "
                         "(each cell whole pooled tokens)")  # fmt: skip


def _placed(enc, words, grid: Grid):
    """(Inputs on the device, Spans) of an encoded batch whose object words are `words`."""
    return placed(enc.inputs, processor.spans(enc, words, cells=(grid.h, grid.w)))


def render(proc: processor.Processor, grid: Grid, size: int, specs: SceneSpec, ask=None,
           templates=pictures.TEMPLATES):  # fmt: skip
    """(Inputs, Spans) of `specs` drawn and asked (`pictures.asked`); `ask`: the specs
    whose questions are asked (default `specs`')."""
    return render_images(proc, grid, *pictures.asked(grid, specs, size, ask, templates))


def render_images(proc: processor.Processor, grid: Grid, images, questions, words):
    """(Inputs, Spans) of photographs asked `questions`, their object words `words`."""
    enc = processor.encode(proc, list(images), list(questions), codes=True)
    return _placed(enc, [tuple(w) for w in words], grid)


def render_text(proc: processor.Processor, grid: Grid, questions, words):
    """(Inputs, Spans) of `questions` asked without an image (`processor.encode_text`)."""
    enc = processor.encode_text(proc, list(questions))
    return _placed(enc, [tuple(w) for w in words], grid)


def decode(config: Gemma3Config, table, inputs):
    """Rendered `inputs` with their uint8 pixel levels normalised by `table`
    (`data.pixels.decoded`), as `forward` reads them."""
    return decoded(inputs, "pixels_BxPxF", table, config.patch_size**2)


def forward(config: Gemma3Config, table, params, inputs, edits=None, capture=False,
            resume=None):  # fmt: skip
    """(logits [B, V] at the last token, intermediates): `model.forward` at the answer
    row (`models.decoder.answer_forward`), rendered uint8 levels normalised by `table`
    first (`decode`)."""
    return answer_forward(functools.partial(model.forward, config=config), config.lm_layers,
                          params, decode(config, table, inputs), edits, capture, resume)  # fmt: skip


def forward_from(config: Gemma3Config, table, params, inputs, layer, start, x_BxTxD, aux):
    """The answer's logits [B, V] of a run resumed at LM block `layer` (`model.Resume`)."""
    resume = model.Resume(layer, start, x_BxTxD, aux)
    return forward(config, table, params, inputs, resume=resume)[0]


def vit_positions(config: Gemma3Config):
    """(rows [P], cols [P], (g, g)): each patch's (row, col) in the position table."""
    rows, cols = positions.patch_grid(config.grid)
    return rows, cols, (config.grid, config.grid)


def checkpoint_view(folder: str, config: Gemma3Config, grid: Grid = GRID, size: int | None = None,
                    video: bool = False, wording: str = "jaxmech") -> VLMView:  # fmt: skip
    """The view of the checkpoint in `folder` (its tokenizer and image settings), with
    scenes on `grid` drawn `size` pixels square (None: the ViT's image size, the only
    one allowed). Raises ValueError naming `size`, `grid`, `video`, `wording` or the
    tokenizer before any compute."""
    if video:
        raise ValueError("video = True: the gemma3 family has no video view (one image per "
                         "question)")  # fmt: skip
    templates, answers = pictures.wording(wording)
    size = config.image_size if size is None else size
    check_size(config, grid, size)
    proc = processor.load_processor(folder, config)
    table = processor.pixel_table(proc.images)
    decoder = functools.partial(decode, config, table)  # a rendered batch as the model reads it
    g = config.grid
    view = VLMView(
        name="gemma3",
        grid=grid,
        n_labels=len(pictures.SHAPES),
        n_colours=len(pictures.COLOURS),
        render=functools.partial(render, proc, grid, size, templates=templates),
        forward=functools.partial(forward, config, table),
        answer_words=prompts.answer_ids(proc.tokenizer, answers),
        n_lm_blocks=lambda params: config.lm_layers,
        lm_position_ids=lambda params, spans: view_ids(
            spans.first_B, *np.shape(spans.question_BxS)
        ),
        vit_positions=lambda params: vit_positions(config),
        vit_blocks=lambda params: 0,
        position_basis=lambda params: positions.position_basis(params, config),
        forward_from=functools.partial(forward_from, config, table),
        generate=functools.partial(generate_rendered, model.decoding, config, folder, decoder),
        resume_any_layer=True,
        cache_sites=RESUME_SITES,
        render_images=functools.partial(render_images, proc, grid),
        render_text=functools.partial(render_text, proc, grid),
        image_grid=lambda height, width: (1, g, g),
        image_frame=lambda height, width: (0.0, 0.0, float(height), float(width)),
        size=size,
    )
    return one_image_grid(view)
