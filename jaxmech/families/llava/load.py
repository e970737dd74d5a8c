"""LLaVA-1.5 checkpoints from their folder: `config.json` and safetensors.

`load_checkpoint(dir)` reads `config.json` (`config.from_hf`), then `model.safetensors`
or the shards a `model.safetensors.index.json` names (`models.hub`: one tensor at a
time, checked, cast, placed), and returns `(config, params)` with params in
TransformerLens layout (`params.py`) on the devices.

* Every key layout met: llava-hf's Hub files (`vision_tower.vision_model.*`,
  `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`),
  transformers 5's saves (the same without `vision_model`), and its in-memory names
  (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
  `lm_head.*`, with or without `vision_model`).
* The CLIP tower's `post_layernorm` (read by CLIP's pooled output, never by LLaVA) is
  accepted and not loaded (`UNUSED`), as a tied checkpoint's stored `lm_head`.
* Errors before anything is placed: a folder without `config.json` or weights names the
  path; a missing, unexpected or wrongly shaped tensor names the tensor and both shapes.
"""

from __future__ import annotations

import numpy as np

from jaxmech.families.llava.config import LlavaConfig, from_hf
from jaxmech.families.llava.params import lm_layout
from jaxmech.models import hub
from jaxmech.models.hub import LoadError, T, heads_bias, heads_in, heads_out, same

__all__ = ["LoadError", "canonical", "key_map", "load_checkpoint", "read_config"]

UNUSED = ("vision.post_layernorm.weight", "vision.post_layernorm.bias")
# stored name prefix -> canonical prefix, first match wins (module docstring)
PREFIXES = (
    ("model.vision_tower.vision_model.", "vision."),
    ("model.vision_tower.", "vision."),
    ("vision_tower.vision_model.", "vision."),
    ("vision_tower.", "vision."),
    ("model.multi_modal_projector.", "proj."),
    ("multi_modal_projector.", "proj."),
    ("model.language_model.", "lm."),
    ("language_model.model.", "lm."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
canonical = hub.prefix_renamer(PREFIXES)  # a stored name in any layout -> canonical (`key_map`)


def _vit_block_map(c: LlavaConfig, i: int) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    b, out = f"vision.encoder.layers.{i}.", f"vit/block_{i}/"
    m = {}
    for hf, ours in (("layer_norm1", "ln1"), ("layer_norm2", "ln2")):
        m |= {b + f"{hf}.weight": (out + f"{ours}_w", (E,), same),
              b + f"{hf}.bias": (out + f"{ours}_b", (E,), same)}  # fmt: skip
    for w in "qkv":
        m[b + f"self_attn.{w}_proj.weight"] = (out + f"W_{w.upper()}", (E, E), heads_in(H, Dh))
        m[b + f"self_attn.{w}_proj.bias"] = (out + f"b_{w.upper()}", (E,), heads_bias(H, Dh))
    m |= {b + "self_attn.out_proj.weight": (out + "W_O", (E, E), heads_out(H, Dh)),
          b + "self_attn.out_proj.bias": (out + "b_O", (E,), same),
          b + "mlp.fc1.weight": (out + "W_in", (M, E), T), b + "mlp.fc1.bias": (out + "b_in", (M,), same),
          b + "mlp.fc2.weight": (out + "W_out", (E, M), T), b + "mlp.fc2.bias": (out + "b_out", (E,), same)}  # fmt: skip
    return m


def key_map(c: LlavaConfig) -> dict:
    """{canonical name: (our "part/.../name", stored shape, transform)}; canonical names
    start `vision.`, `proj.`, `lm.` or `lm_head.` (`canonical`)."""
    E, D, p = c.vit_width, c.lm_width, c.patch_size
    m = {"vision.embeddings.patch_embedding.weight":
             ("vit/W_patch", (E, c.vit_in_chans, p, p), lambda w: w.reshape(E, -1).T),
         "vision.embeddings.class_embedding": ("vit/cls", (E,), same),
         "vision.embeddings.position_embedding.weight": ("vit/pos", (1 + c.n_patches, E), same),
         "vision.pre_layrnorm.weight": ("vit/ln_pre_w", (E,), same),
         "vision.pre_layrnorm.bias": ("vit/ln_pre_b", (E,), same)}  # fmt: skip
    for i in range(c.vit_depth):
        m |= _vit_block_map(c, i)
    m |= {
        "proj.linear_1.weight": ("proj/W1", (D, E), T),
        "proj.linear_2.weight": ("proj/W2", (D, D), T),
    }
    if c.proj_bias:
        m |= {
            "proj.linear_1.bias": ("proj/b1", (D,), same),
            "proj.linear_2.bias": ("proj/b2", (D,), same),
        }
    return m | hub.lm_key_map("lm.", lm_layout(c))


def read_config(folder: str) -> LlavaConfig:
    """The folder's config.json as a `LlavaConfig` (LoadError naming the path)."""
    return hub.read_config(folder, from_hf)


def load_checkpoint(folder: str, dtype=np.float32, place: str = "auto"):
    """(config, params) of a LLaVA checkpoint folder (module docstring;
    `models.hub.load_checkpoint`: `dtype` the params', `place` "auto", "one" or
    "shard"); a tied checkpoint's stored `lm_head` is ignored."""
    return hub.load_checkpoint(folder, dtype, place, from_hf=from_hf, canonical=canonical,
                               key_map=key_map, unused=UNUSED)  # fmt: skip
