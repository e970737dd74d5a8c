"""InternVL (-hf) checkpoints from their folder: `config.json` and safetensors.

`load_checkpoint(dir)` reads `config.json` (`config.from_hf`), then `model.safetensors`
or the shards a `model.safetensors.index.json` names (`models.hub`: one tensor at a
time, checked against the key map before any is read, cast, laid out, placed), and
returns `(config, params)` with params in TransformerLens layout (`params.py`).

* Both key layouts: the -hf Hub files' (`vision_tower.*`, `multi_modal_projector.*`,
  `language_model.model.*`, `language_model.lm_head.weight`) and the one transformers 5
  saves (`model.vision_tower.*`, `model.multi_modal_projector.*`,
  `model.language_model.*`, `lm_head.weight`). The original OpenGVLab layout
  (`vision_model.*`, `mlp1.*`, fused qkv) is refused by `config.from_hf` (its
  model_type) and, without that, as unexpected tensors.
* A stored unembedding is used even where config.json says the embeddings are tied
  (as transformers does when the two differ); none stored and tied: E^T.
* Tensors stored as float32, float16 or bfloat16, cast to `dtype`.
"""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.internvl.config import InternVLConfig, from_hf
from jaxmech.families.internvl.params import lm_layout
from jaxmech.models import hub
from jaxmech.models.hub import (
    LoadError,
    Stored,
    heads_bias,
    heads_in,
    heads_out,
    same,
    weight_files,
)

__all__ = ["LoadError", "Stored", "canonical", "key_map", "load_checkpoint", "read_config",
           "weight_files"]  # fmt: skip


def _vit_block_map(c: InternVLConfig, i: int) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    b, out = f"vision_tower.encoder.layer.{i}.", f"vit/block_{i}/"
    m = hf_vlm.norm_map(b, out, {"layernorm_before": "ln1", "layernorm_after": "ln2"}, E)
    m |= {
        b + "lambda_1": (out + "ls1", (E,), same),
        b + "lambda_2": (out + "ls2", (E,), same),
        b + "attention.projection_layer.weight": (out + "W_O", (E, E), heads_out(H, Dh)),
        b + "attention.projection_layer.bias": (out + "b_O", (E,), same),
    }
    m |= hf_vlm.mlp_map(b, out, {"mlp.fc1": "in", "mlp.fc2": "out"}, E, M)
    for w in "qkv":
        m[b + f"attention.{w}_proj.weight"] = (out + f"W_{w.upper()}", (E, E), heads_in(H, Dh))
        if c.vit_qkv_bias:
            m[b + f"attention.{w}_proj.bias"] = (out + f"b_{w.upper()}", (E,), heads_bias(H, Dh))
    return m


def key_map(c: InternVLConfig) -> dict:
    """{canonical name: (our "part/.../name", stored shape, transform)}; canonical names
    start `vision_tower.`, `multi_modal_projector.`, `language_model.` (the LM's body)
    or `lm_head.`; the position table appears once per part (`#0` the CLS row, `#1` the
    n x n grid)."""
    E, D, W, n = c.vit_width, c.lm_width, c.proj_width, c.table_side
    p, emb = c.patch_size, "vision_tower.embeddings."
    table = (1, 1 + n * n, E)
    m = {
        emb + "patch_embeddings.projection.weight": (
            "vit/W_patch", (E, c.vit_in_chans, p, p), lambda w: w.reshape(E, -1).T),
        emb + "patch_embeddings.projection.bias": ("vit/b_patch", (E,), same),
        emb + "cls_token": ("vit/cls", (1, 1, E), lambda w: w.reshape(E)),
        emb + "position_embeddings#0": ("vit/pos_cls", table, lambda w: w[0, 0]),
        emb + "position_embeddings#1": ("vit/pos", table, lambda w: w[0, 1:].reshape(n, n, E)),
    }  # fmt: skip
    for i in range(c.vit_depth):
        m |= _vit_block_map(c, i)
    pj = "multi_modal_projector."
    m |= {
        pj + "layer_norm.weight": ("proj/ln_w", (W,), same),
        pj + "layer_norm.bias": ("proj/ln_b", (W,), same),
        pj + "linear_1.weight": ("proj/W1", (D, W), hub.T),
        pj + "linear_1.bias": ("proj/b1", (D,), same),
        pj + "linear_2.weight": ("proj/W2", (D, D), hub.T),
        pj + "linear_2.bias": ("proj/b2", (D,), same),
    }
    return m | hub.lm_key_map("language_model.", lm_layout(c))


PREFIXES = (  # stored prefix -> canonical, the longest first
    ("model.language_model.", "language_model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
)
canonical = hub.prefix_renamer(PREFIXES)  # a stored name in either layout -> canonical (`key_map`)


# a stored unembedding wins over config.json's tying (as transformers)
read_config, load_checkpoint = hf_vlm.loaders("InternVL -hf", from_hf, canonical, key_map,
                                              stored_head_wins=True)  # fmt: skip
