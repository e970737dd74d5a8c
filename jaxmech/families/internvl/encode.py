"""Batches for the InternVL forward: images and questions through the processor
(`processor.py`) into `model.Inputs`, and where each part landed (`spans`).

A batch holds images of one tile grid (the reference concatenates any; one compiled
shape here): a batch whose images tile differently is refused, naming the grids.
Text-only batches (`encode_text`) have no tiles and no image tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxmech.data.inputs import prompts
from jaxmech.families import hf_vlm
from jaxmech.families.internvl import positions
from jaxmech.families.internvl.model import Inputs
from jaxmech.families.internvl.processor import (
    CONTEXT,
    PAD,
    TAIL,
    Processor,
    chat_prompt,
    patches,
)
from jaxmech.families.vlm_view import Spans
from jaxmech.models.positions import text_ids


class Encoded(NamedTuple):
    """A batch ready for `model.forward`, with what `spans` needs: the prompts (image
    tokens expanded), each token's character offsets [B, S, 2] (-1 at padding), the
    question's character range in each prompt [B, 2]; the tile grid (cols, rows) of
    its images, the tiles per image (with the thumbnail), patches per tile side, the
    patch size."""

    inputs: Inputs
    prompts: list
    offsets_BxSx2: np.ndarray
    question_Bx2: np.ndarray
    grid: tuple
    n_tiles: int
    side: int
    patch_size: int

    def describe(self) -> str:
        """One line for logs: the tiles, the image tokens and the tokens."""
        cols, rows = self.grid
        tile = self.side * self.patch_size
        thumb = " + thumbnail" if self.n_tiles > cols * rows else ""
        return (f"{self.n_tiles} tile(s) of {tile} px ({cols} x {rows}{thumb}), "
                f"{self.inputs.image_BxI.shape[1]} image tokens, "
                f"{self.inputs.tokens_BxS.shape[1]} tokens")  # fmt: skip


def encode(proc: Processor, images, questions, codes: bool = False) -> Encoded:
    """Images (paths, PIL images or arrays) and one question each -> an `Encoded` batch
    (`codes`: its pixels as uint8 levels, `data.inputs.pixels.decode_pixels` before
    `model.forward`)."""
    prompts.check_batch(images, questions)
    out = [patches(im, proc.images, proc.config.patch_size, codes) for im in images]
    grids = sorted({g for _, g in out})
    if len(grids) > 1:
        raise ValueError(f"images: they tile differently (cols x rows {grids}); a batch holds "
                         "images of one tile grid")  # fmt: skip
    return _encode(proc, np.stack([p for p, _ in out]), out[0][1], questions)


def encode_text(proc: Processor, questions) -> Encoded:
    """Questions asked without an image (`chat_prompt(n_image=None)`) -> an `Encoded`
    batch with no tiles and no image tokens: the authors' text-only baseline."""
    prompts.check_batch(None, questions)
    side = proc.images.size // proc.config.patch_size
    px = np.zeros((len(questions), 0, side * side, proc.config.patch_features), np.uint8)
    return _encode(proc, px, (0, 0), questions)


def _encode(proc: Processor, pixels_BxTxPxF, grid, questions) -> Encoded:
    c = proc.config
    B, T, P, _ = pixels_BxTxPxF.shape
    n_image = T * P // 4
    texts, question_Bx2 = prompts.templated(
        questions, lambda q: chat_prompt(q, n_image if T else None), TAIL
    )
    rows = hf_vlm.padded_rows(proc.tokenizer, texts, PAD)
    context = proc.tokenizer.token_to_id(CONTEXT)
    image = [np.flatnonzero((r == context) & v) for r, v in zip(rows.tokens_BxS, rows.valid_BxS)]
    if any(len(i) != n_image for i in image):
        raise ValueError(f"questions: a question holds {CONTEXT} tokens of its own")
    inputs = Inputs(rows.tokens_BxS, pixels_BxTxPxF, text_ids(rows.valid_BxS),
                    np.stack(image).astype(np.int32).reshape(B, n_image), rows.valid_BxS)  # fmt: skip
    return Encoded(inputs, texts, rows.offsets_BxSx2, question_Bx2, grid, T,
                   positions.tile_side(P), c.patch_size)  # fmt: skip


def spans(enc: Encoded, words, cells=(1, 1)) -> Spans:
    """The VLM interface's `Spans` of a batch (tiled images, one tile, or none): every
    tile's image tokens, then the thumbnail's, in the LM's order; `image_trc_Ix3` each
    token's (tile, row, col in its tile); `words` each row's (first, second) object
    words as they appear in its question; `cells` the (rows, cols) of the scene grid
    that `cell_I` indexes (row-major), each token's cell by where it lies in the whole
    image (`token_cells`)."""
    if len(words) != len(enc.prompts):
        raise ValueError(f"words: {len(words)} pairs for {len(enc.prompts)} questions")
    xy = prompts.word_positions(enc.prompts, enc.question_Bx2, enc.offsets_BxSx2, words)
    trc, cell = token_cells(enc.grid, enc.n_tiles, enc.side, cells)
    question = prompts.question_mask(enc.offsets_BxSx2, enc.question_Bx2)
    return Spans(
        enc.inputs.image_BxI,
        trc,
        cell,
        xy[:, 0],
        xy[:, 1],
        question,
        np.full(len(xy), enc.offsets_BxSx2.shape[1] - 1, np.int32),
    )


def token_cells(grid, n_tiles: int, side: int, cells=(1, 1)):
    """(int32 [T I, 3] each image token's (tile, row, col in its tile), int32 [T I] the
    cell of the `cells` (rows, cols) grid it lies in) for images cut into `grid` (cols,
    rows) tiles of side x side patches (and the thumbnail where n_tiles exceeds them).
    The tiles cut the whole image resized (no crop) and the thumbnail is the whole image,
    so a token's place in the image is its place in the tile grid (or the thumbnail);
    its cell is the one that place falls in (one tile: the token grid split evenly)."""
    if not n_tiles:  # text only
        return np.zeros((0, 3), np.int32), np.zeros(0, np.int32)
    cols, rows = grid
    h = side // 2
    r, c = positions.token_grid(side)
    trc, cell = [], []
    for t in range(n_tiles):
        thumb = t == cols * rows  # the thumbnail: the whole image in one tile
        tr, tc = (0, 0) if thumb else divmod(t, cols)
        n_r, n_c = (h, h) if thumb else (rows * h, cols * h)  # tokens across the image
        gr, gc = tr * h + r, tc * h + c
        trc.append(np.stack([np.full_like(r, t), r, c], 1))
        cell.append((gr * cells[0] // n_r) * cells[1] + gc * cells[1] // n_c)
    return np.concatenate(trc).astype(np.int32), np.concatenate(cell).astype(np.int32)
