"""Llama-3.2-Vision's LM layers, self-attention blocks with gated cross-attention layers
interleaved, under one `jax.lax.scan` (issue 60): each scan step runs its layer's body
through a `lax.switch` on the layer's kind, reading that kind's weights by a counter.
One self-attention and one cross-attention body compile however many layers run.

Why one scan with a switch, not one scan per run of self-attention blocks between cross
layers: the 11B checkpoint has 40 layers with a cross layer every fifth (3, 8, .., 38),
so per-run scans would compile nine self-attention bodies and leave eight cross layers
unrolled; the switch compiles each body once.

The LM's blocks are stored one subtree `block_{i}` a layer (a cross layer has more
leaves than a self one); each kind's blocks are read as `layout.Rows`, a step's block
picked by a switch (`models.scan.block_row`: a copy of that block alone, as the ViTs' scan).

Sites inside a body carry `models.scan.LAYER` in place of the index. Edits at layer l
act where the scanned layer is l (`models.scan.LayerSites`). A point's two kinds differ
in shape (a self layer's `attn_scores` [B, H, S, S], a cross layer's [B, H, S, I]), so
captures are kept per kind: each captured point has a buffer [K + 1, ...] in the scan's
carry, written at its layer's slot (K the layers captured; the extra slot takes the
layers that are not), never stacked over layers nobody asked for.

Axis names (`jaxmech.shapes`): Y layers, K captured layers of one point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.models import layout
from jaxmech.models.scan import (
    LAYER,
    LayerSites,
    block_row,
    captured_at,
    edited_at,
    edited_layers,
    remat_of,
    remat_policy,
)


class _Slotted:
    """A kind's scan-body sites for layer `i` (traced): the edits by layer index
    (`inner`, a `LayerSites`), captures written into `bufs` ({point: [K + 1, ...]}) at
    `slots[point][i]`."""

    def __init__(self, inner: LayerSites, i, bufs: dict, slots: dict):
        self.inner, self.i, self.bufs, self.slots = inner, i, dict(bufs), slots

    def edits_at(self, name: str) -> bool:
        return edited_at(self.inner, name)

    def captures(self, name: str) -> bool:
        return name.rpartition(".")[0] in self.bufs or captured_at(self.inner, name)

    def __call__(self, name: str, x):
        x = self.inner(name, x)
        base = name.rpartition(".")[0]
        if base in self.bufs:
            buf = self.bufs[base]
            at = jnp.asarray(self.slots[base])[self.i]
            self.bufs[base] = jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), at, 0)
        return x


def _kind_stack(part, layers: list[int]) -> dict:
    """The blocks `layers` (one kind: the same leaves) as `layout.Rows`, nothing copied."""
    blocks = [layout.block(part, i) for i in layers]
    return {k: layout.Rows([b[k] for b in blocks]) for k in blocks[0]}


def _buffers(outer, found: dict, layers: list[int], n: int) -> tuple[dict, dict]:
    """({point: zeros [K + 1, ...]}, {point: [n] int32 each layer's slot}) for the points
    of `found` ({point: shape struct}) the capture asks for at some of `layers`."""
    bufs, slots = {}, {}
    for base, v in found.items():
        asked = [lay for lay in layers if outer.wants(f"{base}.{lay}")]
        if asked:
            at = np.full(n, len(asked), np.int32)  # the spare slot
            at[asked] = np.arange(len(asked))
            bufs[base] = jnp.zeros((len(asked) + 1,) + v.shape, v.dtype)
            slots[base] = at
    return bufs, slots


def _shapes(part, layer: int, body, outer, x) -> dict:
    """{point: shape struct} of a kind's body on block `layer` (a shape pass, no compute)."""
    shapes: dict = {}
    site = LayerSites(outer, 0, {}, frozenset(), {}, None, shapes)
    jax.eval_shape(lambda w, x: body(w, x, site, LAYER), layout.block(part, layer), x)
    return shapes


def scan_kinds(part, x, layers: range, kind_of: tuple, bodies: dict, outer):
    """x after layers `layers` of a part of per-layer blocks (`block_{i}`), layer i run
    by `bodies[kind_of[i]](weights, x, site, i)` (i `LAYER` in site names), all under one
    `lax.scan` with a `lax.switch` on the kind (module docstring). `outer` the forward's
    `Sites`: its edits applied by layer, its captures written to its aux by name, its
    `remat` each step's (`models.scan.REMAT`: memory under a gradient only)."""
    if len(layers) == 0:
        return x
    n = len(kind_of)
    kinds = [k for k in bodies if any(kind_of[i] == k for i in layers)]
    of_kind = {k: [i for i in layers if kind_of[i] == k] for k in kinds}
    stacks = {k: _kind_stack(part, of_kind[k]) for k in kinds}
    counter = np.zeros(n, np.int32)  # each layer's index among its kind's
    for ls in of_kind.values():
        counter[ls] = np.arange(len(ls))
    bufs0, slots = {}, {}
    for k in kinds:
        found = _shapes(part, of_kind[k][0], bodies[k], outer, x)
        bufs0[k], slots[k] = _buffers(outer, found, of_kind[k], n)

    def branch(k):
        edited = edited_layers(outer.edits, of_kind[k])

        def run(x, bufs, i):
            s = _Slotted(LayerSites(outer, i, edited, frozenset(), {}, None), i, bufs[k], slots[k])
            y = bodies[k](block_row(stacks[k], jnp.asarray(counter)[i]), x, s, LAYER)
            return y.astype(x.dtype), {**bufs, k: s.bufs}

        return run

    branches = [branch(k) for k in kinds]
    which = jnp.asarray([kinds.index(kind_of[i]) if i in layers else 0 for i in range(n)])

    def step(carry, i):
        x, bufs = carry
        return jax.lax.switch(which[i], branches, x, bufs, i), None

    policy = remat_policy(remat_of(outer))  # the forward's (`models.scan.REMAT`)
    if policy is not None:  # as `models.scan.scan_blocks`
        step = jax.checkpoint(step, policy=policy, prevent_cse=False)

    ids = jnp.arange(layers.start, layers.stop, dtype=jnp.int32)
    (x, bufs), _ = jax.lax.scan(step, (x, bufs0), ids)
    for k in kinds:
        for base, buf in bufs[k].items():
            for lay in of_kind[k]:
                if outer.wants(f"{base}.{lay}"):
                    outer.aux[f"{base}.{lay}"] = buf[int(slots[k][base][lay])]
    return x
