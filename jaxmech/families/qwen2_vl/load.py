"""Qwen2-VL / Qwen2.5-VL checkpoints from their folder: `config.json` and safetensors.

`load_checkpoint(dir)` reads `config.json` (`config.from_hf`), then `model.safetensors`
or the shards a `model.safetensors.index.json` names (`models.hub`: one tensor at a
time, checked, cast, placed), and returns `(config, params)` with params in
TransformerLens layout (`params.py`) on the devices.

* Both key layouts: the Hub's (`visual.*`, `model.*` for the LM, `lm_head.weight`) and
  the one newer `transformers` versions keep in memory and some save
  (`model.visual.*`, `model.language_model.*`).
* Tensors stored as float32, float16 or bfloat16, cast to `dtype` (float32 by default:
  what the reference comparison runs in).
* Errors before anything is read: a folder without `config.json` or weights names the
  path; a missing, unexpected or wrongly shaped tensor names the tensor and both shapes.
"""

from __future__ import annotations

import numpy as np

from jaxmech.config import ConfigError
from jaxmech.families.qwen2_vl.config import QwenVLConfig, from_hf
from jaxmech.models.hub import (
    LoadError,
    Stored,
    check_place,
    check_tensors,
    place_params,
    read_json_config,
    weight_files,
)
from jaxmech.models.hub import T as _T
from jaxmech.models.hub import heads_in as _heads_in
from jaxmech.models.hub import heads_out as _heads_out
from jaxmech.models.hub import same as _same

__all__ = ["LoadError", "Stored", "key_map", "canonical", "read_config", "load_checkpoint",
           "weight_files"]  # fmt: skip


# ---------------------------------------------------------------------------
# The key map: canonical HF name -> (our path, the HF shape, transform)


def _vit_block_map(c: QwenVLConfig, i: int) -> dict:
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    b, out = f"visual.blocks.{i}.", f"vit/block_{i}/"
    m = {
        b + "norm1.weight": (out + "ln1_w", (E,), _same),
        b + "norm2.weight": (out + "ln2_w", (E,), _same),
    }
    if c.variant == "qwen2_vl":
        m |= {
            b + "norm1.bias": (out + "ln1_b", (E,), _same),
            b + "norm2.bias": (out + "ln2_b", (E,), _same),
        }
    for j, w in enumerate("QKV"):
        m[b + f"attn.qkv.weight#{j}"] = (
            out + f"W_{w}",
            (3 * E, E),
            lambda x, j=j: _heads_in(H, Dh)(x[j * E : (j + 1) * E]),
        )
        m[b + f"attn.qkv.bias#{j}"] = (
            out + f"b_{w}",
            (3 * E,),
            lambda x, j=j: x[j * E : (j + 1) * E].reshape(H, Dh),
        )
    m |= {
        b + "attn.proj.weight": (out + "W_O", (E, E), _heads_out(H, Dh)),
        b + "attn.proj.bias": (out + "b_O", (E,), _same),
    }
    names = (
        {"fc1": "in", "fc2": "out"}
        if c.variant == "qwen2_vl"
        else {"gate_proj": "gate", "up_proj": "in", "down_proj": "out"}
    )
    for hf, ours in names.items():
        shape = (E, M) if ours == "out" else (M, E)
        m[b + f"mlp.{hf}.weight"] = (out + f"W_{ours}", shape, _T)
        m[b + f"mlp.{hf}.bias"] = (out + f"b_{ours}", (shape[0],), _same)
    return m


def _lm_block_map(c: QwenVLConfig, i: int) -> dict:
    D, H, K, Dh, M = c.lm_width, c.lm_heads, c.lm_kv_heads, c.lm_head_dim, c.lm_mlp
    b, out = f"lm.layers.{i}.", f"lm/block_{i}/"
    m = {
        b + "input_layernorm.weight": (out + "ln1_w", (D,), _same),
        b + "post_attention_layernorm.weight": (out + "ln2_w", (D,), _same),
    }
    for w, n in (("q", H), ("k", K), ("v", K)):
        m[b + f"self_attn.{w}_proj.weight"] = (
            out + f"W_{w.upper()}",
            (n * Dh, D),
            _heads_in(n, Dh),
        )
        m[b + f"self_attn.{w}_proj.bias"] = (
            out + f"b_{w.upper()}",
            (n * Dh,),
            lambda x, n=n: x.reshape(n, Dh),
        )
    m[b + "self_attn.o_proj.weight"] = (out + "W_O", (D, H * Dh), _heads_out(H, Dh))
    for hf, ours, shape in (
        ("gate_proj", "W_gate", (M, D)),
        ("up_proj", "W_in", (M, D)),
        ("down_proj", "W_out", (D, M)),
    ):
        m[b + f"mlp.{hf}.weight"] = (out + ours, shape, _T)
    return m


def key_map(c: QwenVLConfig) -> dict:
    """{canonical HF name: (our "part/.../name", HF shape, transform)}; canonical names
    start `visual.`, `lm.` (the LM's `model.` / `model.language_model.`) or `lm_head.`;
    a fused qkv tensor appears once per part as `name#0/1/2`."""
    E, D, W = c.vit_width, c.lm_width, c.merge_width
    patch = (E, c.vit_in_chans, c.temporal_patch_size, c.patch_size, c.patch_size)
    m = {"visual.patch_embed.proj.weight": ("vit/W_patch", patch, lambda w: w.reshape(E, -1).T)}
    for i in range(c.vit_depth):
        m |= _vit_block_map(c, i)
    m |= {
        "visual.merger.ln_q.weight": ("merger/ln_w", (E,), _same),
        "visual.merger.mlp.0.weight": ("merger/W1", (W, W), _T),
        "visual.merger.mlp.0.bias": ("merger/b1", (W,), _same),
        "visual.merger.mlp.2.weight": ("merger/W2", (D, W), _T),
        "visual.merger.mlp.2.bias": ("merger/b2", (D,), _same),
    }
    if c.variant == "qwen2_vl":
        m["visual.merger.ln_q.bias"] = ("merger/ln_b", (E,), _same)
    m |= {
        "lm.embed_tokens.weight": ("lm/E", (c.lm_vocab, D), _same),
        "lm.norm.weight": ("lm/lnf_w", (D,), _same),
    }
    for i in range(c.lm_layers):
        m |= _lm_block_map(c, i)
    if not c.tie_embeddings:
        m["lm_head.weight"] = ("lm/W_U", (c.lm_vocab, D), _T)
    return m


def canonical(name: str) -> str:
    """A stored tensor's name in either layout -> its canonical name (`key_map`)."""
    for prefix, to in (
        ("model.visual.", "visual."),
        ("model.language_model.", "lm."),
        ("visual.", "visual."),
        ("model.", "lm."),
        ("lm_head.", "lm_head."),
    ):
        if name.startswith(prefix):
            return to + name[len(prefix) :]
    return name


def read_config(folder: str) -> QwenVLConfig:
    """The folder's config.json as a `QwenVLConfig` (LoadError naming the path)."""
    return read_json_config(folder, from_hf, (KeyError, ConfigError))


def load_checkpoint(folder: str, dtype=np.float32, place: str = "auto"):
    """(config, params) of a Qwen2-VL / Qwen2.5-VL checkpoint folder (module docstring).

    Args:
      folder: holds config.json and model.safetensors (or a sharded index).
      dtype: the params' dtype (float32, bfloat16, float16).
      place: "auto" (one device if the params fit, else sharded), "one" or "shard".
    """
    check_place(place)
    config = read_config(folder)
    stored = Stored(weight_files(folder), canonical)
    m = key_map(config)
    # some tied checkpoints store the unembedding's copy
    check_tensors(stored, m, ignore=("lm_head.weight",) if config.tie_embeddings else ())
    return config, place_params(stored, m, dtype, place)
