"""Params pytrees as shape tables, for every loaded checkpoint family: the Llama-layout
LM they share (`LMLayout`, `decoder_block_shapes`, `lm_shapes`), counting a table's
parameters, random params drawn from a table, and the authors' fine-tuned leaves.

A shape table is the params pytree with a shape tuple at each leaf (a family's
`params.param_shapes(config)`): the one description its init, its key map's checks
and its tests read. Shared because the three LMs (Qwen2 / Qwen3, Llama, InternVL's
Qwen2) are one block layout with optional pieces, and each family drew its random
params the same way (one draw cut into the leaves: one compiled program however many
leaves; norm weights near 1).

Axis names (`jaxmech.shapes`): D width, H heads, Hkv key-value heads, Dh head width,
M MLP width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LMLayout(NamedTuple):
    """A Llama-layout LM's sizes and optional pieces: `layers` decoder blocks (RMSNorms,
    grouped-query attention, a SwiGLU MLP) over a `vocab`-token embedding, the
    unembedding `tied` to it or its own; in each block `qkv_bias` q / k / v biases,
    `o_bias` the output projection's, `mlp_bias` the MLP's, `qk_norm` per-head q / k
    RMSNorms."""

    width: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    layers: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def decoder_block_shapes(lay: LMLayout) -> dict:
    """{name: shape} of one decoder block in TransformerLens layout (`models.decoder`):
    ln1_w, ln2_w [D], W_Q [H, D, Dh], W_K, W_V [Hkv, D, Dh], W_O [H, Dh, D], W_gate,
    W_in [D, M], W_out [M, D], and the optional biases / q-k norm weights."""
    D, H, K, Dh, M = lay.width, lay.heads, lay.kv_heads, lay.head_dim, lay.mlp
    s = {"ln1_w": (D,), "ln2_w": (D,), "W_O": (H, Dh, D), "W_gate": (D, M), "W_in": (D, M),
         "W_out": (M, D)}  # fmt: skip
    for w, n in (("Q", H), ("K", K), ("V", K)):
        s |= {f"W_{w}": (n, D, Dh)} | ({f"b_{w}": (n, Dh)} if lay.qkv_bias else {})
    if lay.qk_norm:
        s |= {"q_norm_w": (Dh,), "k_norm_w": (Dh,)}
    if lay.o_bias:
        s["b_O"] = (D,)
    if lay.mlp_bias:
        s |= {"b_gate": (M,), "b_in": (M,), "b_out": (D,)}
    return s


def lm_shapes(lay: LMLayout) -> dict:
    """The LM part's shape table: E [V, D], `BLOCKS` the blocks stacked (each of
    `decoder_block_shapes` with a leading block axis [L, ...]), lnf_w [D], and W_U
    [D, V] where not tied (tied ones read E^T)."""
    lm = {"E": (lay.vocab, lay.width), "lnf_w": (lay.width,)}
    lm[BLOCKS] = stack_shapes(decoder_block_shapes(lay), lay.layers)
    return lm if lay.tied else lm | {"W_U": (lay.width, lay.vocab)}


# A part's blocks stacked: `part[BLOCKS]` is {name: [L, ...]}, block i's weights at
# index i of every leaf, so `jax.lax.scan` runs one compiled block over all of them
# (`models.scan`). The loaded families' LMs are stacked; their ViTs (scanned through a
# switch, `models.scan.block_stack`) and the trained toy families keep one subtree
# `block_{i}` per block.
BLOCKS = "blocks"


def stack_shapes(block: dict, n: int) -> dict:
    """One block's shape table with a leading block axis of `n`."""
    return {k: (n,) + tuple(s) for k, s in block.items()}


@jax.tree_util.register_pytree_node_class
class Rows:
    """A stacked leaf [L, ...] held as its L rows, each its own array (a pytree whose
    children are the rows): what low-precision weights on XLA's CPU backend run from
    (`models.scan.apart`), where a slice of a stacked bf16 leaf is a copy of it. Reads
    as the stacked leaf would: `shape` [L, ...], `dtype`, `rows[i]` by a Python int."""

    def __init__(self, rows):
        self.rows = tuple(rows)

    def tree_flatten(self):
        return self.rows, None

    @classmethod
    def tree_unflatten(cls, _, rows):
        return cls(rows)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows),) + tuple(self.rows[0].shape)

    @property
    def dtype(self):
        return self.rows[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"Rows[{i!r}]: a stacked leaf held as rows is read by a Python "
                            "int (one block), not a traced index or a slice")  # fmt: skip
        return self.rows[i]

    def __repr__(self) -> str:
        return f"Rows({len(self.rows)} x {self.dtype}{list(self.shape[1:])})"


def is_stacked(part) -> bool:
    """Whether a model part holds its blocks stacked (`BLOCKS`, as stacked leaves or
    their `Rows`)."""
    return BLOCKS in part


def block(part, i: int) -> dict:
    """Block i's weights of a model part, stacked (`BLOCKS`: index i of each leaf, or
    row i of its `Rows`) or not (`part["block_{i}"]`): every reader of one block's
    weights goes through here."""
    if BLOCKS in part:
        return {k: w[i] for k, w in part[BLOCKS].items()}
    return part[f"block_{i}"]


def is_shape(x) -> bool:
    """Whether `x` is a shape table's leaf (a tuple of ints)."""
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def count_params(shapes) -> int:
    """How many parameters a shape table holds."""
    leaves = jax.tree_util.tree_leaves(shapes, is_leaf=is_shape)
    return int(sum(np.prod(s) for s in leaves))


def _is_norm_weight(name: str) -> bool:
    return name.endswith("_w") and (name.startswith("ln") or "norm" in name)


def init_from_shapes(shapes, key, dtype=jnp.float32, scales=None, offsets=None) -> dict:
    """Random params of a shape table: leaf `name` drawn N(0, s^2), s = scales[name] or
    0.02, plus offsets[name] (default: 1 for a norm weight `ln*_w` / `*norm*_w`, else
    0), cast to `dtype`. For tests and benchmarks (a real model is loaded). One draw
    from `key`, cut into the leaves in the pytree's order."""
    scales, offsets = scales or {}, offsets or {}
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    sizes = [int(np.prod(shape)) for _, shape in paths]
    flat = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32))
    out, at = [], 0
    for (path, shape), n in zip(paths, sizes):
        name = path[-1].key
        x = scales.get(name, 0.02) * flat[at : at + n].reshape(shape)
        at += n
        offset = offsets.get(name, 1.0 if _is_norm_weight(name) else 0.0)
        out.append(jnp.asarray(offset + x if offset else x, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


# the authors' fine-tune (spatial_finetuning/train.py --last_k_blocks 6): the ViT's
# last 6 blocks' MLP weights
AUTHORS_VIT_BLOCKS = 6


def authors_vit_mlp(p) -> list[str]:
    """The authors' fine-tuned ViT leaves as `train_only` names: the MLP weights (W_gate
    where gated, W_in, W_out; no biases) of the ViT's last min(6, depth) blocks. Their
    selector (vision_mlp_lastk) takes vision tensors named like an MLP's ending in
    `.weight` within the last 6 numbered blocks, whatever the family."""
    depth = sum(1 for k in p["vit"] if k.startswith("block_"))
    return [f"vit/block_{i}/{name}" for i in range(max(0, depth - AUTHORS_VIT_BLOCKS), depth)
            for name in ("W_gate", "W_in", "W_out") if name in p["vit"][f"block_{i}"]]  # fmt: skip
