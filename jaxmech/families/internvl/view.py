"""An InternVL checkpoint's VLM view (`families.vlm_view`): scene specs drawn as pictures
(`data.inputs.pictures`), asked through the checkpoint's own processor, and its forward,
sites and positions.

One picture per scene, drawn at the tile size (`size` must equal the image processor's
tile, 448 for the -hf checkpoints): a square picture of one tile, which the
reference's default processor keeps whole (no resize, no tiling, no thumbnail), each
cell whole LM tokens (448 px: 32 x 32 patches, 16 x 16 tokens; a 4 x 4 grid's cell is 4
x 4 tokens). The view refuses other sizes by name.

Photographs (`render_images`) are tiled as the reference's processor tiles them, under
either wording (the question is asked exactly as the reference would show it): 1-12
tiles of the tile size and a thumbnail (`processor.tile_grid`). `image_grid(h, w)` is
(tiles with the thumbnail, rows x s, cols x s) patches, so photographs of different
tile layouts never share a batch; a token's `cell_I` is where it lies in the whole
photograph (`encode.token_cells`: the tiles cut the whole image resized, the
thumbnail is all of it), boxes map to cells by scaling. The ViT sees each tile
alone, so on a bucket of several tiles `vit_positions` (the counterfactuals' ViT code
mirrors) are one tile's, applied in every tile: `vit_w` mirrors the width codes within
each tile, as the model reads them (the picture's mirror also reverses the tiles'
order: that is `image_w`); and the LM-side mirrors (`order_w`, `lm_ids_w`) act within
each tile (`image_trc_Ix3`: tile, row, col in its tile). `position_basis` (a token's
place on the table, the spatial IDs' basis) is refused by name there (`at_image_grid`):
one place per tile is not the picture's.
`render_text`: the question without an image (the authors' text-only baseline).

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

from jaxmech.data.inputs import pictures, prompts
from jaxmech.data.spec import Grid
from jaxmech.families import hf_vlm
from jaxmech.families.internvl import encode, model, positions, processor
from jaxmech.families.internvl.config import InternVLConfig
from jaxmech.families.vlm_view import VLMView

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


RENDERING = hf_vlm.rendering(encode)


def position_basis(params, side: int) -> jnp.ndarray:
    """[I, 4E] each LM token's ViT position features: its four patches' table rows in
    the pixel shuffle's block order."""
    table = positions.resample_table(params["vit"]["pos"], side)
    return positions.pixel_shuffle(table.reshape(1, side * side, -1), side)[0]


def image_grid(proc: processor.Processor, height: int, width: int) -> tuple:
    """(T, rows s, cols s): the tiles a height x width photograph becomes (with the
    thumbnail) and the patches its tile grid spans (s per tile side)."""
    cols, rows = processor.tile_grid(height, width, proc.images)
    side = proc.images.size // proc.config.patch_size
    return processor.n_tiles(height, width, proc.images), rows * side, cols * side


def _refuse_tiles(grid: tuple, field: str):
    """A stand-in for the view's `field` on a bucket of several tiles: raises ValueError
    naming it, the tiles and the methods it would mislead, whatever it is called with."""

    def refuse(*args):
        raise ValueError(
            f"{field}: a photograph of {grid[0]} tiles (image_grid {tuple(grid)}): each tile "
            "reads the ViT's whole position table, so the spatial IDs' position basis is "
            "not the picture's across tiles; ask it on drawn scenes or one-tile photographs"
        )

    return refuse


def at_image_grid(view: VLMView, grid) -> VLMView:
    """`view` as photograph bucket `grid`'s (`image_grid`): itself for one tile; for
    several, its `position_basis` refused by name (module docstring)."""
    grid = tuple(int(g) for g in grid)
    bucket = view._replace(at_image_grid=functools.partial(at_image_grid, view))
    if grid[0] == 1:
        return bucket
    return bucket._replace(position_basis=_refuse_tiles(grid, "position_basis"))


def checkpoint_view(folder: str, config: InternVLConfig, grid: Grid = GRID, size: int | None = None,
                    video: bool = False, wording: str = "jaxmech") -> VLMView:  # fmt: skip
    """The view of the checkpoint in `folder` (module docstring), scenes drawn `size`
    pixels square (None: the processor's tile, the only size allowed). Raises ValueError
    naming `video`, `size`, `wording` or the tokenizer before any compute."""
    hf_vlm.refuse_video(video, "internvl")
    templates, answers = pictures.wording(wording)
    proc = processor.load_processor(folder, config)
    size = proc.images.size if size is None else size
    check_size(proc, grid, size)
    side = size // config.patch_size
    view = hf_vlm.decoder_view(
        "internvl", config=config, folder=folder, proc=proc, model=model, rendering=RENDERING,
        grid=grid, size=size, templates=templates,
        decode=hf_vlm.patch_decoder(processor, proc, "pixels_BxTxPxF"),
        answer_words=prompts.answer_ids(proc.tokenizer, answers),
        position_basis=lambda params: position_basis(params, side),
        vit_positions=(*positions.patch_grid(side), (side, side)),
        image_grid=functools.partial(image_grid, proc),
    )  # fmt: skip
    return view._replace(at_image_grid=functools.partial(at_image_grid, view))
