"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints from their folder: `config.json` and
safetensors.

`load_checkpoint(dir)` reads `config.json` (`config.from_hf`), then `model.safetensors`
or the shards a `model.safetensors.index.json` names (`models.hub`: one tensor at a
time, checked, cast, placed), and returns `(config, params)` with params in
TransformerLens layout (`params.py`) on the devices.

* Both key layouts: the Hub's Qwen2 / 2.5-VL files (`visual.*`, `model.*` for the LM,
  `lm_head.weight`) and the one newer `transformers` versions keep in memory and save
  (`model.visual.*`, `model.language_model.*`), which is also the Hub's Qwen3-VL layout
  (its reference has no conversion mapping).
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
    if c.vit_layer_norm:
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
    names = {
        "qwen2_vl": {"fc1": "in", "fc2": "out"},
        "qwen2_5_vl": {"gate_proj": "gate", "up_proj": "in", "down_proj": "out"},
        "qwen3_vl": {"linear_fc1": "in", "linear_fc2": "out"},
    }[c.variant]
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
        if c.lm_qkv_bias:
            m[b + f"self_attn.{w}_proj.bias"] = (
                out + f"b_{w.upper()}",
                (n * Dh,),
                lambda x, n=n: x.reshape(n, Dh),
            )
    if c.lm_qk_norm:
        for w in "qk":
            m[b + f"self_attn.{w}_norm.weight"] = (out + f"{w}_norm_w", (Dh,), _same)
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
    E, D = c.vit_width, c.lm_width
    patch = (E, c.vit_in_chans, c.temporal_patch_size, c.patch_size, c.patch_size)
    m = {"visual.patch_embed.proj.weight": ("vit/W_patch", patch, lambda w: w.reshape(E, -1).T)}
    if c.patch_bias:
        m["visual.patch_embed.proj.bias"] = ("vit/b_patch", (E,), _same)
    if c.vit_pos_table:
        m["visual.pos_embed.weight"] = ("vit/pos_table", (c.vit_pos_table, E), _same)
    for i in range(c.vit_depth):
        m |= _vit_block_map(c, i)
    m |= _merger_map(c)
    m |= {
        "lm.embed_tokens.weight": ("lm/E", (c.lm_vocab, D), _same),
        "lm.norm.weight": ("lm/lnf_w", (D,), _same),
    }
    for i in range(c.lm_layers):
        m |= _lm_block_map(c, i)
    if not c.tie_embeddings:
        m["lm_head.weight"] = ("lm/W_U", (c.lm_vocab, D), _T)
    return m


def _merger_map(c: QwenVLConfig) -> dict:
    """The merger's (and Qwen3-VL's DeepStack mergers') names: Qwen2 / 2.5-VL's
    `merger.{ln_q, mlp.0, mlp.2}`, Qwen3-VL's `merger.{norm, linear_fc1, linear_fc2}` and
    `deepstack_merger_list.{k}.*` (their norms over 4E, after the shuffle)."""
    E, D, W = c.vit_width, c.lm_width, c.merge_width
    names = ("ln_q", "mlp.0", "mlp.2")
    if c.variant == "qwen3_vl":
        names = ("norm", "linear_fc1", "linear_fc2")
    parts = [("visual.merger.", "merger/", E)]
    parts += [(f"visual.deepstack_merger_list.{k}.", f"deepstack/merger_{k}/", W)
              for k in range(len(c.vit_deepstack))]  # fmt: skip
    m = {}
    for hf, ours, n in parts:
        norm, fc1, fc2 = (hf + x for x in names)
        m |= {
            norm + ".weight": (ours + "ln_w", (n,), _same),
            fc1 + ".weight": (ours + "W1", (W, W), _T),
            fc1 + ".bias": (ours + "b1", (W,), _same),
            fc2 + ".weight": (ours + "W2", (D, W), _T),
            fc2 + ".bias": (ours + "b2", (D,), _same),
        }
        if c.vit_layer_norm:
            m[norm + ".bias"] = (ours + "ln_b", (n,), _same)
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
    """(config, params) of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint folder (module
    docstring).

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
