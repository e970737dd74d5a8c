"""Qwen2-VL / Qwen2.5-VL checkpoints from their folder: `config.json` and safetensors.

`load_checkpoint(dir)` reads `config.json` (`config.from_hf`), then `model.safetensors`
or the shards a `model.safetensors.index.json` names, and returns `(config, params)`
with params in TransformerLens layout (`params.py`) on the devices.

* Both key layouts: the Hub's (`visual.*`, `model.*` for the LM, `lm_head.weight`) and
  the one newer `transformers` versions keep in memory and some save
  (`model.visual.*`, `model.language_model.*`).
* Tensors stored as float32, float16 or bfloat16 (bfloat16 through `ml_dtypes`), cast
  to `dtype` (float32 by default: what the reference comparison runs in).
* The files are read one tensor at a time (the safetensors format: an 8-byte
  little-endian header length, a JSON header of `{name: {dtype, shape, data_offsets}}`,
  the raw bytes), and each is cast, laid out and put on the devices before the next
  is read, so the weights are held once, in `dtype` (`Stored`).
* Placement: on one device when the params fit in its memory, else each matrix split
  over every device along an axis they divide (`place="auto"`; "one" or "shard" force
  either).
* Errors before anything is read: a folder without `config.json` or weights names the
  path; a missing, unexpected or wrongly shaped tensor names the tensor and both shapes.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import ml_dtypes
import numpy as np

from jaxmech.config import ConfigError
from jaxmech.families.qwen2_vl.config import QwenVLConfig, from_hf

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class LoadError(ValueError):
    """A folder that is not a loadable Qwen-VL checkpoint (the message names what)."""


# ---------------------------------------------------------------------------
# The key map: canonical HF name -> (our path, the HF shape, transform)


def _heads_in(H: int, Dh: int):
    """Linear [H Dh, D] (out, in) -> [H, D, Dh]."""
    return lambda w: w.reshape(H, Dh, -1).transpose(0, 2, 1)


def _heads_out(H: int, Dh: int):
    """Linear [D, H Dh] -> W_O [H, Dh, D]."""
    return lambda w: w.T.reshape(H, Dh, -1)


def _T(w):
    return w.T


def _same(w):
    return w


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


# ---------------------------------------------------------------------------
# Files


def _header(path: str) -> tuple[dict, int]:
    """A safetensors file's tensor table and where its data start."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise LoadError(f"{path}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        try:
            table = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LoadError(f"{path}: not a safetensors file ({e})") from None
    table.pop("__metadata__", None)
    return table, 8 + n


def weight_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files (a sharded index's, or model.safetensors)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, s) for s in shards]
        for p in files:
            if not os.path.exists(p):
                raise LoadError(f"{index}: names the shard {p}, which is missing")
        return files
    single = os.path.join(folder, "model.safetensors")
    if not os.path.exists(single):
        raise LoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    return [single]


class Stored:
    """The tensors of a checkpoint's files, read one at a time: name -> (file, entry,
    start). Not memory-mapped: a mapped file's pages count in the process's resident
    memory until the map closes, so mapping 4.4 GB of weights while placing them held
    them twice (8.7 GB at the peak for Qwen2-VL-2B in bfloat16)."""

    def __init__(self, files: list[str]):
        self.entries = {}
        for p in files:
            table, start = _header(p)
            for name, entry in table.items():
                if entry["dtype"] not in DTYPES:
                    raise LoadError(
                        f"{p}: tensor {name} has dtype {entry['dtype']}, "
                        f"expected one of {', '.join(DTYPES)}"
                    )
                self.entries[canonical(name)] = (p, entry, start, name)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key][1]["shape"])

    def array(self, key: str) -> np.ndarray:
        path, entry, start, _ = self.entries[key]
        lo, hi = entry["data_offsets"]
        raw = np.fromfile(path, np.uint8, count=hi - lo, offset=start + lo)
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def read_config(folder: str) -> QwenVLConfig:
    """The folder's config.json as a `QwenVLConfig` (LoadError naming the path)."""
    if not os.path.isdir(folder):
        raise LoadError(f"checkpoint = {folder!r}: not a folder")
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise LoadError(f"checkpoint = {folder!r}: no config.json (not a checkpoint folder)")
    with open(path) as f:
        try:
            return from_hf(json.load(f))
        except (KeyError, ConfigError) as e:
            raise LoadError(f"{path}: {e}") from None


def check_tensors(stored: Stored, c: QwenVLConfig) -> dict:
    """The key map, after every stored tensor was matched (names and shapes)."""
    m = key_map(c)
    want = {k.split("#")[0]: v[1] for k, v in m.items()}
    have = dict(stored.entries)
    if c.tie_embeddings:
        have.pop("lm_head.weight", None)  # some tied checkpoints store the copy
    missing = sorted(set(want) - set(have))
    if missing:
        raise LoadError(
            f"missing tensor {missing[0]} (shape {want[missing[0]]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    extra = sorted(set(have) - set(want))
    if extra:
        name = stored.entries[extra[0]][3]
        raise LoadError(
            f"unexpected tensor {name} (shape {stored.shape(extra[0])}) in {stored.entries[extra[0]][0]}"
        )
    for key, shape in want.items():
        if stored.shape(key) != tuple(shape):
            raise LoadError(
                f"tensor {stored.entries[key][3]}: shape {stored.shape(key)} in the file, "
                f"expected {tuple(shape)} from config.json"
            )
    return m


# ---------------------------------------------------------------------------
# Placement


def _fits_one(n_bytes: int) -> bool:
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit is None or n_bytes < 0.8 * limit


def _sharding(shape, devices):
    """Split the largest axis the device count divides; replicate what none divides."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(devices), ("d",))
    axes = [a for a in np.argsort(shape)[::-1] if shape[a] % len(devices) == 0]
    spec = [None] * len(shape)
    if axes and len(shape) >= 2:
        spec[axes[0]] = "d"
    return NamedSharding(mesh, PartitionSpec(*spec))


def load_checkpoint(folder: str, dtype=np.float32, place: str = "auto"):
    """(config, params) of a Qwen2-VL / Qwen2.5-VL checkpoint folder (module docstring).

    Args:
      folder: holds config.json and model.safetensors (or a sharded index).
      dtype: the params' dtype (float32, bfloat16, float16).
      place: "auto" (one device if the params fit, else sharded), "one" or "shard".
    """
    if place not in ("auto", "one", "shard"):
        raise ValueError(f"place = {place!r}: expected 'auto', 'one' or 'shard'")
    config = read_config(folder)
    stored = Stored(weight_files(folder))
    m = check_tensors(stored, config)
    stored_shapes = {k.split("#")[0]: v[1] for k, v in m.items()}  # the fused qkv once
    n_bytes = sum(np.prod(shape) for shape in stored_shapes.values()) * np.dtype(dtype).itemsize
    devices = jax.devices()
    shard = len(devices) > 1 and (place == "shard" or (place == "auto" and not _fits_one(n_bytes)))
    params: dict = {}
    for key, (path, _, transform) in m.items():
        x = np.ascontiguousarray(transform(np.asarray(stored.array(key.split("#")[0]), dtype)))
        where = _sharding(x.shape, devices) if shard else devices[0]
        node = params
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jax.device_put(x, where)
    return config, params
