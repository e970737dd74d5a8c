"""Gemma-3 checkpoints from their folder: `config.json` and safetensors.

`load_checkpoint(dir)` reads `config.json` (`config.from_hf`), then `model.safetensors`
or the shards a `model.safetensors.index.json` names (`models.hub`: one tensor at a
time, checked, cast, placed), and returns `(config, params)` with params in
TransformerLens layout (`params.py`) on the devices.

* Every key layout met: the Hub's (google/gemma-3-*-it: `vision_tower.vision_model.*`,
  `multi_modal_projector.*`, `language_model.model.*`, no `lm_head`: tied), what
  transformers 5.25 saves (the same with `vision_tower.*` without `vision_model`), and
  its in-memory names (`model.vision_tower.*`, `model.multi_modal_projector.*`,
  `model.language_model.*`, `lm_head.*`).
* A tied checkpoint's stored `lm_head` is ignored (the reference ties it).
* Errors before anything is placed: a folder without `config.json` or weights names the
  path; a missing, unexpected or wrongly shaped tensor names the tensor and both shapes.
"""

from __future__ import annotations

import numpy as np

from jaxmech.families.gemma3.config import Gemma3Config, from_hf
from jaxmech.families.gemma3.params import lm_layout
from jaxmech.models import hub
from jaxmech.models.hub import LoadError, T, heads_bias, heads_in, heads_out, same

__all__ = ["LoadError", "canonical", "key_map", "load_checkpoint", "read_config"]

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


def _vit_block_map(c: Gemma3Config, i: int) -> dict:
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


def _lm_map(c: Gemma3Config) -> dict:
    """The Llama-layout map (`models.hub.lm_key_map`) with Gemma's four block norms:
    post_attention_layernorm is the attention's post norm here (ln1_post_w), the MLP's
    pre norm is pre_feedforward_layernorm (ln2_w)."""
    m = hub.lm_key_map("lm.", lm_layout(c))
    D = c.lm_width
    for i in range(c.lm_layers):
        b = f"lm.layers.{i}."
        out = lambda name, i=i: hub.stacked_path(f"lm/blocks/{name}", i)  # noqa: E731
        m[b + "post_attention_layernorm.weight"] = (out("ln1_post_w"), (D,), same)
        m[b + "pre_feedforward_layernorm.weight"] = (out("ln2_w"), (D,), same)
        m[b + "post_feedforward_layernorm.weight"] = (out("ln2_post_w"), (D,), same)
    return m


def key_map(c: Gemma3Config) -> dict:
    """{canonical name: (our "part/.../name", stored shape, transform)}; canonical names
    start `vision.`, `proj.`, `lm.` or `lm_head.` (`canonical`)."""
    E, p = c.vit_width, c.patch_size
    m = {"vision.embeddings.patch_embedding.weight":
             ("vit/W_patch", (E, c.vit_in_chans, p, p), lambda w: w.reshape(E, -1).T),
         "vision.embeddings.patch_embedding.bias": ("vit/b_patch", (E,), same),
         "vision.embeddings.position_embedding.weight": ("vit/pos", (c.n_patches, E), same),
         "vision.post_layernorm.weight": ("vit/ln_post_w", (E,), same),
         "vision.post_layernorm.bias": ("vit/ln_post_b", (E,), same)}  # fmt: skip
    for i in range(c.vit_depth):
        m |= _vit_block_map(c, i)
    m |= {"proj.mm_soft_emb_norm.weight": ("proj/norm_w", (E,), same),
          "proj.mm_input_projection_weight": ("proj/W", (E, c.lm_width), same)}  # fmt: skip
    return m | _lm_map(c)


def read_config(folder: str) -> Gemma3Config:
    """The folder's config.json as a `Gemma3Config` (LoadError naming the path)."""
    return hub.read_config(folder, from_hf)


def load_checkpoint(folder: str, dtype=np.float32, place: str = "auto"):
    """(config, params) of a Gemma-3 checkpoint folder (module docstring;
    `models.hub.load_checkpoint`: `dtype` the params', `place` "auto", "one" or
    "shard")."""
    return hub.load_checkpoint(folder, dtype, place, from_hf=from_hf, canonical=canonical,
                               key_map=key_map)  # fmt: skip
