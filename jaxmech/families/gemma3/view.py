"""A Gemma-3 checkpoint's VLM view (`families.vlm_view`): scene specs drawn as pictures
(`data.inputs.pictures`), asked in the papers' wording through the checkpoint's own processor,
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

from jaxmech.data.inputs import pictures, prompts
from jaxmech.data.spec import Grid
from jaxmech.families import hf_vlm
from jaxmech.families.gemma3 import model, positions, processor
from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.families.vlm_view import VLMView

GRID = Grid(4, 4)  # gemma-3's 16 x 16 image tokens: 4 x 4 per cell
RENDERING = hf_vlm.rendering(processor)


def check_size(config: Gemma3Config, grid: Grid, size: int) -> None:
    """Refuses (ValueError naming `size` or `grid`) a picture size the processor would
    resize, or a grid whose cells are not whole image tokens."""
    hf_vlm.check_drawn_size(size, config.image_size)
    t = config.token_grid
    hf_vlm.check_cells(grid, t, f"the {t} x {t} image tokens", "pooled tokens")


def checkpoint_view(folder: str, config: Gemma3Config, grid: Grid = GRID, size: int | None = None,
                    video: bool = False, wording: str = "jaxmech") -> VLMView:  # fmt: skip
    """The view of the checkpoint in `folder` (its tokenizer and image settings), with
    scenes on `grid` drawn `size` pixels square (None: the ViT's image size, the only
    one allowed). Raises ValueError naming `size`, `grid`, `video`, `wording` or the
    tokenizer before any compute."""
    hf_vlm.refuse_video(video, "gemma3", " (one image per question)")
    templates, answers = pictures.wording(wording)
    size = config.image_size if size is None else size
    check_size(config, grid, size)
    proc = processor.load_processor(folder, config)
    return hf_vlm.decoder_view(
        "gemma3", config=config, folder=folder, proc=proc, model=model, rendering=RENDERING,
        grid=grid, size=size, templates=templates,
        decode=hf_vlm.patch_decoder(processor, proc),
        answer_words=prompts.answer_ids(proc.tokenizer, answers),
        position_basis=lambda params: positions.position_basis(params, config),
        **hf_vlm.patch_square(config.grid),
        image_frame=lambda height, width: (0.0, 0.0, float(height), float(width)),
    )  # fmt: skip
