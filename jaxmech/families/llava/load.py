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

from jaxmech.families import hf_vlm
from jaxmech.families.llava.config import LlavaConfig, from_hf
from jaxmech.families.llava.params import lm_layout
from jaxmech.models import hub
from jaxmech.models.hub import LoadError, T, same

__all__ = ["LoadError", "canonical", "key_map", "load_checkpoint", "read_config"]

UNUSED = ("vision.post_layernorm.weight", "vision.post_layernorm.bias")
canonical = hub.prefix_renamer(hf_vlm.HUB_PREFIXES)  # a stored name -> canonical (`key_map`)


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
        m |= hf_vlm.clip_block_map(c, i)
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


# a tied checkpoint's stored `lm_head` is ignored
read_config, load_checkpoint = hf_vlm.loaders("LLaVA", from_hf, canonical, key_map, unused=UNUSED)
