"""The Qwen-VL params pytree: names and shapes in TransformerLens layout.

  vit/     W_patch [F, E]           the Conv3d over one (C, T, p, p) patch as a matmul
                                    (F = C T p p, flattened in that order)
           block_{i}/ ln1_w, ln2_w [E] (+ ln1_b, ln2_b: Qwen2-VL's LayerNorm)
                      W_Q, W_K, W_V [H, E, Dh]  b_Q, b_K, b_V [H, Dh]  W_O [H, Dh, E]  b_O [E]
                      W_in [E, M] b_in [M]  W_out [M, E] b_out [E]  (+ W_gate, b_gate:
                      Qwen2.5-VL's SwiGLU: W_out(silu(x W_gate) * x W_in))
  merger/  ln_w [E] (+ ln_b)  W1 [4E, 4E] b1 [4E]  W2 [4E, D] b2 [D]
  lm/      E [V, D]
           block_{i}/ ln1_w, ln2_w [D]  W_Q [H, D, Dh] b_Q [H, Dh]  W_K, W_V [Hkv, D, Dh]
                      b_K, b_V [Hkv, Dh]  W_O [H, Dh, D]  W_gate, W_in [D, M]  W_out [M, D]
           lnf_w [D]   W_U [D, V] (untied checkpoints only; tied ones read E^T)

E, H, Dh, M: the ViT's width, heads, head width and MLP width; D, Hkv: the LM's width and
key-value heads (grouped-query attention: query head h reads key-value head
h // (H / Hkv)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.families.qwen2_vl.config import QwenVLConfig


def _vit_block(c: QwenVLConfig) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    s = {"ln1_w": (E,), "ln2_w": (E,)}
    if c.variant == "qwen2_vl":
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
    if c.variant == "qwen2_5_vl":
        s |= {"W_gate": (E, M), "b_gate": (M,)}
    return s


def _lm_block(c: QwenVLConfig) -> dict:
    D, H, K, Dh, M = c.lm_width, c.lm_heads, c.lm_kv_heads, c.lm_head_dim, c.lm_mlp
    return {
        "ln1_w": (D,),
        "ln2_w": (D,),
        "W_Q": (H, D, Dh),
        "b_Q": (H, Dh),
        "W_K": (K, D, Dh),
        "b_K": (K, Dh),
        "W_V": (K, D, Dh),
        "b_V": (K, Dh),
        "W_O": (H, Dh, D),
        "W_gate": (D, M),
        "W_in": (D, M),
        "W_out": (M, D),
    }


def param_shapes(c: QwenVLConfig) -> dict:
    """{part: {name or block_i: shape or {name: shape}}}: every parameter's shape."""
    E, D, W = c.vit_width, c.lm_width, c.merge_width
    vit = {"W_patch": (c.patch_features, E)}
    vit |= {f"block_{i}": _vit_block(c) for i in range(c.vit_depth)}
    merger = {"ln_w": (E,), "W1": (W, W), "b1": (W,), "W2": (W, D), "b2": (D,)}
    if c.variant == "qwen2_vl":
        merger["ln_b"] = (E,)
    lm = {"E": (c.lm_vocab, D), "lnf_w": (D,)}
    lm |= {f"block_{i}": _lm_block(c) for i in range(c.lm_layers)}
    if not c.tie_embeddings:
        lm["W_U"] = (D, c.lm_vocab)
    return {"vit": vit, "merger": merger, "lm": lm}


def is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def n_params(c: QwenVLConfig) -> int:
    """How many parameters the checkpoint holds (tied embeddings counted once)."""
    leaves = jax.tree_util.tree_leaves(param_shapes(c), is_leaf=is_shape)
    return int(sum(np.prod(s) for s in leaves))


def init_params(c: QwenVLConfig, key, dtype=jnp.float32) -> dict:
    """Random params of `c`'s shapes (norm weights near 1, biases and weights N(0, 0.02^2),
    the patch embedding wider so tiny images still carry signal): for tests and
    benchmarks; a real model is loaded (`load.load_checkpoint`). One draw, cut into the
    leaves (one compiled program however many leaves)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(c), is_leaf=is_shape)
    sizes = [int(np.prod(shape)) for _, shape in paths]
    flat = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32))
    out, at = [], 0
    for (path, shape), n in zip(paths, sizes):
        name = path[-1].key
        x = (0.1 if name == "W_patch" else 0.02) * flat[at : at + n].reshape(shape)
        at += n
        out.append(
            jnp.asarray(1.0 + x if name.startswith("ln") and name.endswith("_w") else x, dtype)
        )
    return jax.tree_util.tree_unflatten(treedef, out)
