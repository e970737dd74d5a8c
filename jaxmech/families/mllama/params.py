"""The mllama params pytree: names and shapes in TransformerLens layout.

  vit/   W_patch [F, E]              the patch Conv2d (no bias) over one patch (C, p, p)
         cls [E]                     the class embedding
         pos [1 + P, E], pos_gate [1]  the gated position embedding's learned table (row 0
                                     the CLS token's, 1 + r g + c patch (r, c)) and gate
         tile_pos [A + 1, T, 1 + P, E]  its tile-specific table per aspect-ratio id
         pre_tile, post_tile [A + 1, T, E], pre_tile_gate, post_tile_gate [1]
         ln_pre_w ln_pre_b ln_post_w ln_post_b [E]
         block_{i}/         a local layer: ln1_w ln1_b ln2_w ln2_b [E]  W_Q W_K W_V
                            [H, E, Dh]  W_O [H, Dh, E]  W_in [E, M] b_in [M]  W_out [M, E]
                            b_out [E]  (no attention biases)
         global_block_{i}/  a global layer: the same, and gate_attn, gate_ffn [1] (tanh)
  proj/  W [Ev, D]  b [D]   Ev = E x (1 + the intermediate layers)
  lm/    E [V + 8, D]  lnf_w [D]  W_U [D, V]
         block_{i}/  a self-attention layer (Llama: ln1_w ln2_w, W_Q [H, D, Dh],
                     W_K W_V [Hkv, D, Dh], W_O, W_gate W_in [D, M], W_out [M, D]); at a
                     cross-attention layer the same names plus q_norm_w k_norm_w [Dh],
                     attn_gate, mlp_gate [1] (tanh); its W_K, W_V read the vision states

A, T, P: the supported aspect ratios, the tiles, the patches of one tile.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.mllama.config import MllamaConfig
from jaxmech.models import layout
from jaxmech.models.layout import is_shape

__all__ = ["init_params", "is_shape", "n_params", "param_shapes"]


def vit_block(c: MllamaConfig, gated: bool) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    s = {n: (E,) for n in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")}
    s |= {"W_Q": (H, E, Dh), "W_K": (H, E, Dh), "W_V": (H, E, Dh), "W_O": (H, Dh, E),
          "W_in": (E, M), "b_in": (M,), "W_out": (M, E), "b_out": (E,)}  # fmt: skip
    return s | ({"gate_attn": (1,), "gate_ffn": (1,)} if gated else {})


def lm_block(c: MllamaConfig, i: int) -> dict:
    s = layout.decoder_block_shapes(hf_vlm.lm_layout(c, vocab=c.lm_vocab + 8))
    if i in c.cross_layers:
        s |= {"q_norm_w": (c.lm_head_dim,), "k_norm_w": (c.lm_head_dim,), "attn_gate": (1,),
              "mlp_gate": (1,)}  # fmt: skip
    return s


def param_shapes(c: MllamaConfig) -> dict:
    """{part: {name or block: shape or {name: shape}}}: every parameter's shape."""
    E, D, A, T, P = c.vit_width, c.lm_width, c.n_aspect + 1, c.max_tiles, c.n_patches
    vit = {"W_patch": (c.patch_features, E), "cls": (E,), "pos": (1 + P, E), "pos_gate": (1,),
           "tile_pos": (A, T, 1 + P, E), "pre_tile": (A, T, E), "pre_tile_gate": (1,),
           "post_tile": (A, T, E), "post_tile_gate": (1,), "ln_pre_w": (E,), "ln_pre_b": (E,),
           "ln_post_w": (E,), "ln_post_b": (E,)}  # fmt: skip
    vit |= {f"block_{i}": vit_block(c, False) for i in range(c.vit_depth)}
    vit |= {f"global_block_{i}": vit_block(c, True) for i in range(c.vit_global_depth)}
    lm = {"E": (c.lm_vocab + 8, D), "lnf_w": (D,)}
    lm |= {f"block_{i}": lm_block(c, i) for i in range(c.lm_layers)}
    if not c.tie_embeddings:
        lm["W_U"] = (D, c.lm_vocab)
    return {"vit": vit, "proj": {"W": (c.vision_dim, D), "b": (D,)}, "lm": lm}


def n_params(c: MllamaConfig) -> int:
    """How many parameters a checkpoint stores (the reference's `num_parameters()`)."""
    return layout.count_params(param_shapes(c))


def init_params(c: MllamaConfig, key, dtype=jnp.float32) -> dict:
    """Random params of `c`'s shapes (`models.layout.init_from_shapes`): for tests and
    benchmarks; a real model is loaded (`load.load_checkpoint`)."""
    scales = {"W_patch": 0.1, "pos": 0.1, "cls": 0.1, "tile_pos": 0.1, "pre_tile": 0.1,
              "post_tile": 0.1}  # fmt: skip
    return layout.init_from_shapes(param_shapes(c), key, dtype, scales)
