"""jaxmech against the authors' spatial-ID derivation (paper 003, Fig. 5 and the universal
IDs their steering reads), run unmodified by `tests/fixtures/authors/
make_authors_reference.py`: `tile_two_objects.py` (object A at one cell of a 4 x 4 grid
of 224 px cells, object B at every other cell: 240 canvases of 896 px, transparent
converted to RGB, so black), `compute_id.py` (B's word state per canvas, centred over
the canvases of one A cell, then averaged over A cells), `average_id.py` (over pairs:
one here), `compute_axes.py`; on `llava_336` (`llava-7b`), stored in `spatial_ids.npz`,
and on `qwen2vl_28` (`qwen2-2b`, Qwen2-VL: `make_authors_qwen2_vl.py`), stored in
`spatial_ids_qwen2.npz`.

Tolerance: each word state is a float32 forward of both codes (family fixtures: 1e-4;
the IDs are differences of states of size ~1, so the same bound): 1e-4 absolute + 1e-4
relative on the universal IDs and the axes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
AUTHORS = os.path.join(HERE, "fixtures", "authors")
LLAVA = os.path.join(AUTHORS, "llava_336")
QWEN2 = os.path.join(AUTHORS, "qwen2vl_28")  # their `qwen2-2b` (make_authors_qwen2_vl.py)
FILES = ("spatial_ids.npz", "spatial_ids_qwen2.npz")  # LLaVA's, Qwen2-VL's
COMMIT = "1c034d6ecbe1494c450d412f52fdf98e4a4c51c2"
CELL = 224


def reference(name: str = "spatial_ids.npz") -> dict:
    ref = np.load(os.path.join(AUTHORS, name))
    assert str(ref["commit"]) == COMMIT
    return {k: ref[k] for k in ref.files}


@pytest.mark.parametrize("name", FILES)
def test_their_axes_are_their_mean_differences_of_universal_ids(name):
    """Their stored axes follow from their stored IDs as `compute_axes.py` defines them
    (x: the mean over rows and column pairs x1 <= x2 of ID(x2) - ID(x1), y likewise), and
    the IDs are centred (their per-A-cell centring: each cell's IDs sum to ~0 over the
    cells once averaged)."""
    ref = reference(name)
    u = ref["universal_LxCxD"].reshape(len(ref["layers"]), 4, 4, -1)  # [L, row y, col x, D]
    pairs = [(a, b) for a in range(3) for b in range(a, 4)]
    x_axis = np.mean([u[:, r, b] - u[:, r, a] for r in range(4) for a, b in pairs], 0)
    y_axis = np.mean([u[:, b, c] - u[:, a, c] for c in range(4) for a, b in pairs], 0)
    np.testing.assert_allclose(x_axis, ref["x_axis_LxD"], atol=1e-6)
    np.testing.assert_allclose(y_axis, ref["y_axis_LxD"], atol=1e-6)
    assert np.abs(ref["universal_LxCxD"].sum(1)).max() < 1e-5
    assert np.abs(ref["universal_LxCxD"][16]).max() > 1e-2  # not all zeros


def canvas(a_img, b_img, a_cell, b_cell):
    """Their probe: a transparent 4 x 4-cell canvas with A and B (resized to the cell by
    Lanczos) pasted at their cells' corners through their alpha, as RGB."""
    from PIL import Image

    out = Image.new("RGBA", (4 * CELL, 4 * CELL), (0, 0, 0, 0))
    for img, (x, y) in ((a_img, a_cell), (b_img, b_cell)):
        obj = img.resize((CELL, CELL), Image.LANCZOS)
        out.paste(obj, (x * CELL, y * CELL), obj)
    return out.convert("RGB")


def their_ids_by_jaxmech(folder, P, ref, layers, chunk=15, **load) -> np.ndarray:
    """jaxmech's forward (family processor module `P`, `load`: its `load_processor`
    options) on their 240 canvases and their query, the state of the word's first piece
    `ref["word"]` at `lm/resid_pre.L` (their `hidden_states[L]`; L = the LM's depth:
    `lm/final`), centred per A cell and averaged over A cells as their `compute_id.py`
    does -> [len(layers), 16, D], float64. `chunk`: canvases per forward."""
    import jax
    import jax.numpy as jnp
    from PIL import Image

    import jaxmech

    model = jaxmech.load(folder, dtype=jnp.float32)
    proc = P.load_processor(folder, model.config, **load)
    a_img, b_img = (Image.open(os.path.join(AUTHORS, "objects", f"{n}.png"))
                    for n in ref["objects"])  # fmt: skip
    word = proc.tokenizer.token_to_id(str(ref["word"]))
    depth = int(ref["layers"][-1])
    sites = [f"lm/resid_pre.{y}" if y < depth else "lm/final" for y in layers]

    @jax.jit
    def states(inputs, pos_B):
        _, aux = model.forward(inputs, capture=sites)
        return jnp.stack([aux[s][jnp.arange(pos_B.shape[0]), pos_B] for s in sites], 1)

    cells = [tuple(c) for c in ref["cells_Cx2"].tolist()]  # (x column, y row)
    total = None
    for a in cells:
        b_cells = [c for c in cells if c != a]
        parts = []
        for i in range(0, len(b_cells), chunk):
            images = [canvas(a_img, b_img, a, b) for b in b_cells[i : i + chunk]]
            enc = P.encode(proc, images, [str(ref["query"])] * len(images))
            tokens = np.asarray(enc.inputs.tokens_BxS)
            pos = np.array([np.flatnonzero(row == word)[0] for row in tokens])
            parts.append(np.asarray(states(enc.inputs, pos), np.float64))
        s_BxYxD = np.concatenate(parts)
        if total is None:
            total = np.zeros((len(layers), len(cells), s_BxYxD.shape[-1]))
        centred = s_BxYxD - s_BxYxD.mean(0)
        for i, b in enumerate(b_cells):
            total[:, cells.index(b)] += centred[i]
    return total / (len(cells) - 1)  # every B cell is in 15 of the 16 A cells' sets


@pytest.mark.slow
def test_universal_ids_equal_their_derivation_on_their_canvases():
    """jaxmech's forward on their 240 canvases and their prompt (llava-hf's chat
    template: "USER: <image>\\nIs frog to the left or right of camel? ASSISTANT:",
    photographs resized by Pillow as their transformers 4.53's slow processor), the
    state of the word's first "▁frog" at `lm/resid_pre.L` (their `hidden_states[L]`;
    L = 32: `lm/final`), centred and averaged as their derivation does, equals their
    universal IDs at layers 1, 16 and 32, and so their axes. Slow: 240 forwards of the
    32-block model (~1 min on 2 busy cores)."""
    from jaxmech.families.llava import processor as P

    ref = reference()
    layers = (1, 16, 32)
    ids = their_ids_by_jaxmech(LLAVA, P, ref, layers, resize="pil")
    want = ref["universal_LxCxD"][[list(ref["layers"]).index(y) for y in layers]]
    np.testing.assert_allclose(ids, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_qwen2_vl_universal_ids_equal_their_derivation():
    """The same on Qwen2-VL (their `qwen2-2b`, `qwen2vl_28`: 28 LM blocks, their
    `range(29)`): their prompt is the processor's chat template (the default system
    turn, <|vision_start|><|image_pad|>*1024<|vision_end|>, the query, the assistant's
    turn), which is jaxmech's `chat_prompt`; the 896 px canvases are multiples of 28,
    so neither code resizes them; the word's piece is "Ġfrog". Equal at layers 0, 1,
    14, 27 and 28 (`lm/final`). Slow: 240 forwards of 1055 tokens, 28 blocks, and a
    ViT over 4096 patches (10.5 min on 2 cores at load ~8)."""
    from jaxmech.families.qwen2_vl import processor as P

    ref = reference("spatial_ids_qwen2.npz")
    assert str(ref["word"]) == "Ġfrog" and int(ref["layers"][-1]) == 28
    layers = (0, 1, 14, 27, 28)
    ids = their_ids_by_jaxmech(QWEN2, P, ref, layers, chunk=5)
    want = ref["universal_LxCxD"][[list(ref["layers"]).index(y) for y in layers]]
    np.testing.assert_allclose(ids, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FILES)
def test_grid_axes_of_their_ids_equal_their_axes(name):
    """jaxmech's axes of their universal IDs under the authors' protocol
    (`grid_axes(authors=True)`: every pair of cells) equal their axes at every layer;
    jaxmech's own (the mean one-cell step) do not (a check that the comparison can fail)."""
    from jaxmech.analysis.spatial_ids import grid_axes

    ref = reference(name)
    x_axis, y_axis = grid_axes(ref["universal_LxCxD"], 4, 4, authors=True)
    np.testing.assert_allclose(np.asarray(x_axis), ref["x_axis_LxD"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(y_axis), ref["y_axis_LxD"], atol=1e-4, rtol=1e-4)
    own, _ = grid_axes(ref["universal_LxCxD"], 4, 4)
    assert not np.allclose(np.asarray(own), ref["x_axis_LxD"], atol=1e-4, rtol=1e-4)
