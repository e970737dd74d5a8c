"""The toy VLM's VLM view (`families.vlm_view`): scene specs rendered as its cell
attributes and one-token question words, and its forward, sites and positions.

One image token per cell (I = L, cell order), then the 8 question tokens `[is, X, A,
or, B, of, Y, ?]`: X's word at L + 1, Y's at L + 6, the answer read at the `?`. The ViT
positions are the cells' (row, col) (`static/cell_rows`, `cell_cols`; in a video the
rows are 0 and the frames reach the LM only through its position ids).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmech.config import Config
from jaxmech.data.spec import Grid, SceneSpec
from jaxmech.data.tasks import scenes as sc
from jaxmech.families.toy_vlm import model
from jaxmech.families.toy_vlm import vit as vit2d
from jaxmech.families.toy_vlm.loss import ANSWER_WORDS
from jaxmech.families.vlm_view import Spans, VLMView


def spans(grid: Grid, batch: int) -> Spans:
    """Where the parts of `batch` rendered scenes sit (module docstring)."""
    L, Q = grid.cells, sc.Q_LEN
    S = L + Q
    cells = np.arange(L, dtype=np.int32)
    trc = np.stack([np.zeros(L, np.int32), cells // grid.w, cells % grid.w], 1)
    full = lambda v: np.full(batch, v, np.int32)  # noqa: E731
    return Spans(
        image_BxI=np.broadcast_to(cells, (batch, L)),
        image_trc_Ix3=trc,
        cell_I=cells,
        x_B=full(L + sc.X_SLOT),
        y_B=full(L + sc.Y_SLOT),
        question_BxS=np.broadcast_to(np.arange(S) >= L, (batch, S)),
        answer_B=full(S - 1),
    )


def forward(params, inputs: sc.SceneBatch, edits=None, capture: bool = False):
    """(logits [B, V] at the `?`, intermediates: whole with `capture`)."""
    return model.forward(
        params,
        inputs.labels_BxL,
        inputs.colours_BxL,
        inputs.facings_BxL,
        inputs.question_BxQ,
        edits=edits,
        capture=capture,
    )


def vit_positions(params, grid: Grid):
    """(rows [L], cols [L], (H, W)): the positions each cell's ViT token sees, and the
    rows and columns it sees them in. A video's ViT sees each frame alone as one row
    (`cell_frames`): H is 1 there, not the grid's frames, so a row mirror (H - 1 - row)
    is the identity, as the ViT's view of it is, and not a jump to a row it never saw."""
    h = 1 if "cell_frames" in params["static"] else grid.h  # a key: static under jit
    return vit2d.read(params, "cell_rows"), vit2d.read(params, "cell_cols"), (h, grid.w)


def vit_blocks(params) -> int:
    """The ViT blocks whose positions can be set one at a time: every block of a rope2d
    ViT (its rotation acts in each), none for position codes added at the input."""
    return vit2d.n_vit_blocks(params) if vit2d.position_kind(params) == "rope2d" else 0


def position_basis(params) -> jnp.ndarray:
    """[L, F] the ViT's position features of each cell: the row and column codes side
    by side (learned2d, sincos2d), or cos / sin of every rotary angle (rope2d)."""
    rows, cols = vit2d.read(params, "cell_rows"), vit2d.read(params, "cell_cols")
    if vit2d.position_kind(params) == "rope2d":
        ids = jnp.stack([rows, cols])
        angles = vit2d.rotary_angles(
            ids, vit2d.read(params, "vit_rope_freqs"), vit2d.read(params, "vit_rope_axis")
        )
        return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=1)
    row, col = vit2d.position_parts(params, rows, cols)
    return jnp.concatenate([row, col], axis=1)


def toy_view(config: Config) -> VLMView:
    """The view of toy VLMs trained on `config`'s task."""
    task = config.task
    grid = sc.grid_of(task)

    def render(specs: SceneSpec, ask=None):
        inputs, b = sc.render(task, specs), np.asarray(specs.relation_B).shape[0]
        if ask is not None:  # the questions of `ask` (the toy's never name colours)
            inputs = inputs._replace(question_BxQ=sc.render(task, ask).question_BxQ)
        return inputs, spans(grid, b)

    return VLMView(
        name="toy_vlm",
        grid=grid,
        n_labels=task.n_labels,
        n_colours=task.n_colours,
        render=render,
        forward=forward,
        answer_words=ANSWER_WORDS,
        n_lm_blocks=model.n_lm_blocks,
        lm_position_ids=lambda params, sp: model.lm_position_ids(params, sp.length - grid.cells),
        vit_positions=lambda params: vit_positions(params, grid),
        vit_blocks=vit_blocks,
        position_basis=position_basis,
    )
