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

from jaxmech.families import hf_vlm
from jaxmech.families.qwen2_vl.config import QwenVLConfig, from_hf
from jaxmech.families.qwen2_vl.params import lm_layout
from jaxmech.models import hub
from jaxmech.models.hub import LoadError, Stored, weight_files
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
    norms = {"norm1": "ln1", "norm2": "ln2"}
    m = hf_vlm.norm_map(b, out, norms, E, ("weight",))
    if c.vit_layer_norm:
        m |= hf_vlm.norm_map(b, out, norms, E, ("bias",))
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
    return m | hf_vlm.mlp_map(b, out, {f"mlp.{hf}": ours for hf, ours in names.items()}, E, M)


def key_map(c: QwenVLConfig) -> dict:
    """{canonical HF name: (our "part/.../name", HF shape, transform)}; canonical names
    start `visual.`, `lm.` (the LM's `model.` / `model.language_model.`) or `lm_head.`;
    a fused qkv tensor appears once per part as `name#0/1/2`."""
    E = c.vit_width
    patch = (E, c.vit_in_chans, c.temporal_patch_size, c.patch_size, c.patch_size)
    m = {"visual.patch_embed.proj.weight": ("vit/W_patch", patch, lambda w: w.reshape(E, -1).T)}
    if c.patch_bias:
        m["visual.patch_embed.proj.bias"] = ("vit/b_patch", (E,), _same)
    if c.vit_pos_table:
        m["visual.pos_embed.weight"] = ("vit/pos_table", (c.vit_pos_table, E), _same)
    for i in range(c.vit_depth):
        m |= _vit_block_map(c, i)
    return m | _merger_map(c) | hub.lm_key_map("lm.", lm_layout(c))


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


PREFIXES = (  # stored prefix -> canonical, first match wins
    ("model.visual.", "visual."),
    ("model.language_model.", "lm."),
    ("visual.", "visual."),
    ("model.", "lm."),
    ("lm_head.", "lm_head."),
)
canonical = hub.prefix_renamer(PREFIXES)  # a stored name in either layout -> canonical (`key_map`)


# some tied checkpoints store the unembedding's copy, which is ignored
read_config, load_checkpoint = hf_vlm.loaders("Qwen2-VL / Qwen2.5-VL / Qwen3-VL", from_hf,
                                              canonical, key_map)  # fmt: skip
