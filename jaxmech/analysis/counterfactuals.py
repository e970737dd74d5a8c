"""Paper 004's counterfactuals, for any VLM family: which path decides a
relation, the content (facings), the ViT's position codes, or the LM's token order and
ids?

Every counterfactual is data of one shape (`Counterfactual`): which version of the
scenes it shows (`SCENES`: plain, mirrored, positions mirrored with facings kept,
facings flipped; specs transformed by `data.spec` and rendered by the family), and
overrides of the ViT's row and column positions, the LM's position ids and the order
in which image tokens enter the LM, each at its identity when unchanged. A table of
them is one vmap over stacked `Counterfactual`s (`margins`), and a table over models
one `lax.map` around it. Where the ViT's positions act in every block (rotary), they
are given per block, which adds the localisation (`names_for`): `vit_w@b`, `vit_h@b`
mirror the positions in block b only. Where they also enter once through a learned
table read at the ViT's input (`VLMView.vit_table`: Qwen3-VL), the table is one more
place (row 0 of the positions), and each mechanism is mirrored alone (`TABLE_CHANGES`):
`vit_w` / `vit_h` mirror both, `vit_w_table` / `vit_h_table` the table only,
`vit_w_rotary` / `vit_h_rotary` every block's rotary only, `vit_w@b` block b's rotary
only, and `vit_half_table` shifts the table's columns by half a patch (read between its
cells: a real change, where a uniform rotary shift cancels). A family enters only
through its VLM view.

The names (`COUNTERFACTUALS`; _w: width, _h: height):

  plain              nothing changed
  image_w, image_h   the mirrored image (width: positions and facings; height: positions)
  pos_w              positions mirrored, facings kept
  facing             every facing flipped in place
  vit_w, vit_h       the ViT's column / row codes mirrored, pixels unchanged
  vit_half           the ViT's column codes shifted by half a cell (col + 0.5)
  vit_half_mirror    ... mirrored and offset by half a cell (W - 1 - col + 0.5)
  vit_half_roll      ... rolled by half the width, wrapping around ((col + W / 2) mod W)
                     (paper 004's "half-cell shift" is ambiguous: these are its
                     candidates; under rotary positions a uniform shift of every
                     column cancels in q . k, so there vit_half is the plain run and
                     vit_half_mirror is vit_w exactly; only vit_half_roll differs)
  lm_ids_w, lm_ids_h the image tokens' LM position ids mirrored (content in place)
  order_w, order_h   the image content moved to the mirrored slots, each slot keeping
                     its own position ids: slot (r, c) holds the content of (r, W-1-c)
                     with the ids of (r, c); relative to the content, both the order
                     the causal LM reads it in and its M-RoPE ids are mirrored
  order_ids_w, _h    the content moved together with its ids: slot (r, c) holds the
                     content and the ids of (r, W-1-c), so every content token keeps
                     its own position ids and only the reading order is mirrored
  facing_order_w     facings flipped and order_w (content and order, not the ViT's
                     position codes)
  facing_order_ids_w facings flipped and order_ids_w

On a photograph (no facings to flip, no scene to redraw: `PHOTO_CHANGES`) the content
is flipped by flipping the image, so paper 004's "content and token order flipped,
position codes not" is the flipped photograph with the ViT's codes mirrored back: the
ViT sees each patch's (flipped) content at its own position code and the LM reads the
tokens in mirrored order, ids staying with the slots, as order_w's. On a drawn scene
that is facing_order_w already (equal on the toy, tested), so the photograph's keeps
the name; its height version facing_order_h (the photograph flipped upside down, the
row codes mirrored back) is on a drawn scene order_h (nothing in a drawn scene turns
upside down), so only a photograph's table has it:

  facing_order_w     (photograph) image_w with vit_w: content and order flipped across
                     the width, the column codes not
  facing_order_h     (photograph) image_h with vit_h: the same across the height
  order_random_k     (photograph) the k-th seeded random order of the image tokens
                     (`RANDOM_ORDERS`; content moved, ids with the slots), read by
                     paper 004's post-hoc rows: `mirror_landing`, `order_reversed`

Paper 004's post-hoc "back to the original answer" (`back_to_original`, `RETURN_OF`)
reads facing_order_w / _h beside the image mirrors: of the answers the flipped
photograph changed, the share the same flip with the ViT's codes mirrored back returns
to the plain answer (codes decide: back; content and order decide: not).

Each relation's reference (`MIRROR_OF`, paper 004's "the flipped image's answer"): the
width mirror swaps left / right, the height mirror above / below and, as the paper's
What'sUp rows have it, on / under (the supported object ends up below); no image mirror
swaps front / behind (depth is not a direction in the image plane), so it has no
reference, and its rows report only the share changed from the plain run's.

A model's answer under a counterfactual is read as the margin of the example's own
answer word over the other word of its relation (`families.vlm_view.margin`): the sign
says which of the two it chose, so two counterfactuals agree when their margins have
the same sign.

Axis names (`jaxmech.shapes`): B examples, I image tokens, P ViT tokens, S LM tokens,
C counterfactuals.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.data import spec as sp
from jaxmech.data.spec import SceneSpec
from jaxmech.families.vlm_view import Spans, VLMView, margin
from jaxmech.models.edits import Edits

# What each counterfactual changes: cells ("w" / "h" mirror), flip (facings), vit
# ("w" / "h" mirror of the column / row positions, "half": columns + 0.5, "half_mirror":
# W - 1 - col + 0.5, "half_roll": (col + W / 2) mod W), ids (the
# image tokens' LM position ids mirrored), order (the image tokens' order into the LM;
# position ids stay with the slots, so "order" with "ids" moves the ids with the content).
CHANGES = {
    "plain": {},
    "image_w": {"cells": "w", "flip": True},
    "image_h": {"cells": "h"},
    "pos_w": {"cells": "w"},
    "facing": {"flip": True},
    "vit_w": {"vit": "w"},
    "vit_h": {"vit": "h"},
    "vit_half": {"vit": "half"},
    "vit_half_mirror": {"vit": "half_mirror"},
    "vit_half_roll": {"vit": "half_roll"},
    "lm_ids_w": {"ids": "w"},
    "lm_ids_h": {"ids": "h"},
    "order_w": {"order": "w"},
    "order_h": {"order": "h"},
    "order_ids_w": {"order": "w", "ids": "w"},
    "order_ids_h": {"order": "h", "ids": "h"},
    "facing_order_w": {"flip": True, "order": "w"},
    "facing_order_ids_w": {"flip": True, "order": "w", "ids": "w"},
}
COUNTERFACTUALS = tuple(CHANGES)
# On a photograph (module docstring): the flipped image with the ViT's codes mirrored
# back is its "content and order flipped" (a drawn scene flips facings instead);
# facing_order_h is a photograph's only (on a drawn scene it is order_h).
PHOTO_CHANGES = {
    "facing_order_w": {"cells": "w", "flip": True, "vit": "w"},
    "facing_order_h": {"cells": "h", "vit": "h"},
}
# With a position table beside the rotary (`VLMView.vit_table`): which mechanism a ViT
# change reaches ("table", "rotary"; the names of `CHANGES` reach both).
TABLE_CHANGES = {
    "vit_w_table": {"vit": "w", "at": "table"},
    "vit_h_table": {"vit": "h", "at": "table"},
    "vit_w_rotary": {"vit": "w", "at": "rotary"},
    "vit_h_rotary": {"vit": "h", "at": "rotary"},
    "vit_half_table": {"vit": "half", "at": "table"},
}
# Paper 004's post-hoc rows read seeded random orders of the image tokens (content
# moved, each slot keeping its ids, as order_w); a photograph's table only, beside the
# dataset's boxes and relation words they are read with (`order_reversed`, `mirror_landing`)
RANDOM_ORDERS = tuple(f"order_random_{k}" for k in range(4))
# relation -> the counterfactual whose answers are its reference (the image mirror that
# swaps it), None where none does (module docstring)
MIRROR_OF = {"horizontal": "image_w", "vertical": "image_h", "on_under": "image_h",
             "front_behind": None}  # fmt: skip
# relation -> the photograph's content-and-order-flipped condition on its mirror's axis
# (`PHOTO_CHANGES`), read by the post-hoc "back to the original answer" (`back_to_original`)
RETURN_OF = {"horizontal": "facing_order_w", "vertical": "facing_order_h",
             "on_under": "facing_order_h", "front_behind": None}  # fmt: skip
MIRROR_WORDS = {
    "image_w": "width mirror (image_w): it swaps the relation; agree = equal to its answers",
    "image_h": "height mirror (image_h): it swaps the relation; agree = equal to its answers",
    None: "no image mirror swaps it: no reference (agree empty); changed vs the plain run",
}
# The versions of the scenes a counterfactual shows: (cells, flip) -> index.
SCENES = ((None, False), ("w", True), ("h", False), ("w", False), (None, True))


def changes_of(name: str, photo: bool = False) -> dict:
    """What counterfactual `name` changes (`CHANGES`, `TABLE_CHANGES`; a photograph's
    own recipe where `PHOTO_CHANGES` has one); {} for a per-block ViT mirror."""
    if photo and name in PHOTO_CHANGES:
        return PHOTO_CHANGES[name]
    return CHANGES.get(name) or TABLE_CHANGES.get(name, {})


def names_for(view: VLMView, params, per_block: bool = True, photo: bool = False
              ) -> tuple[str, ...]:  # fmt: skip
    """`COUNTERFACTUALS` (for a `photo`, also facing_order_h and `RANDOM_ORDERS`); with a
    position table beside rotary ViT positions, `TABLE_CHANGES` (each mechanism alone); and where the ViT's positions act in every
    block (rotary) and `per_block`, the ViT mirrors applied in one block at a time:
    `vit_w@b`, `vit_h@b` for block b (2 per block: 64 rows at Qwen2-VL's 32 blocks,
    which is why a checkpoint's table asks for them by name, `--per_block`)."""
    n_blocks = view.vit_blocks(params)
    table = tuple(TABLE_CHANGES) if n_blocks and view.vit_table else ()
    blocks = range(n_blocks if per_block else 0)
    own = ("facing_order_h",) + RANDOM_ORDERS if photo else ()
    return COUNTERFACTUALS + own + table + tuple(f"vit_{a}@{b}" for a in "wh" for b in blocks)


class Counterfactual(NamedTuple):
    """One counterfactual (or C stacked): what happens to the examples and the forward.

    scene [] int: the version of the scenes shown (`SCENES`); vit_rows, vit_cols [P]
    (per block: [n_blocks, P]; with a position table [1 + n_blocks, P]) float: the
    positions the ViT sees; lm_ids [3, S] (or [B, 3, S] where rows are left-padded)
    float: the LM's position ids; order [I] int: the LM reads image token `order[i]`
    at image slot i.
    """

    scene: jax.Array
    vit_rows: jax.Array
    vit_cols: jax.Array
    lm_ids: jax.Array
    order: jax.Array


def scene_versions(grid: sp.Grid, spec: SceneSpec) -> list[SceneSpec]:
    """The examples in every version of `SCENES` (render each, stack, hand to `margins`)."""
    move = {None: lambda s: s, "w": lambda s: sp.mirror_pos(grid, s)}
    move["h"] = lambda s: sp.mirror_height(grid, s)
    return [(sp.flip_facing if flip else lambda s: s)(move[c](spec)) for c, flip in SCENES]


def token_mirrors(spans: Spans) -> dict:
    """{"w", "h": [I]} the image token at the mirrored (row, col) of each image token in
    the token grid (`Spans.image_trc_Ix3`)."""
    trc = np.asarray(spans.image_trc_Ix3)
    h, w = trc[:, 1].max() + 1, trc[:, 2].max() + 1
    index = {tuple(x): i for i, x in enumerate(trc.tolist())}
    flip = {"w": lambda t, r, c: (t, r, w - 1 - c), "h": lambda t, r, c: (t, h - 1 - r, c)}
    return {a: np.asarray([index[f(*x)] for x in trc.tolist()], np.int32) for a, f in flip.items()}


def _vit_positions(view: VLMView, params, name: str, photo: bool = False):
    """(rows, cols) the ViT sees under counterfactual `name` (`changes_of`): [P], or one
    row per place positions enter: [n_blocks, P], or [1 + n_blocks, P] with a table (row 0)."""
    rows, cols, (h, w) = view.vit_positions(params)
    mirrored = {"w": (rows, w - 1 - cols), "h": (h - 1 - rows, cols), "half": (rows, cols + 0.5)}
    mirrored["half_mirror"] = (rows, w - 1 - cols + 0.5)
    mirrored["half_roll"] = (rows, jnp.mod(cols + w / 2, w))
    mirrored[None] = (rows, cols)
    n_blocks = view.vit_blocks(params)
    table = int(bool(n_blocks and view.vit_table))
    at = np.ones(table + n_blocks, bool)  # the places the change reaches
    if "@" in name:  # "vit_w@1": block 1's rotary only
        change = name[4]
        at = np.arange(table + n_blocks) == table + int(name.split("@")[1])
    else:
        c = changes_of(name, photo)
        change = c.get("vit")
        at[:table] = c.get("at") != "rotary"
        at[table:] = c.get("at") != "table"
    vr, vc = mirrored[change]
    if not n_blocks:
        return vr, vc
    return tuple(jnp.where(at[:, None], m, x) for m, x in ((vr, rows), (vc, cols)))


def scene_of(name: str, photo: bool = False) -> int:
    """The index in `SCENES` of the scene version counterfactual `name` shows (on a
    photograph where `photo`)."""
    c = changes_of(name, photo)  # a per-block ViT mirror ("vit_w@3") shows the plain scene
    return SCENES.index((c.get("cells"), c.get("flip", False)))


def build(view: VLMView, params, spans: Spans, names=COUNTERFACTUALS, photo: bool = False
          ) -> Counterfactual:  # fmt: skip
    """The named counterfactuals stacked [C, ...] for one model's params (its default
    positions and LM ids) and the examples' spans (host NumPy in, jnp out); `photo`:
    the examples are photographs (`PHOTO_CHANGES`' recipes)."""
    known = names_for(view, params, photo=photo)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown counterfactuals {unknown}; known: {', '.join(known)}")
    perm = token_mirrors(spans)
    ident = np.arange(len(spans.cell_I), dtype=np.int32)
    ids = jnp.asarray(view.lm_position_ids(params, spans))  # [3, S], or [B, 3, S]
    # the image tokens' positions: one row for all ([3, S] ids), or per left-padded row
    image = np.asarray(spans.image_BxI)[0 if ids.ndim == 2 else slice(None)]

    def mirrored_ids(axis):
        def row(ids_3xS, image_I):
            return ids_3xS.at[:, image_I].set(ids_3xS[:, image_I[perm[axis]]])

        return row(ids, image) if ids.ndim == 2 else jax.vmap(row)(ids, jnp.asarray(image))

    def one(name):
        c = changes_of(name, photo)
        vr, vc = _vit_positions(view, params, name, photo)
        lm = ids
        if c.get("ids") is not None:
            lm = mirrored_ids(c["ids"])
        order = ident if c.get("order") is None else perm[c["order"]]
        if name in RANDOM_ORDERS:
            order = random_order(len(ident), RANDOM_ORDERS.index(name))
        return Counterfactual(
            jnp.asarray(scene_of(name, photo)),
            jnp.asarray(vr, jnp.float32), jnp.asarray(vc, jnp.float32),
            jnp.asarray(lm, jnp.float32), jnp.asarray(order),
        )  # fmt: skip

    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *(one(n) for n in names))


def random_order(n_tokens: int, k: int, seed: int = 0) -> np.ndarray:
    """[I] the k-th seeded random order of `n_tokens` image tokens (`RANDOM_ORDERS`)."""
    return np.random.default_rng([seed, 41, k]).permutation(n_tokens).astype(np.int32)


def edits_of(cf: Counterfactual) -> Edits:
    """The forward's edits of one counterfactual (its scene is chosen by the caller)."""
    return Edits(vit_rows=cf.vit_rows, vit_cols=cf.vit_cols, lm_pos_ids=cf.lm_ids,
                 image_order=cf.order)  # fmt: skip


def margins(view: VLMView, params, versions, answer_B, other_B, cfs: Counterfactual,
            batch_size: int | None = None, words=None):  # fmt: skip
    """[C, B] the answer margin of every example under every counterfactual; `versions`:
    the rendered `scene_versions` stacked (leading axis: `SCENES`). One vmap over the
    counterfactuals, or a `lax.map` of `batch_size` at a time (a large model's memory).
    With `words` [W] token ids: ([C, B], [C, B, W] their logits at the answer)."""

    def one(cf):
        inputs = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[cf.scene], versions)
        logits = view.forward(params, inputs, edits_of(cf))[0]
        m = margin(logits, answer_B, other_B)
        return m if words is None else (m, logits[:, jnp.asarray(words)])

    if batch_size is None:
        return jax.vmap(one)(cfs)
    return jax.lax.map(one, cfs, batch_size=batch_size)


def binding_failures(margin_B, swapped_margin_B) -> jax.Array:
    """[B] bool: the model names the same relation word whichever object is asked about
    (for `is X left of Y` and `is Y left of X` alike), from the two margins (each over
    its own question's answer word)."""
    return (margin_B > 0) != (swapped_margin_B > 0)


def order_reversed(spans: Spans, cells_Bx2, orders_RxI) -> np.ndarray:
    """[R, B] float: 1 where order r (the LM reads token `order[s]` at slot s) puts X's
    cell and Y's (`cells_Bx2`, -1: no box) the other way round from the plain order, 0
    where it keeps them, NaN where a cell is unknown or both are one cell. An object
    sits where its cell's tokens are read on average (a cell holds several tokens)."""
    cell_I = np.asarray(spans.cell_I)
    slot_RxI = np.argsort(np.asarray(orders_RxI), axis=1)  # where each token is read
    plain = np.arange(len(cell_I))
    out = np.full((len(slot_RxI), len(cells_Bx2)), np.nan)
    for b, (x, y) in enumerate(np.asarray(cells_Bx2)):
        tx, ty = cell_I == x, cell_I == y
        if x < 0 or y < 0 or x == y or not (tx.any() and ty.any()):
            continue
        after = slot_RxI[:, tx].mean(1) > slot_RxI[:, ty].mean(1)
        out[:, b] = after != (plain[tx].mean() > plain[ty].mean())
    return out


def mirror_landing(words_CxWxB, pair_B, rows) -> tuple[np.ndarray, np.ndarray]:
    """([B] changed answers, [B] of them on the mirror word) over the conditions `rows`
    (the random orders), answers read as the argmax over W relation words in pairs
    (word w's mirror is w ^ 1; row 0 the plain run): counted where the plain answer is
    a word of the question's own pair `pair_B` (paper 004's post-hoc (a))."""
    says = np.argmax(np.asarray(words_CxWxB), axis=1)  # [C, B]
    plain = says[0]
    own = plain // 2 == np.asarray(pair_B)
    moved = says[list(rows)]  # [R, B]
    changed = (moved != plain) & own
    return changed.sum(0), (changed & (moved == (plain ^ 1))).sum(0)


def back_to_original(plain_B, mirror_B, flipped_B) -> tuple[np.ndarray, np.ndarray]:
    """([B] back, [B] counted): paper 004's post-hoc (c), "back to the original answer".
    Counted: the questions whose answer the relation's image mirror changed (`mirror_B`
    != `plain_B`, each bool: chose the question's own answer word); back: of them, those
    whose answer under the content-and-order-flipped condition of the same axis
    (`flipped_B`: `RETURN_OF`) is the plain one again, the ViT's codes mirrored back
    having undone the flip. Over every question instead it would be 1 - changed."""
    plain, mirror, flipped = (np.asarray(x, bool) for x in (plain_B, mirror_B, flipped_B))
    counted = mirror != plain
    return (counted & (flipped == plain)).astype(int), counted.astype(int)


def pooled_ci(hits_B, counts_B, seed: int = 0, draws: int = 2000, minus=None):
    """(sum hits / sum counts, 95% interval, n = sum counts): a share pooled over
    questions whose units (a question's random orders) are not independent, so the
    interval resamples questions (seeded). `minus` (hits, counts) of a second group on
    the same questions: the difference of the two shares instead (n: the units of both;
    0 where either group has none)."""
    h, c = np.asarray(hits_B, float), np.asarray(counts_B, float)
    h2, c2 = (np.zeros_like(h), np.zeros_like(c)) if minus is None else map(np.asarray, minus)
    keep = (c + c2) > 0  # a question with no unit in either group weighs nothing
    h, c, h2, c2 = h[keep], c[keep], h2[keep], c2[keep]
    # a difference needs both groups: one empty is no number (n = 0), never a 0.0
    n = int(c.sum() + c2.sum()) if minus is None or min(c.sum(), c2.sum()) > 0 else 0

    def share(i):  # [..., B'] question indices -> the pooled share (or difference)
        with np.errstate(invalid="ignore", divide="ignore"):
            a = h[i].sum(-1) / c[i].sum(-1)
            return a if minus is None else a - h2[i].sum(-1) / c2[i].sum(-1)

    m = float(share(np.arange(len(c)))) if n else float("nan")
    if not np.isfinite(m) or len(c) < 2:
        return m, float("nan"), float("nan"), n
    draws_ = share(np.random.default_rng([seed, 95]).integers(0, len(c), (draws, len(c))))
    lo, hi = np.nanquantile(draws_, [0.025, 0.975])
    return m, float(lo), float(hi), n
