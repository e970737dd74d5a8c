"""The InternVL params pytree: names and shapes in TransformerLens layout.

  vit/     W_patch [F, E]  b_patch [E]   the conv over one (C, p, p) patch as a matmul
                                         (F = C p p, flattened in that order)
           cls [E]                        the CLS token
           pos_cls [E]  pos [n, n, E]     the learned position table: the CLS row, then
                                          the patches' rows as an n x n grid (row, col)
           block_{i}/ ln1_w, ln1_b, ln2_w, ln2_b [E]
                      W_Q, W_K, W_V [H, E, Dh] (+ b_Q, b_K, b_V [H, Dh])  W_O [H, Dh, E]
                      b_O [E]  W_in [E, M] b_in [M]  W_out [M, E] b_out [E]
                      ls1, ls2 [E]   the layer scale on the attention / MLP outputs
  proj/    ln_w, ln_b [4E]  W1 [4E, D] b1 [D]  W2 [D, D] b2 [D]
  lm/      E [V, D]
           blocks/    ln1_w, ln2_w [D]  W_Q [H, D, Dh] b_Q [H, Dh]  W_K, W_V [Hkv, D, Dh]
                      b_K, b_V [Hkv, Dh]  W_O [H, Dh, D]  W_gate, W_in [D, M]  W_out [M, D]
           lnf_w [D]   W_U [D, V] (untied checkpoints only; tied ones read E^T)

E, H, Dh, M: the ViT's width, heads, head width, MLP width; n: the table's side
(image_size / patch); D, Hkv: the LM's width and key-value heads.
LM `blocks/`: the blocks stacked, every leaf [L, ...] with block i at row i
(`models.layout.BLOCKS`; one block's weights: `models.layout.block(lm, i)`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.internvl.config import InternVLConfig
from jaxmech.models import layout
from jaxmech.models.layout import is_shape

__all__ = ["init_params", "is_shape", "lm_layout", "n_params", "param_shapes"]


def _vit_block(c: InternVLConfig) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    s = {"ln1_w": (E,), "ln1_b": (E,), "ln2_w": (E,), "ln2_b": (E,)}
    for w in "QKV":
        s[f"W_{w}"] = (H, E, Dh)
        if c.vit_qkv_bias:
            s[f"b_{w}"] = (H, Dh)
    return s | {"W_O": (H, Dh, E), "b_O": (E,), "W_in": (E, M), "b_in": (M,),
                "W_out": (M, E), "b_out": (E,), "ls1": (E,), "ls2": (E,)}  # fmt: skip


def lm_layout(c: InternVLConfig) -> layout.LMLayout:
    """The Qwen2 LM's layout: q / k / v biases, no other."""
    return hf_vlm.lm_layout(c, qkv_bias=True)


def param_shapes(c: InternVLConfig) -> dict:
    """{part: {name or block_i: shape or {name: shape}}}: every parameter's shape."""
    E, D, n = c.vit_width, c.lm_width, c.table_side
    vit = {"W_patch": (c.patch_features, E), "b_patch": (E,), "cls": (E,), "pos_cls": (E,),
           "pos": (n, n, E)}  # fmt: skip
    vit |= {f"block_{i}": _vit_block(c) for i in range(c.vit_depth)}
    W = c.proj_width
    proj = {"ln_w": (W,), "ln_b": (W,), "W1": (W, D), "b1": (D,), "W2": (D, D), "b2": (D,)}
    return {"vit": vit, "proj": proj, "lm": layout.lm_shapes(lm_layout(c))}


def n_params(c: InternVLConfig) -> int:
    """How many parameters the checkpoint holds (tied embeddings counted once)."""
    return layout.count_params(param_shapes(c))


def init_params(c: InternVLConfig, key, dtype=jnp.float32) -> dict:
    """Random params of `c`'s shapes (`models.layout.init_from_shapes`: norm weights near
    1, layer scales near 0.5, a position table and CLS of unit scale, other weights
    N(0, 0.02^2) and the patch embedding wider so tiny images still carry signal): for
    tests and benchmarks; a real model is loaded (`load.load_checkpoint`)."""
    scales = {"W_patch": 0.1, "pos": 1.0, "pos_cls": 1.0, "cls": 1.0, "ls1": 0.1, "ls2": 0.1}
    return layout.init_from_shapes(param_shapes(c), key, dtype, scales, {"ls1": 0.5, "ls2": 0.5})
