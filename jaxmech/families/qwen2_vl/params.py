"""The Qwen-VL params pytree: names and shapes in TransformerLens layout.

  vit/     W_patch [F, E]           the Conv3d over one (C, T, p, p) patch as a matmul
                                    (F = C T p p, flattened in that order)
           b_patch [E]              its bias (Qwen3-VL's)
           pos_table [N, E]         Qwen3-VL's learned position table, N = n x n cells
                                    row-major
           block_{i}/ ln1_w, ln2_w [E] (+ ln1_b, ln2_b: Qwen2-VL's LayerNorm)
                      W_Q, W_K, W_V [H, E, Dh]  b_Q, b_K, b_V [H, Dh]  W_O [H, Dh, E]  b_O [E]
                      W_in [E, M] b_in [M]  W_out [M, E] b_out [E]  (+ W_gate, b_gate:
                      Qwen2.5-VL's SwiGLU: W_out(silu(x W_gate) * x W_in))
  merger/  ln_w [E] (+ ln_b)  W1 [4E, 4E] b1 [4E]  W2 [4E, D] b2 [D]
  deepstack/ merger_{k}/ ln_w, ln_b [4E]  W1 [4E, 4E] b1 [4E]  W2 [4E, D] b2 [D]
                      (Qwen3-VL: DeepStack merger k, its norm after the 2 x 2 shuffle)
  lm/      E [V, D]
           blocks/    ln1_w, ln2_w [D]  W_Q [H, D, Dh] b_Q [H, Dh]  W_K, W_V [Hkv, D, Dh]
                      b_K, b_V [Hkv, Dh]  W_O [H, Dh, D]  W_gate, W_in [D, M]  W_out [M, D]
                      (Qwen3-VL: no b_Q, b_K, b_V; q_norm_w, k_norm_w [Dh])
           lnf_w [D]   W_U [D, V] (untied checkpoints only; tied ones read E^T)

E, H, Dh, M: the ViT's width, heads, head width and MLP width; D, Hkv: the LM's width and
key-value heads (grouped-query attention: query head h reads key-value head
h // (H / Hkv)).
LM `blocks/`: the blocks stacked, every leaf [L, ...] with block i at row i
(`models.layout.BLOCKS`; one block's weights: `models.layout.block(lm, i)`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.models import layout
from jaxmech.models.layout import is_shape

__all__ = ["init_params", "is_shape", "lm_layout", "n_params", "param_shapes"]


def _vit_block(c: QwenVLConfig) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    s = {"ln1_w": (E,), "ln2_w": (E,)}
    if c.vit_layer_norm:
        s |= {"ln1_b": (E,), "ln2_b": (E,)}
    for w in "QKV":
        s |= {f"W_{w}": (H, E, Dh), f"b_{w}": (H, Dh)}
    s |= {
        "W_O": (H, Dh, E),
        "b_O": (E,),
        "W_in": (E, M),
        "b_in": (M,),
        "W_out": (M, E),
        "b_out": (E,),
    }
    if c.vit_gated:
        s |= {"W_gate": (E, M), "b_gate": (M,)}
    return s


def lm_layout(c: QwenVLConfig) -> layout.LMLayout:
    """The LM's layout: Qwen2's q / k / v biases, or Qwen3's q / k norms."""
    return hf_vlm.lm_layout(c, qkv_bias=c.lm_qkv_bias, qk_norm=c.lm_qk_norm)


def _merger(c: QwenVLConfig, post_shuffle: bool = False) -> dict:
    """A merger's shapes: its norm over E before the shuffle, or over 4E after it
    (`post_shuffle`, DeepStack's)."""
    E, D, W = c.vit_width, c.lm_width, c.merge_width
    n = W if post_shuffle else E
    s = {"ln_w": (n,), "W1": (W, W), "b1": (W,), "W2": (W, D), "b2": (D,)}
    return s | ({"ln_b": (n,)} if c.vit_layer_norm else {})


def param_shapes(c: QwenVLConfig) -> dict:
    """{part: {name or block_i: shape or {name: shape}}}: every parameter's shape."""
    E = c.vit_width
    vit = {"W_patch": (c.patch_features, E)} | ({"b_patch": (E,)} if c.patch_bias else {})
    vit |= {"pos_table": (c.vit_pos_table, E)} if c.vit_pos_table else {}
    vit |= {f"block_{i}": _vit_block(c) for i in range(c.vit_depth)}
    out = {"vit": vit, "merger": _merger(c), "lm": layout.lm_shapes(lm_layout(c))}
    if c.vit_deepstack:
        out["deepstack"] = {f"merger_{k}": _merger(c, True) for k in range(len(c.vit_deepstack))}
    return out


def n_params(c: QwenVLConfig) -> int:
    """How many parameters the checkpoint holds (tied embeddings counted once)."""
    return layout.count_params(param_shapes(c))


def init_params(c: QwenVLConfig, key, dtype=jnp.float32) -> dict:
    """Random params of `c`'s shapes (`models.layout.init_from_shapes`: norm weights near
    1, biases and weights N(0, 0.02^2), the patch embedding wider so tiny images still
    carry signal): for tests and benchmarks; a real model is loaded
    (`load.load_checkpoint`)."""
    return layout.init_from_shapes(param_shapes(c), key, dtype, {"W_patch": 0.1})
