"""The Gemma-3 params pytree: names and shapes in TransformerLens layout.

  vit/   W_patch [F, E] b_patch [E]  the patch Conv2d as a matmul over one patch
                                     flattened (C, p, p)
         pos [P, E]                  the learned position table, row r g + c patch (r, c)
                                     of the g x g grid (no CLS)
         block_{i}/ ln1_w ln1_b ln2_w ln2_b [E]  W_Q W_K W_V [H, E, Dh]  b_Q b_K b_V [H, Dh]
                    W_O [H, Dh, E] b_O [E]  W_in [E, M] b_in [M]  W_out [M, E] b_out [E]
         ln_post_w, ln_post_b [E]    post_layernorm (the projector reads its output)
  proj/  norm_w [E]                  mm_soft_emb_norm (Gemma's RMSNorm: x (1 + w))
         W [E, D]                    mm_input_projection_weight, used as x @ W
  lm/    E [V, D]                    the embedding (scaled by sqrt(D) for text tokens);
                                     tied: the unembedding reads E^T
         blocks/    ln1_w [D]        input_layernorm
                    ln1_post_w [D]   post_attention_layernorm (on the attention's output)
                    ln2_w [D]        pre_feedforward_layernorm
                    ln2_post_w [D]   post_feedforward_layernorm (on the MLP's output)
                    q_norm_w k_norm_w [Dh]
                    W_Q [H, D, Dh]  W_K W_V [Hkv, D, Dh]  W_O [H, Dh, D]
                    W_gate W_in [D, M]  W_out [M, D]
         lnf_w [D]                   the final norm
         W_U [D, V]                  untied checkpoints only

Every LM norm and the projector's norm is Gemma's RMSNorm (float32, times 1 + w); the
ViT's are LayerNorms. E, H, Dh, M: the ViT's width, heads, head width and MLP width;
D, Hkv: the LM's width and key-value heads.
LM `blocks/`: the blocks stacked, every leaf [L, ...] with block i at row i
(`models.layout.BLOCKS`; one block's weights: `models.layout.block(lm, i)`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.gemma3.config import Gemma3Config
from jaxmech.models import layout

__all__ = ["init_params", "lm_layout", "n_params", "param_shapes"]

# Gemma's RMSNorm weights (x (1 + w)): drawn near 0, not near 1 (`init_params`)
GEMMA_NORMS = ("ln1_w", "ln1_post_w", "ln2_w", "ln2_post_w", "q_norm_w", "k_norm_w", "lnf_w",
               "norm_w")  # fmt: skip


def lm_layout(c: Gemma3Config) -> layout.LMLayout:
    """The Llama-layout part of the LM (q / k norms, no biases); the Gemma blocks' post
    norms are added beside it (`param_shapes`)."""
    return hf_vlm.lm_layout(c, qk_norm=True)


def param_shapes(c: Gemma3Config) -> dict:
    """{part: {name or block_i: shape or {name: shape}}}: every parameter's shape."""
    E, D = c.vit_width, c.lm_width
    vit = {"W_patch": (c.patch_features, E), "b_patch": (E,), "pos": (c.n_patches, E),
           "ln_post_w": (E,), "ln_post_b": (E,)}  # fmt: skip
    vit |= {f"block_{i}": hf_vlm.clip_block_shapes(c) for i in range(c.vit_depth)}
    lm = layout.lm_shapes(lm_layout(c))
    post_norms = {"ln1_post_w": (D,), "ln2_post_w": (D,)}
    lm[layout.BLOCKS] |= layout.stack_shapes(post_norms, c.lm_layers)
    return {"vit": vit, "proj": {"norm_w": (E,), "W": (E, D)}, "lm": lm}


def n_params(c: Gemma3Config) -> int:
    """How many parameters the forward reads (tied embeddings counted once): what a
    checkpoint stores."""
    return layout.count_params(param_shapes(c))


def init_params(c: Gemma3Config, key, dtype=jnp.float32) -> dict:
    """Random params of `c`'s shapes (`models.layout.init_from_shapes`: LayerNorm weights
    near 1, Gemma's RMSNorm weights near 0 (they act as 1 + w), the rest N(0, 0.02^2), the
    patch embedding, position table and token embedding wider so tiny inputs carry
    signal): for tests and benchmarks; a real model is loaded (`load.load_checkpoint`)."""
    scales = {"W_patch": 0.1, "pos": 0.1, "E": 0.3}
    offsets = {name: 0.0 for name in GEMMA_NORMS}
    return layout.init_from_shapes(param_shapes(c), key, dtype, scales, offsets)
