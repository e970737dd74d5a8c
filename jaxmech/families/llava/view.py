"""A LLaVA-1.5 checkpoint's VLM view (`families.vlm_view`): scene specs drawn as pictures
(`data.inputs.pictures`), asked in the papers' wording through the checkpoint's own processor,
and its forward, sites and positions.

Pictures are drawn at the ViT's own size (config.json's `image_size`: 336 px for
LLaVA-1.5, 24 x 24 patches), which the processor keeps as it is (a square of the
shortest edge and the crop), and the scene grid must divide the patch grid (4 x 4: 6 x 6
patches per cell); other sizes are refused by name. Photographs all become that one size
(resize and centre crop, or pad to a square: `processor`), so `image_grid` is constant;
`image_frame(h, w)` gives the region of a photograph the processed image shows, through
which its boxes map onto the cells.

Positions (paper 004): the ViT's are a learned table added once at the input
(`vit_blocks` 0); `vit_positions` are each patch's (row, col) on the g x g grid, which
`Edits.vit_rows / vit_cols` replace (read bilinearly: `positions.table_at`; the CLS row
fixed), and `position_basis` is the table's row of each image token. The LM's are 1D
rotary ids, each row's real tokens counted from 0 (`lm_position_ids`: [B, 3, S], the
three rows equal, as `Edits.lm_pos_ids` takes them).

Answer words (`answer_words`): the first token of "Left" / "Right", "Above" / "Below",
"Yes" / "No" in the checkpoint's tokenizer, the word the model writes after
"ASSISTANT:"; `wording="authors"` asks in paper 003's authors' words
(`pictures.AUTHORS_TEMPLATES`, their chat-template scripts) and reads "left" /
"right" ... (`pictures.AUTHORS_ANSWERS`).

Axis names (`jaxmech.shapes`): B scenes, S LM tokens, P patches, I image tokens.
"""

from __future__ import annotations

import numpy as np

from jaxmech.data.inputs import pictures, prompts
from jaxmech.data.spec import Grid
from jaxmech.families import hf_vlm
from jaxmech.families.llava import model, processor
from jaxmech.families.llava.config import LlavaConfig
from jaxmech.families.vlm_view import VLMView

GRID = Grid(4, 4)  # LLaVA-1.5's 24 x 24 patches: 6 x 6 per cell


def check_size(config: LlavaConfig, proc: processor.Processor, grid: Grid, size: int) -> None:
    """Refuses (ValueError naming `size`) a picture size the processor would resize or
    cut (it keeps only the ViT's own, if any) or a grid whose cells are not whole
    patches."""
    f = processor.frame(size, size, proc.images)
    if size == config.image_size and (f.resized, f.top, f.left) != ((size, size), 0, 0):
        raise ValueError(f"size = {size}: the processor (preprocessor_config.json) resizes or "
                         "cuts even the ViT's own size, so no drawn scene reaches it as drawn")  # fmt: skip
    hf_vlm.check_drawn_size(size, config.image_size, "resizing or cutting")
    g = config.grid
    hf_vlm.check_cells(grid, g, f"the ViT's {g} x {g} patches", "patches")


# the wording of paper 003's patching scripts (`mirror_swapping.py`, `attribute_swapping.py`),
# which the patching report asks for under the authors' protocol (`family.py`'s
# `authors_wordings`): their prompt without a chat template, the bare answer pieces
MIRROR = processor.MIRROR
# the processor each authors' wording reads with: their transformers (4.53) loads
# llava-hf's slow `CLIPImageProcessor`, whose resize is Pillow's bicubic
AUTHORS_PROCESSOR = {"authors": {"resize": "pil"},
                     MIRROR: {"resize": "pil", "prompt": processor.MIRROR}}  # fmt: skip


def bare_answer_ids(tokenizer, answers) -> np.ndarray:
    """[R, 2] int32 the ids of the answer words as bare pieces ("left", not the prompt's
    "▁left"), as `mirror_swapping.py` reads them (`convert_tokens_to_ids("left")`); a word
    the vocabulary has no bare piece of: its first token in context
    (`prompts.answer_ids`)."""
    fallback = prompts.answer_ids(tokenizer, answers)
    ids = [[tokenizer.token_to_id(w) for w in pair] for pair in answers]
    return np.asarray([[f if i is None else i for i, f in zip(row, back)]
                       for row, back in zip(ids, fallback)], np.int32)  # fmt: skip


RENDERING = hf_vlm.rendering(processor)


def checkpoint_view(folder: str, config: LlavaConfig, grid: Grid = GRID, size: int | None = None,
                    video: bool = False, wording: str = "jaxmech") -> VLMView:  # fmt: skip
    """The view of the checkpoint in `folder` (its tokenizer and image settings), with
    scenes on `grid` drawn `size` pixels square (None: the ViT's image size, the only
    one allowed). `wording` "authors": the papers' authors' words and lower-case answer
    words, photographs resized by Pillow (`AUTHORS_PROCESSOR`); `MIRROR`: their patching
    scripts' prompt and bare answer pieces. Raises ValueError naming `size`, `grid`,
    `video`, `wording` or the tokenizer before any compute."""
    hf_vlm.refuse_video(video, "llava", " (one image per question)")
    mirror = wording == MIRROR
    templates, answers = pictures.wording("authors" if mirror else wording)
    size = config.image_size if size is None else size
    proc = processor.load_processor(folder, config, **AUTHORS_PROCESSOR.get(wording, {}))
    check_size(config, proc, grid, size)
    return hf_vlm.decoder_view(
        "llava", config=config, folder=folder, proc=proc, model=model, rendering=RENDERING,
        grid=grid, size=size, templates=templates,
        decode=hf_vlm.patch_decoder(processor, proc),
        answer_words=(bare_answer_ids if mirror else prompts.answer_ids)(proc.tokenizer, answers),
        position_basis=lambda params: params["vit"]["pos"][1:],
        **hf_vlm.patch_square(config.grid),
        image_frame=lambda height, width: processor.frame(height, width, proc.images).window(),
    )  # fmt: skip
