"""InternVL photographs tiled as the reference's processor tiles them
(`families.internvl.view`): the view's forward on a tiled photograph is the family's on
the processor's tiled encoding, its spans hold every tile's and the thumbnail's image
tokens, photographs of different tile layouts land in different batches, the ViT code
mirrors act in every tile and the position basis is refused by name. The tiny random fixture (56 px
tiles); ~3 s."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

import jaxmech
from jaxmech.analysis import counterfactuals as cfa
from jaxmech.analysis import spatial_ids as si
from jaxmech.data.datasets.questions import ImageQuestion, QuestionSet
from jaxmech.data.inputs.pixels import read_image
from jaxmech.families import hf_vlm
from jaxmech.families.internvl import encode, model, processor

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "internvl")
FOLDER = os.path.join(HERE, "internvl")
PHOTO = os.path.join(HERE, "tiled0.png")  # 112 x 56: 2 x 1 tiles and the thumbnail
Q = "Is the red circle to the left or the right of the blue square?"
WORDS = ("circle", "square")


@pytest.fixture(scope="module")
def tiled():
    m = jaxmech.load(FOLDER)
    view = m.view((2, 2), 56)
    image = read_image(PHOTO)
    grid = view.image_grid(*image.shape[:2])
    inputs, spans = view.at_image_grid(grid).render_images([image], [Q], [WORDS])
    return m, view, grid, inputs, spans


def test_a_tiled_photograph_is_the_processors_tiled_encoding(tiled):
    """The view's rendered photograph is the processor's own (reference-default, tiled)
    encoding: the same tokens, ids, image positions and, decoded, the same pixels (the
    contract test ties that encoding to the reference)."""
    m, view, grid, inputs, _ = tiled
    assert grid == (3, 8, 16) and inputs.pixels_BxTxPxF.shape[1] == 3
    proc = processor.load_processor(FOLDER, m.config)
    enc = encode.encode(proc, [PHOTO], [Q])
    for field in ("tokens_BxS", "pos_BxS", "image_BxI", "valid_BxS"):
        np.testing.assert_array_equal(np.asarray(getattr(inputs, field)),
                                      np.asarray(getattr(enc.inputs, field)))  # fmt: skip
    decode = hf_vlm.patch_decoder(processor, proc, "pixels_BxTxPxF")  # the view's first step
    px = decode(inputs).pixels_BxTxPxF
    np.testing.assert_array_equal(np.asarray(px), enc.inputs.pixels_BxTxPxF)


@pytest.mark.slow
def test_a_tiled_photographs_forward_is_the_familys(tiled):
    """The view's answer logits equal `model.forward`'s last row on the processor's
    tiled encoding (~7 s: two compilations)."""
    m, view, _, inputs, _ = tiled
    enc = encode.encode(processor.load_processor(FOLDER, m.config), [PHOTO], [Q])
    want = model.forward(m.params, enc.inputs, config=m.config)[0][:, -1]
    np.testing.assert_allclose(np.asarray(view.forward(m.params, inputs)[0]), want, atol=1e-5)


def test_spans_hold_every_tiles_image_tokens(tiled):
    """Every <IMG_CONTEXT> token is an image token (3 tiles x 16), in the LM's order,
    each (tile, row, col) once; the left tile's tokens lie in the left cells, the
    right's in the right, the thumbnail's in all four equally; the object words and the
    answer sit where the text-only prompt puts them (the same suffix)."""
    m, view, _, inputs, sp = tiled
    tokens = np.asarray(inputs.tokens_BxS)[0]
    image = np.flatnonzero(tokens == m.config.image_token_id)
    np.testing.assert_array_equal(np.asarray(sp.image_BxI)[0], image)
    trc, cell = np.asarray(sp.image_trc_Ix3), np.asarray(sp.cell_I)
    assert len(image) == 48 and len({tuple(t) for t in trc.tolist()}) == 48
    assert trc[:, 0].tolist() == sorted(trc[:, 0].tolist()) and set(trc[:, 0]) == {0, 1, 2}
    assert set(cell[trc[:, 0] == 0] % 2) == {0} and set(cell[trc[:, 0] == 1] % 2) == {1}
    assert np.bincount(cell[trc[:, 0] == 2]).tolist() == [4, 4, 4, 4]
    _, text = view.render_text([Q], [WORDS])
    for field in ("x_B", "y_B"):
        assert (getattr(sp, field) - sp.answer_B).tolist() == (
            getattr(text, field) - text.answer_B
        ).tolist()


def _png(array) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_tile_layouts_do_not_share_a_batch(tiled):
    """A 2 x 1 photograph and a one-tile one (56 px square) are two batches, each keyed
    by its processed grid, each rendered with its own tiles."""
    from jaxmech.reports.batches import photo_batches

    _, view, grid, _, _ = tiled
    rng = np.random.default_rng(0)
    wide, square = read_image(PHOTO), rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)
    qs = tuple(ImageQuestion(_png(a), None, ("left", "right"), WORDS, "left", None, f"t:{i}")
               for i, a in enumerate((wide, square, wide)))  # fmt: skip
    out = photo_batches(view, QuestionSet("test", qs, {}, {}), (0,))
    assert [b.key["image_grid"] for b in out] == [list(grid), [1, 8, 8]]
    assert [b.index.tolist() for b in out] == [[0, 2], [1]]
    assert [b.examples.inputs.pixels_BxTxPxF.shape[:2] for b in out] == [(2, 3), (1, 1)]


def test_what_is_not_the_pictures_across_tiles_is_refused(tiled):
    """A bucket of several tiles refuses the position basis (the spatial IDs' cells) by
    name; its ViT code mirrors are one tile's, in every tile (the ViT sees each tile
    alone); a one-tile bucket keeps both."""
    m, view, grid, _, sp = tiled
    bucket = view.at_image_grid(grid)
    cf = cfa.build(bucket, m.params, sp, names=("plain", "vit_w"), photo=True)
    rows, cols, (h, w) = view.vit_positions(m.params)
    np.testing.assert_array_equal(np.asarray(cf.vit_cols[1]), w - 1 - np.asarray(cols))
    np.testing.assert_array_equal(np.asarray(cf.vit_cols[0]), np.asarray(cols))
    with pytest.raises(ValueError, match="position_basis: .*tiles"):
        si.cell_basis(bucket, m.params, sp)
    one = view.at_image_grid((1, 8, 8))
    assert one.vit_positions(m.params)[2] == (8, 8) and one.at_image_grid(grid).image_grid
