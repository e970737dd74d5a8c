"""A part's stacked blocks (`models.layout.BLOCKS`) run under one `jax.lax.scan`, with
its edits and captures still per site name.

Why: an unrolled stack compiles every block apart (28 LM blocks at Qwen2-VL-2B's size,
once more per resumed run of a patching table); a scan compiles one block body however
many blocks run.

Inside the scan body a block names its sites with `LAYER` in place of its index
(`"lm/resid_pre.*"`), and `LayerSites` stands for the forward's `Sites`:

* an edit named for layer l (`Edits.replace` / `Edits.add` at `"lm/resid_pre.3"`) is
  applied as `where(i == l, edited, x)`, i the scanned layer, so its value is the
  unrolled forward's at layer l and nothing elsewhere;
* a capture of every scanned layer of a point is a scan output [L, ...]; a capture of
  some layers keeps a buffer of those layers only, written at them (a big site such as
  `pattern` is never stacked over layers nobody asked for); both come back in
  `Sites.aux` under the per-layer names.

Low-precision weights on a CPU are held as `layout.Rows` (one array a block,
`held_apart`) and scan all the same, each step's block picked by a `lax.switch`
(`block_row`); only stacked low-precision leaves on a CPU run unrolled (`in_place`).

The ViTs keep one subtree `block_{i}` per block (the authors' fine-tune trains some
blocks' leaves, `train_only` patterns selecting whole leaves); `run_blocks` scans them
all the same, reading each leaf's per-block arrays as `layout.Rows` through the switch
(`block_stack`: nothing copied but the running block).

Axis names (`jaxmech.shapes`): L scanned blocks, K captured layers of one point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.models import layout
from jaxmech.models.edits import apply_named
from jaxmech.models.order import low_precision

LAYER = "*"  # a block's index in its site names inside a scan body

# what a scanned block keeps for the backward (`scan_blocks(remat=)`; a config's `remat`,
# `families.fields.TextFields`): "off" everything its VJP reads (its activations and,
# for blocks read by a switch, a copy of each block's weights); "full" its input alone,
# the block run again in the backward; "dots" also its products without batch axes
# (x W, not attention's q k), the rest run again
REMAT = {
    "off": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy(remat: str):
    """`REMAT[remat]` (None: no remat); a ValueError naming `remat` if unknown."""
    if remat not in REMAT:
        raise ValueError(f"remat = {remat!r}: expected one of {', '.join(map(repr, REMAT))}")
    return REMAT[remat]


def remat_of(site) -> str:
    """The `REMAT` name a forward's sites ask of its scans (`models.decoder.Sites`'s
    `remat`; "off" for a recorder without one)."""
    return getattr(site, "remat", "off")


def edited_at(site, name: str) -> bool:
    """Whether a forward's site recorder (`models.decoder.Sites`, `LayerSites`, ...)
    has an edit at site `name`; a recorder that cannot say is taken to (so a block that
    would compute an unedited point another way computes it as named)."""
    ask = getattr(site, "edits_at", None)
    return True if ask is None else bool(ask(name))


def captured_at(site, name: str) -> bool:
    """Whether a forward's site recorder captures site `name` (one that cannot say: it
    does)."""
    ask = getattr(site, "captures", None)
    return True if ask is None else bool(ask(name))


def _split(name: str) -> tuple[str, str]:
    base, _, layer = name.rpartition(".")
    return base, layer


class LayerSites:
    """A scan body's sites for layer `i` (traced): the edits of `outer` (the forward's
    `Sites`) by layer index; captured values put in `keep` (points every layer of
    which is kept) or written into `bufs` ({point: [K, ...]} at `layers_of[point]`).
    `shapes` (a dict) records each point's value instead (the shape pass)."""

    def __init__(self, outer, i, edited: dict, every: frozenset, layers_of: dict, bufs,
                 shapes=None):  # fmt: skip
        self.outer, self.i, self.edited = outer, i, edited
        self.every, self.layers_of, self.bufs = every, layers_of, dict(bufs or {})
        self.keep, self.shapes = {}, shapes

    # whether some scanned layer edits / captures this point (the shape pass records
    # every point: it does)
    def edits_at(self, name: str) -> bool:
        return self.shapes is not None or _split(name)[0] in self.edited

    def captures(self, name: str) -> bool:
        base = _split(name)[0]
        return self.shapes is not None or base in self.every or base in self.layers_of

    def __call__(self, name: str, x):
        base, layer = _split(name)
        if layer != LAYER:
            raise ValueError(f"site {name!r} in a scanned block: expected the layer {LAYER!r}")
        if self.shapes is not None:
            self.shapes[base] = x
            return x
        edits = self.outer.edits
        for lay in self.edited.get(base, ()):
            x = jnp.where(
                self.i == lay, apply_named(edits.replace, edits.add, f"{base}.{lay}", x), x
            )
        if base in self.every:
            self.keep[base] = x
        for k, lay in enumerate(self.layers_of.get(base, ())):
            buf = self.bufs[base]
            self.bufs[base] = buf.at[k].set(jnp.where(self.i == lay, x.astype(buf.dtype), buf[k]))
        return x


def in_place(stacked) -> bool:
    """Whether a scan can read these block weights one block at a time. Stacked
    low-precision leaves on XLA's CPU backend cannot (`held_apart`): it runs a bf16 /
    f16 dynamic slice in float32, converting the whole stacked leaf before the loop
    (every block's float32 copy at once; seen in the compiled HLO, with or without
    `models.order.tie`; slicing the bits as uint16 makes a whole copy of them instead):
    those blocks run unrolled (`models.decoder.stack`). Leaves held as `layout.Rows`
    can: a step picks its block's arrays by a switch (`block_row`), copying that block alone
    (at Qwen2-VL-2B in bf16 the forward's time unchanged, 9.09 vs 9.03 s unrolled, its
    compile 1.8 s instead of 8.3)."""
    if has_rows(stacked):
        return True
    return jax.default_backend() != "cpu" or not low_precision(stacked)


def has_rows(tree) -> bool:
    """Whether any leaf of `tree` is held as `layout.Rows`."""
    is_rows = lambda w: isinstance(w, layout.Rows)  # noqa: E731
    return any(is_rows(w) for w in jax.tree_util.tree_leaves(tree, is_leaf=is_rows))


def held_apart(dtype) -> bool:
    """Whether stacked block weights of `dtype` are held as `layout.Rows` (one array a
    block): low-precision ones on XLA's CPU backend, which cannot scan a stacked bf16
    leaf in place (`in_place`) and copies each static slice of one, one more pass over
    every weight a forward; held apart, the rows scan through a switch."""
    narrow = jnp.issubdtype(dtype, jnp.inexact) and jnp.dtype(dtype).itemsize < 4
    return narrow and jax.default_backend() == "cpu"


def apart(part: dict) -> dict:
    """A model part (e.g. `params["lm"]`) with its stacked blocks' leaves held as
    `layout.Rows` where `held_apart` (else `part` itself), sliced here, outside any
    compiled program. The loader makes its rows directly (`models.hub.place_params`);
    this serves params made otherwise. Drop `part` after: both hold the weights."""
    blocks = part.get(layout.BLOCKS, {})
    split = [k for k, w in blocks.items()
             if not isinstance(w, layout.Rows) and held_apart(w.dtype)]  # fmt: skip
    if not split:
        return part
    return {**part, layout.BLOCKS: blocks | {k: layout.Rows(list(blocks[k])) for k in split}}


def _per_block(part, i: int, prefix: str) -> dict:
    return layout.block(part, i) if prefix == "block_" else part[f"{prefix}{i}"]


def block_stack(part, n: int, prefix: str = "block_") -> dict:
    """A part's n blocks as `scan_blocks` reads them, nothing copied: its stacked leaves
    (`layout.BLOCKS`) where it has them, else each leaf's per-block arrays
    (`{prefix}{i}`, the ViTs' storage) as `layout.Rows` (a scan step reads its block by
    a switch, `block_row`: a copy of that block alone)."""
    if prefix == "block_" and layout.is_stacked(part):
        return part[layout.BLOCKS]
    blocks = [_per_block(part, i, prefix) for i in range(n)]
    return {k: layout.Rows([b[k] for b in blocks]) for k in blocks[0]}


def scans_part(part, n: int, prefix: str = "block_") -> bool:
    """Whether a part's n blocks (stacked or `{prefix}{i}`) run under `scan_blocks`: not
    for one block (nothing to share), nor for stacked low-precision weights on XLA's CPU
    backend (`in_place`); blocks stored apart (`{prefix}{i}`) scan as rows."""
    if n < 2:
        return False
    return in_place(block_stack(part, n, prefix))


class Tapped:
    """The forward's `Sites` as a scan sees it, also capturing `taps` (site names) for
    the caller: values the forward reads after the scan (e.g. the blocks' outputs a
    projector reads), kept out of the forward's aux unless its capture asks for them."""

    def __init__(self, outer, taps):
        self.outer, self.taps, self.edits, self.aux = outer, set(taps), outer.edits, {}
        self.remat = remat_of(outer)

    def wants(self, name: str) -> bool:
        return name in self.taps or self.outer.wants(name)

    def edits_at(self, name: str) -> bool:
        return edited_at(self.outer, name)

    def captures(self, name: str) -> bool:
        return name in self.taps or captured_at(self.outer, name)

    def __call__(self, name: str, x):
        x = self.outer(name, x)
        if name in self.taps:
            self.aux[name] = x
        return x


def run_blocks(part, n: int, x, layers: range, block, site, xs=None, taps=(),
               prefix: str = "block_"):  # fmt: skip
    """(x after blocks `layers` of a part of n blocks, {tap: its value}): `block(w, x,
    site, i, xs_i)` each (i the index in site names: an int, or `LAYER` under the scan;
    xs_i its per-layer inputs, `xs[k]` for the k-th of `layers` (a list of like
    pytrees; Python values pass as they are unrolled, as arrays scanned), or None),
    under one `scan_blocks` where `scans_part`, else one after another as stored.
    `taps`: site names also returned (`Tapped`)."""
    tapped = Tapped(site, taps)
    if not scans_part(part, n, prefix) or len(layers) < 2:
        for k, i in enumerate(layers):
            e = None if xs is None else xs[k]
            x = block(_per_block(part, i, prefix), x, tapped, i, e)
        return x, tapped.aux

    def body(w, x, s, i, e):
        return block(w, x, s, LAYER, e)

    stacked_xs = None if xs is None else jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
    x = scan_blocks(block_stack(part, n, prefix), x, layers, body, tapped, stacked_xs,
                    remat=tapped.remat)  # fmt: skip
    site.aux.update({k: v for k, v in tapped.aux.items() if site.wants(k)})
    return x, tapped.aux


def block_row(stacked: dict, i) -> dict:
    """Block i's weights (i an int or traced) of stacked leaves, read in place; of
    `layout.Rows`, row i (a traced i: chosen by one `lax.switch`, a copy of the block's
    weights, the price of one compiled block over rows)."""
    rows = {k: w for k, w in stacked.items() if isinstance(w, layout.Rows)}
    out = {k: jax.lax.dynamic_index_in_dim(w, i, keepdims=False)
           for k, w in stacked.items() if k not in rows}  # fmt: skip
    if not rows:
        return out
    if isinstance(i, int):
        return out | {k: w[i] for k, w in rows.items()}
    n = len(next(iter(rows.values())))
    pick = [lambda j=j: {k: w[j] for k, w in rows.items()} for j in range(n)]
    return out | jax.lax.switch(i, pick)


def edited_layers(edits, layers) -> dict:
    """{point: [layers]}: the scanned layers each point has an edit at."""
    out: dict = {}
    for name in list(edits.replace) + list(edits.add):
        base, layer = _split(name)
        if layer.isdigit() and int(layer) in layers and int(layer) not in out.get(base, []):
            out.setdefault(base, []).append(int(layer))
    return out


def _wanted(outer, bases, layers) -> tuple[frozenset, dict]:
    """(the points captured at every scanned layer, {point: the layers captured of the
    others}) of the forward's capture (`Sites.capture`)."""
    every, some = set(), {}
    for base in bases:
        asked = [lay for lay in layers if outer.wants(f"{base}.{lay}")]
        if len(asked) == len(layers):
            every.add(base)
        elif asked:
            some[base] = asked
    return frozenset(every), some


def scan_blocks(stacked, x, layers: range, body, outer, xs=None, skip_before=None,
                remat: str = "off"):  # fmt: skip
    """x after `body(block, x, site, i, xs_i)` for each block i of `layers` in turn, one
    `lax.scan` over the stacked weights `stacked` ({name: [L_all, ...]}, rows `layers`
    read). `body` names its sites with `LAYER` (module docstring); `outer` is the
    forward's `Sites` (edits read, captures written to its aux). `xs`: per-layer inputs
    (a pytree, leading axis len(layers)), or None. `skip_before` (an int or a traced
    one): blocks i < skip_before pass x unchanged (their captured sites hold zeros).
    `remat`: what each step keeps for a backward (`REMAT`: "off", or the step under
    `jax.checkpoint` with that policy: memory under a gradient only; values equal up to
    float rounding, the compiled program being another)."""
    policy = remat_policy(remat)
    if len(layers) == 0:
        return x
    layer_ids = jnp.arange(layers.start, layers.stop, dtype=jnp.int32)
    xs_0 = None if xs is None else jax.tree_util.tree_map(lambda a: a[0], xs)
    shapes: dict = {}

    def shape_pass(w0, x0, e0):
        body(w0, x0, LayerSites(outer, 0, {}, frozenset(), {}, None, shapes), layer_ids[0], e0)
        return {k: v for k, v in shapes.items()}

    w_0 = block_row(stacked, layers.start)
    found = jax.eval_shape(shape_pass, w_0, x, xs_0)
    every, some = _wanted(outer, list(found), list(layers))
    edited = edited_layers(outer.edits, layers)
    bufs0 = {b: jnp.zeros((len(ls),) + found[b].shape, found[b].dtype) for b, ls in some.items()}
    kept = {b: found[b] for b in every}

    def run(x, bufs, i, e):
        w = block_row(stacked, i)  # in the taken branch: a skipped block reads nothing
        s = LayerSites(outer, i, edited, every, some, bufs)
        y = body(w, x, s, i, e)
        return y, s.bufs, s.keep

    def step(carry, inp):
        x, bufs = carry
        i, e = inp
        if skip_before is None:
            y, bufs, keep = run(x, bufs, i, e)
        else:
            zeros = {b: jnp.zeros(v.shape, v.dtype) for b, v in kept.items()}
            y, bufs, keep = jax.lax.cond(i >= skip_before, lambda: run(x, bufs, i, e),
                                         lambda: (x, bufs, zeros))  # fmt: skip
        return (y.astype(x.dtype), bufs), keep

    if policy is not None:
        # prevent_cse off: inside a scan the loop already keeps XLA from merging the
        # backward's rerun with the forward (JAX's advice for remat under scan)
        step = jax.checkpoint(step, policy=policy, prevent_cse=False)
    (x, bufs), ys = jax.lax.scan(step, (x, bufs0), (layer_ids, xs))
    for b in every:
        for k, lay in enumerate(layers):
            outer.aux[f"{b}.{lay}"] = ys[b][k]
    for b, ls in some.items():
        for k, lay in enumerate(ls):
            outer.aux[f"{b}.{lay}"] = bufs[b][k]
    return x
