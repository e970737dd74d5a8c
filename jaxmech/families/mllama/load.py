"""Llama-3.2-Vision (mllama) checkpoints from their folder: `config.json` and safetensors.

`load_checkpoint(dir)` reads `config.json` (`config.from_hf`), then `model.safetensors`
or the shards an index names (`models.hub`: names and shapes checked before a tensor is
read, cast, placed) and returns `(config, params)` in TransformerLens layout
(`params.py`). Layouts: the Hub's (`vision_model.*`, `multi_modal_projector.*`,
`language_model.model.*`, `language_model.lm_head.*`), which transformers 5.25's
`save_pretrained` also writes, and its in-memory names (`model.vision_model.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`). The gates
stay [1]; the tile tables [A + 1, T x ... x E] become [A + 1, T, ...,
E].
"""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.mllama.config import MllamaConfig, from_hf
from jaxmech.models import hub
from jaxmech.models.hub import T, heads_in, heads_out, same

__all__ = ["canonical", "key_map", "load_checkpoint", "read_config"]

PREFIXES = (
    ("model.vision_model.", "vision."),
    ("vision_model.", "vision."),
    *hf_vlm.PROJ_LM_PREFIXES,
)
canonical = hub.prefix_renamer(PREFIXES)


def _vit_block(c: MllamaConfig, stored: str, ours: str, gated: bool) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    m = {}
    for hf, name in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
        m |= {stored + f"{hf}.weight": (ours + f"{name}_w", (E,), same),
              stored + f"{hf}.bias": (ours + f"{name}_b", (E,), same)}  # fmt: skip
    for w in "qkv":
        m[stored + f"self_attn.{w}_proj.weight"] = (
            ours + f"W_{w.upper()}",
            (E, E),
            heads_in(H, Dh),
        )
    m |= {stored + "self_attn.o_proj.weight": (ours + "W_O", (E, E), heads_out(H, Dh)),
          stored + "mlp.fc1.weight": (ours + "W_in", (M, E), T),
          stored + "mlp.fc1.bias": (ours + "b_in", (M,), same),
          stored + "mlp.fc2.weight": (ours + "W_out", (E, M), T),
          stored + "mlp.fc2.bias": (ours + "b_out", (E,), same)}  # fmt: skip
    if gated:
        m |= {stored + "gate_attn": (ours + "gate_attn", (1,), same),
              stored + "gate_ffn": (ours + "gate_ffn", (1,), same)}  # fmt: skip
    return m


def _lm_block(c: MllamaConfig, i: int) -> dict:
    D, H, K, Dh, M = c.lm_width, c.lm_heads, c.lm_kv_heads, c.lm_head_dim, c.lm_mlp
    s, o = f"lm.layers.{i}.", f"lm/block_{i}/"
    attn = "cross_attn" if i in c.cross_layers else "self_attn"
    m = {s + "input_layernorm.weight": (o + "ln1_w", (D,), same),
         s + "post_attention_layernorm.weight": (o + "ln2_w", (D,), same),
         s + f"{attn}.o_proj.weight": (o + "W_O", (D, H * Dh), heads_out(H, Dh))}  # fmt: skip
    for w, n in (("q", H), ("k", K), ("v", K)):
        m[s + f"{attn}.{w}_proj.weight"] = (o + f"W_{w.upper()}", (n * Dh, D), heads_in(n, Dh))
    for hf, name, shape in (("gate_proj", "gate", (M, D)), ("up_proj", "in", (M, D)),
                            ("down_proj", "out", (D, M))):  # fmt: skip
        m[s + f"mlp.{hf}.weight"] = (o + f"W_{name}", shape, T)
    if i in c.cross_layers:
        m |= {s + "cross_attn.q_norm.weight": (o + "q_norm_w", (Dh,), same),
              s + "cross_attn.k_norm.weight": (o + "k_norm_w", (Dh,), same),
              s + "cross_attn_attn_gate": (o + "attn_gate", (1,), same),
              s + "cross_attn_mlp_gate": (o + "mlp_gate", (1,), same)}  # fmt: skip
    return m


def key_map(c: MllamaConfig) -> dict:
    """{canonical name: (our "part/.../name", stored shape, transform)}."""
    E, D, p, A, T_, P = (
        c.vit_width,
        c.lm_width,
        c.patch_size,
        c.n_aspect + 1,
        c.max_tiles,
        c.n_patches,
    )
    v = "vision."
    m = {v + "patch_embedding.weight": ("vit/W_patch", (E, 3, p, p), lambda w: w.reshape(E, -1).T),
         v + "class_embedding": ("vit/cls", (E,), same),
         v + "gated_positional_embedding.embedding": ("vit/pos", (1 + P, E), same),
         v + "gated_positional_embedding.gate": ("vit/pos_gate", (1,), same),
         v + "gated_positional_embedding.tile_embedding.weight":
             ("vit/tile_pos", (A, T_ * (1 + P) * E), lambda w: w.reshape(A, T_, 1 + P, E)),
         v + "layernorm_pre.weight": ("vit/ln_pre_w", (E,), same),
         v + "layernorm_pre.bias": ("vit/ln_pre_b", (E,), same),
         v + "layernorm_post.weight": ("vit/ln_post_w", (E,), same),
         v + "layernorm_post.bias": ("vit/ln_post_b", (E,), same)}  # fmt: skip
    for which in ("pre", "post"):
        m |= {v + f"{which}_tile_positional_embedding.embedding.weight":
                  (f"vit/{which}_tile", (A, T_ * E), lambda w: w.reshape(A, T_, E)),
              v + f"{which}_tile_positional_embedding.gate": (f"vit/{which}_tile_gate", (1,), same)}  # fmt: skip
    for i in range(c.vit_depth):
        m |= _vit_block(c, f"{v}transformer.layers.{i}.", f"vit/block_{i}/", False)
    for i in range(c.vit_global_depth):
        m |= _vit_block(c, f"{v}global_transformer.layers.{i}.", f"vit/global_block_{i}/", True)
    m |= {"proj.weight": ("proj/W", (D, c.vision_dim), T), "proj.bias": ("proj/b", (D,), same),
          "lm.embed_tokens.weight": ("lm/E", (c.lm_vocab + 8, D), same),
          "lm.norm.weight": ("lm/lnf_w", (D,), same)}  # fmt: skip
    for i in range(c.lm_layers):
        m |= _lm_block(c, i)
    if not c.tie_embeddings:
        m[hub.HEAD] = ("lm/W_U", (c.lm_vocab, D), T)
    return m


read_config, load_checkpoint = hf_vlm.loaders("mllama", from_hf, canonical, key_map)
