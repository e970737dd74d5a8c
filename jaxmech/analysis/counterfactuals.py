"""Seed 004's counterfactuals on the toy VLM (issue 15): which path decides a relation,
the content (facings), the ViT's position codes, or the LM's token order and ids?

Every counterfactual is data of one shape (`Counterfactual`): a permutation of the
image's cells and a facing flip applied to the examples, and overrides of the ViT's row
and column codes, the LM's position ids and the order in which image tokens enter the
LM, each at its identity when unchanged. A table of them is one vmap over stacked
`Counterfactual`s (`margins`), and a table over models one `lax.map` around it. In a
rope2d ViT the positions act in every block and are given per block, which adds the
localisation (`names_for`): `vit_w@b`, `vit_h@b` mirror the codes in block b only.

The names (`COUNTERFACTUALS`; _w: width, _h: height):

  plain              nothing changed
  image_w, image_h   the mirrored image (width: positions and facings; height: positions)
  pos_w              positions mirrored, facings kept
  facing             every facing flipped in place
  vit_w, vit_h       the ViT's column / row codes mirrored, pixels unchanged
  vit_half           the ViT's column codes shifted by half a cell (col + 0.5)
  lm_ids_w, lm_ids_h the image tokens' LM position ids mirrored
  order_w, order_h   the image tokens enter the LM in mirrored order
  facing_order_w     facings flipped and the token order mirrored (content and order,
                     not the position codes)
  facing_order_ids_w ... and the LM ids mirrored too

A model's answer under a counterfactual is read as the margin of the example's own
answer word over the other word of its relation (`models.answer.margin`): the sign says
which of the two it chose, so two counterfactuals agree when their margins have the
same sign.

Axis names (`jaxmech.shapes`): B examples, L cells, S LM tokens, C counterfactuals.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis.spatial_ids import X_SLOT, Y_SLOT
from jaxmech.config import TaskConfig
from jaxmech.data import scenes as sc
from jaxmech.models import ar_vlm, vit2d
from jaxmech.models.answer import logits, margin, partner
from jaxmech.models.edits import VLMEdits

# What each counterfactual changes: cells ("w" / "h" mirror), flip (facings), vit
# ("w" / "h" mirror of the column / row codes, "half": columns + 0.5), ids (the image
# tokens' LM position ids mirrored), order (the image tokens' order into the LM).
CHANGES = {
    "plain": {},
    "image_w": {"cells": "w", "flip": True},
    "image_h": {"cells": "h"},
    "pos_w": {"cells": "w"},
    "facing": {"flip": True},
    "vit_w": {"vit": "w"},
    "vit_h": {"vit": "h"},
    "vit_half": {"vit": "half"},
    "lm_ids_w": {"ids": "w"},
    "lm_ids_h": {"ids": "h"},
    "order_w": {"order": "w"},
    "order_h": {"order": "h"},
    "facing_order_w": {"flip": True, "order": "w"},
    "facing_order_ids_w": {"flip": True, "order": "w", "ids": "w"},
}
COUNTERFACTUALS = tuple(CHANGES)


def names_for(params) -> tuple[str, ...]:
    """`COUNTERFACTUALS`, and for a rope2d ViT (its positions act in every block) the
    ViT mirrors applied in one block at a time: `vit_w@b`, `vit_h@b` for block b."""
    if vit2d.position_kind(params) != "rope2d":
        return COUNTERFACTUALS
    blocks = range(vit2d.n_vit_blocks(params))
    return COUNTERFACTUALS + tuple(f"vit_{a}@{b}" for a in "wh" for b in blocks)


class Counterfactual(NamedTuple):
    """One counterfactual (or C stacked): what happens to the examples and the forward.

    cells [L] int: the image becomes `image[:, cells]` (a mirror permutation or the
    identity); flip_facing [] bool; vit_rows, vit_cols [L] (a rope2d ViT: [n_blocks,
    L]) float: the positions the ViT sees; lm_ids [3, S] float: the LM's position ids; order [L] int: the LM reads
    image token `order[i]` at image slot i.
    """

    cells: jax.Array
    flip_facing: jax.Array
    vit_rows: jax.Array
    vit_cols: jax.Array
    lm_ids: jax.Array
    order: jax.Array


def build(params, task: TaskConfig, names=COUNTERFACTUALS) -> Counterfactual:
    """The named counterfactuals stacked [C, ...] for one model's params (its default
    positions and LM ids; host NumPy in, jnp out)."""
    known = names_for(params)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown counterfactuals {unknown}; known: {', '.join(known)}")
    L = task.image_len
    ident = np.arange(L, dtype=np.int32)
    perm = {"w": sc.mirror_cells(task), "h": sc.height_mirror_cells(task)}
    rows = vit2d.read(params, "cell_rows")
    cols = vit2d.read(params, "cell_cols")
    ids = ar_vlm.lm_position_ids(params, sc.Q_LEN)  # [3, S]

    vit = {
        "w": (rows, task.grid_w - 1 - cols),
        "h": (task.grid_h - 1 - rows, cols),
        "half": (rows, cols + 0.5),
        None: (rows, cols),
    }

    rotary = vit2d.position_kind(params) == "rope2d"
    n_blocks = vit2d.n_vit_blocks(params)

    def positions(name):
        """(rows, cols) the ViT sees: [L], or [n_blocks, L] in a rope2d ViT."""
        if "@" not in name:
            vr, vc = vit[CHANGES[name].get("vit")]
            if not rotary:
                return vr, vc
            return jnp.tile(vr, (n_blocks, 1)), jnp.tile(vc, (n_blocks, 1))
        axis, block = name[4], int(name.split("@")[1])  # "vit_w@1"
        vr, vc = (jnp.tile(x, (n_blocks, 1)) for x in (rows, cols))
        mr, mc = vit[axis]
        return vr.at[block].set(mr), vc.at[block].set(mc)

    def one(name):
        c = CHANGES.get(name, {})
        pick = lambda key: ident if c.get(key) is None else perm[c[key]]  # noqa: E731
        vr, vc = positions(name)
        lm = ids if c.get("ids") is None else ids.at[:, :L].set(ids[:, perm[c["ids"]]])
        return Counterfactual(
            jnp.asarray(pick("cells")), jnp.asarray(c.get("flip", False)),
            jnp.asarray(vr, jnp.float32), jnp.asarray(vc, jnp.float32),
            jnp.asarray(lm, jnp.float32), jnp.asarray(pick("order")),
        )  # fmt: skip

    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *(one(n) for n in names))


def apply(batch: sc.SceneBatch, cf: Counterfactual) -> tuple[sc.SceneBatch, VLMEdits]:
    """The examples and edits of one counterfactual (answers left as the examples')."""
    take = lambda x: jnp.asarray(x)[:, cf.cells]  # noqa: E731
    moved = batch._replace(
        labels_BxL=take(batch.labels_BxL),
        colours_BxL=take(batch.colours_BxL),
        facings_BxL=take(batch.facings_BxL),
    )
    flipped = sc.flip_facing(moved).facings_BxL
    moved = moved._replace(facings_BxL=jnp.where(cf.flip_facing, flipped, moved.facings_BxL))
    edits = VLMEdits(
        vit_rows=cf.vit_rows, vit_cols=cf.vit_cols, lm_pos_ids=cf.lm_ids, image_order=cf.order
    )
    return moved, edits


def margins(params, batch: sc.SceneBatch, cfs: Counterfactual) -> jax.Array:
    """[C, B] the answer margin of every example under every counterfactual."""
    answer = jnp.asarray(batch.answer_B)

    def one(cf):
        moved, edits = apply(batch, cf)
        return margin(logits(params, moved, edits), answer)

    return jax.vmap(one)(cfs)


def swap_objects(batch: sc.SceneBatch) -> sc.SceneBatch:
    """The same scenes asked about the objects the other way round (`is Y ... of X ?`),
    answers the other word of the relation."""
    q = jnp.asarray(batch.question_BxQ)
    q = q.at[:, X_SLOT].set(q[:, Y_SLOT]).at[:, Y_SLOT].set(q[:, X_SLOT])
    return batch._replace(question_BxQ=q, answer_B=partner(jnp.asarray(batch.answer_B)))


def binding_failures(margin_B, swapped_margin_B) -> jax.Array:
    """[B] bool: the model names the same relation word whichever object is asked about
    (for `is X left of Y` and `is Y left of X` alike), from the two margins (each over
    its own question's answer word)."""
    return (margin_B > 0) != (swapped_margin_B > 0)
