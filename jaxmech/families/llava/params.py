"""The LLaVA params pytree: names and shapes in TransformerLens layout.

  vit/   W_patch [F, E]          the patch Conv2d (no bias) as a matmul over one patch
                                 flattened (C, p, p)
         cls [E]                 the class embedding
         pos [1 + P, E]          the learned position table: row 0 the CLS token's,
                                 row 1 + r g + c patch (r, c) of the g x g grid's
         ln_pre_w, ln_pre_b [E]  pre_layrnorm
         block_{i}/ ln1_w ln1_b ln2_w ln2_b [E]  W_Q W_K W_V [H, E, Dh]  b_Q b_K b_V [H, Dh]
                    W_O [H, Dh, E] b_O [E]  W_in [E, M] b_in [M]  W_out [M, E] b_out [E]
  proj/  W1 [E, D]  W2 [D, D]  (+ b1, b2 [D] where the projector has biases)
  lm/    E [V, D]
         blocks/    ln1_w ln2_w [D]  W_Q [H, D, Dh]  W_K W_V [Hkv, D, Dh]  W_O [H, Dh, D]
                    W_gate W_in [D, M]  W_out [M, D]  (+ b_Q ..., b_O, b_gate ... where
                    the config has attention / MLP biases)
         lnf_w [D]  W_U [D, V] (untied checkpoints only; tied ones read E^T)

E, H, Dh, M: the ViT's width, heads, head width and MLP width; D, Hkv: the LM's width and
key-value heads (grouped-query attention: query head h reads key-value head
h // (H / Hkv)). The CLIP tower's `post_layernorm` is stored in checkpoints but never
read by LLaVA (it acts on the pooled CLS output only), so it is not loaded
(`load.UNUSED`; counted by `n_stored`).
LM `blocks/`: the blocks stacked, every leaf [L, ...] with block i at row i
(`models.layout.BLOCKS`; one block's weights: `models.layout.block(lm, i)`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.llava.config import LlavaConfig
from jaxmech.models import layout
from jaxmech.models.layout import is_shape

__all__ = ["init_params", "is_shape", "lm_layout", "n_params", "n_stored", "param_shapes"]


def lm_layout(c: LlavaConfig) -> layout.LMLayout:
    """The Llama LM's layout: attention biases (q, k, v and o) and MLP biases where
    config.json says so."""
    bias = c.lm_attention_bias
    return hf_vlm.lm_layout(c, qkv_bias=bias, o_bias=bias, mlp_bias=c.lm_mlp_bias)


def param_shapes(c: LlavaConfig) -> dict:
    """{part: {name or block_i: shape or {name: shape}}}: every parameter's shape."""
    E, D = c.vit_width, c.lm_width
    vit = {"W_patch": (c.patch_features, E), "cls": (E,), "pos": (1 + c.n_patches, E),
           "ln_pre_w": (E,), "ln_pre_b": (E,)}  # fmt: skip
    vit |= {f"block_{i}": hf_vlm.clip_block_shapes(c) for i in range(c.vit_depth)}
    proj = {"W1": (E, D), "W2": (D, D)} | ({"b1": (D,), "b2": (D,)} if c.proj_bias else {})
    return {"vit": vit, "proj": proj, "lm": layout.lm_shapes(lm_layout(c))}


def n_params(c: LlavaConfig) -> int:
    """How many parameters the forward reads (tied embeddings counted once)."""
    return layout.count_params(param_shapes(c))


def n_stored(c: LlavaConfig) -> int:
    """How many parameters a checkpoint stores: `n_params` and the ViT's unused
    post_layernorm (the reference's `num_parameters()`)."""
    return n_params(c) + 2 * c.vit_width


def init_params(c: LlavaConfig, key, dtype=jnp.float32) -> dict:
    """Random params of `c`'s shapes (`models.layout.init_from_shapes`: norm weights near
    1, the rest N(0, 0.02^2), the patch embedding and position table wider so tiny
    images still carry signal): for tests and benchmarks; a real model is loaded
    (`load.load_checkpoint`)."""
    scales = {"W_patch": 0.1, "pos": 0.1, "cls": 0.1}
    return layout.init_from_shapes(param_shapes(c), key, dtype, scales)
