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

from jaxmech.families import hf_vlm
from jaxmech.families.gemma3.config import Gemma3Config, from_hf
from jaxmech.families.gemma3.params import lm_layout
from jaxmech.models import hub
from jaxmech.models.hub import LoadError, same

__all__ = ["LoadError", "canonical", "key_map", "load_checkpoint", "read_config"]

canonical = hub.prefix_renamer(hf_vlm.HUB_PREFIXES)  # a stored name -> canonical (`key_map`)


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
        m |= hf_vlm.clip_block_map(c, i)
    m |= {"proj.mm_soft_emb_norm.weight": ("proj/norm_w", (E,), same),
          "proj.mm_input_projection_weight": ("proj/W", (E, c.lm_width), same)}  # fmt: skip
    return m | _lm_map(c)


read_config, load_checkpoint = hf_vlm.loaders("Gemma-3", from_hf, canonical, key_map)
