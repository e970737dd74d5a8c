"""A Hugging Face checkpoint folder's files, for every checkpoint family: `config.json`,
the safetensors weights read one tensor at a time, checked against the family's key
map, laid out and placed on the devices.

A family supplies its key map `{canonical name: (our "part/.../name", stored shape,
transform)}` (a fused tensor appears once per part as `name#0/1/...`) and `canonical`,
the function that maps a stored name in any of its layouts to the canonical one.

* Tensors stored as float32, float16 or bfloat16 (bfloat16 through `ml_dtypes`), cast
  to the asked `dtype`.
* The files are read one tensor at a time (the safetensors format: an 8-byte
  little-endian header length, a JSON header of `{name: {dtype, shape, data_offsets}}`,
  the raw bytes), and each is cast, laid out and put on the devices before the next
  is read, so the weights are held once, in `dtype` (`Stored`); a stacked leaf (the
  LM's blocks, `models.layout.BLOCKS`: key-map paths `stacked_path`) is filled layer
  by layer on the host and placed when full, or, low-precision on a CPU, placed layer
  by layer as its `models.layout.Rows` (`models.scan.held_apart`).
* Placement: on one device when the params fit in its memory, else each matrix split
  over every device along an axis they divide (`place="auto"`; "one" or "shard" force
  either).
* Errors before anything is placed: a folder without `config.json` or weights names
  the path; a missing, unexpected or wrongly shaped tensor names the tensor and both
  shapes.

`load_checkpoint` is every family's loader (config, tensors checked, placed), given the
family's pieces: its `from_hf`, `canonical` (`prefix_renamer` where its layouts differ by
name prefixes, as every family's do) and key map (`lm_key_map` for its LM, the Llama
layout all three share).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from jaxmech.config import ConfigError
from jaxmech.models import layout, precision
from jaxmech.models.scan import held_apart

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
PLACES = ("auto", "one", "shard")


class LoadError(ValueError):
    """A folder that is not a loadable checkpoint (the message names what)."""


def read_json_config(folder: str, parse: Callable, errors=(KeyError,)):
    """`parse(config.json's dict)`; a LoadError naming the folder or the file (with the
    parse's message for `errors`)."""
    if not os.path.isdir(folder):
        raise LoadError(f"checkpoint = {folder!r}: not a folder")
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise LoadError(f"checkpoint = {folder!r}: no config.json (not a checkpoint folder)")
    with open(path) as f:
        try:
            return parse(json.load(f))
        except errors as e:
            raise LoadError(f"{path}: {e}") from None


def read_config(folder: str, from_hf: Callable):
    """A family's architecture config, `from_hf(config.json's dict)`; a LoadError naming
    the folder, or the file and what it lacks or what is refused (a KeyError or
    ConfigError of `from_hf`)."""
    return read_json_config(folder, from_hf, (KeyError, ConfigError))


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


def stored_elements(folder: str) -> int:
    """How many numbers the checkpoint's safetensors files hold, from their headers only
    (no tensor is read): what a memory check needs before loading."""
    stored = Stored(weight_files(folder))
    return int(sum(np.prod(stored.shape(k), dtype=np.int64) for k in stored.entries))


class Stored:
    """The tensors of a checkpoint's files, read one at a time: canonical name -> (file,
    entry, start, stored name). Not memory-mapped: a mapped file's pages count in the
    process's resident memory until the map closes, so mapping 4.4 GB of weights while
    placing them held them twice (8.7 GB at the peak for Qwen2-VL-2B in bfloat16)."""

    def __init__(self, files: list[str], canonical: Callable[[str], str] = lambda n: n):
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


def check_tensors(stored: Stored, m: dict, ignore=()) -> None:
    """Every tensor of key map `m` stored with its shape, and nothing else (but the
    canonical names `ignore`, e.g. a tied checkpoint's stored copy of the unembedding);
    a LoadError naming the first that is not."""
    want = {k.split("#")[0]: v[1] for k, v in m.items()}
    have = {k: v for k, v in stored.entries.items() if k not in ignore}
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


def _fits_one(n_bytes: int) -> bool:
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit is None or n_bytes < 0.8 * limit


def _sharding(shape, devices, stacked: bool = False):
    """Split the largest axis the device count divides; replicate what none divides. A
    stacked leaf's (`stacked`) leading block axis is never split: a scan over the
    blocks slices one block at a time, which must stay whole on every device."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(devices), ("d",))
    lead = int(stacked)
    axes = [a for a in np.argsort(shape)[::-1] if a >= lead and shape[a] % len(devices) == 0]
    spec = [None] * len(shape)
    if axes and len(shape) - lead >= 2:
        spec[axes[0]] = "d"
    return NamedSharding(mesh, PartitionSpec(*spec))


def check_place(place: str) -> None:
    if place not in PLACES:
        raise ValueError(f"place = {place!r}: expected 'auto', 'one' or 'shard'")


def stacked_path(path: str, i: int) -> str:
    """A key map's path for index i of a stacked leaf `path` (e.g. "lm/blocks/W_Q[3]":
    layer 3's tensor written into row 3 of `lm/blocks/W_Q` [L, ...])."""
    return f"{path}[{i}]"


def _split_path(path: str) -> tuple[str, int | None]:
    """(the leaf's path, its block index or None) of a key map path (`stacked_path`)."""
    if path.endswith("]") and "[" in path:
        base, _, i = path[:-1].rpartition("[")
        return base, int(i)
    return path, None


def _put(params: dict, path: str, x, where) -> None:
    node = params
    *parents, leaf = path.split("/")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = x if where is None else jax.device_put(x, where)


def place_params(stored: Stored, m: dict, dtype=np.float32, place: str = "auto") -> dict:
    """The params of key map `m` (already checked: `check_tensors`) from `stored`, each
    tensor cast to `dtype`, transformed into our layout and placed before the next is
    read: on one device, or sharded over every device when they do not fit one
    (`place`: "auto", "one", "shard"). A stacked leaf (paths `stacked_path(p, i)`) is
    filled one layer at a time into one host array, placed when full, before the next
    leaf is read: at most one leaf's layers are held twice. Low-precision on a CPU
    (`models.scan.held_apart`) its layers are placed one by one as `layout.Rows`."""
    check_place(place)
    stored_shapes = {k.split("#")[0]: v[1] for k, v in m.items()}  # a fused tensor once
    n_bytes = sum(np.prod(shape) for shape in stored_shapes.values()) * np.dtype(dtype).itemsize
    devices = jax.devices()
    shard = len(devices) > 1 and (place == "shard" or (place == "auto" and not _fits_one(n_bytes)))
    groups: dict = {}  # leaf path -> [(index or None, stored key, transform)]
    for key, (path, _, transform) in m.items():
        base, i = _split_path(path)
        groups.setdefault(base, []).append((i, key, transform))
    params: dict = {}
    for base, entries in groups.items():
        stacked = entries[0][0] is not None
        if stacked and held_apart(dtype):
            _put(params, base, _rows(stored, entries, dtype, devices, shard), None)
            continue
        buf = None
        for i, key, transform in entries:
            x = transform(np.asarray(stored.array(key.split("#")[0]), dtype))
            if not stacked:
                buf = np.ascontiguousarray(x)
                continue
            if buf is None:
                buf = np.empty((len(entries),) + x.shape, x.dtype)
            buf[i] = x
        where = _sharding(buf.shape, devices, stacked) if shard else devices[0]
        _put(params, base, buf, where)
        del buf
    return params


def _rows(stored: Stored, entries: list, dtype, devices, shard: bool) -> layout.Rows:
    """A stacked leaf's layers (`entries`: (index, stored key, transform)) each placed
    as its own array (`models.scan.held_apart`), never stacked."""
    rows = [None] * len(entries)
    for i, key, transform in entries:
        x = np.ascontiguousarray(transform(np.asarray(stored.array(key.split("#")[0]), dtype)))
        rows[i] = jax.device_put(x, _sharding(x.shape, devices) if shard else devices[0])
    return layout.Rows(rows)


HEAD = "lm_head.weight"  # the unembedding's canonical name, in every family's key map


def load_checkpoint(folder: str, dtype=np.float32, place: str = "auto", *, from_hf: Callable,
                    canonical: Callable, key_map: Callable, unused=(),
                    stored_head_wins: bool = False):  # fmt: skip
    """(config, params) of a checkpoint folder: config.json read (`read_config`), the
    weights' tables read (`Stored`, names through `canonical`), checked against
    `key_map(config)` before any tensor is read (`check_tensors`), then placed
    (`place_params`). Every family's loader, given its pieces.

    Args:
      folder: holds config.json and model.safetensors (or a sharded index).
      dtype: the params' dtype (float32, bfloat16, float16).
      place: "auto" (one device if the params fit, else sharded), "one" or "shard".
      from_hf, canonical, key_map: the family's config reader, stored name -> canonical
        name, and config -> key map (module docstring).
      unused: canonical names stored but never read (not loaded, not refused).
      stored_head_wins: where config.json says the embeddings are tied (the config's
        `tie_embeddings`) but an unembedding `HEAD` is stored: False ignores the stored
        copy (the reference ties); True loads it, the config untied (as transformers
        does where the two differ).
    """
    check_place(place)
    config = read_config(folder, from_hf)
    stored = Stored(weight_files(folder), canonical)
    if stored_head_wins and config.tie_embeddings and HEAD in stored.entries:
        config = dataclasses.replace(config, tie_embeddings=False)
    m = key_map(config)
    check_tensors(stored, m, ignore=tuple(unused) + ((HEAD,) if config.tie_embeddings else ()))
    if np.dtype(dtype).itemsize < 4:  # which products a low-precision model runs, and why
        logging.getLogger(__name__).info(precision.describe(dtype))
    return config, place_params(stored, m, dtype, place)


def prefix_renamer(prefixes) -> Callable[[str], str]:
    """`canonical` for a family whose stored layouts differ by name prefixes (the Hub's,
    the one transformers 5 saves): `prefixes` ((stored prefix, canonical prefix), ...),
    the first that a name starts with replaced; a name none matches is its own."""

    def canonical(name: str) -> str:
        for prefix, to in prefixes:
            if name.startswith(prefix):
                return to + name[len(prefix) :]
        return name

    return canonical


def decoder_block_map(stored: str, ours: str, lay, index: int | None = None) -> dict:
    """The key map of one Llama-layout decoder block (`input_layernorm`,
    `post_attention_layernorm`, `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
    `mlp.{gate,up,down}_proj`) stored under `stored` (e.g. "lm.layers.3.") to our
    `ours` (e.g. "lm/block_3/", or "lm/blocks/" with `index` 3: row 3 of the stacked
    leaves, `stacked_path`), of `lay` (`models.layout.LMLayout`: its sizes and which
    biases / norms it has); shapes as `models.layout.decoder_block_shapes`."""
    m = _decoder_block_map(stored, ours, lay)
    if index is None:
        return m
    return {k: (stacked_path(p, index), shape, f) for k, (p, shape, f) in m.items()}


def _decoder_block_map(stored: str, ours: str, lay) -> dict:
    D, H, K, Dh, M = lay.width, lay.heads, lay.kv_heads, lay.head_dim, lay.mlp
    m = {stored + "input_layernorm.weight": (ours + "ln1_w", (D,), same),
         stored + "post_attention_layernorm.weight": (ours + "ln2_w", (D,), same),
         stored + "self_attn.o_proj.weight": (ours + "W_O", (D, H * Dh),
                                              heads_out(H, Dh))}  # fmt: skip
    for w, n in (("q", H), ("k", K), ("v", K)):
        m[stored + f"self_attn.{w}_proj.weight"] = (ours + f"W_{w.upper()}", (n * Dh, D),
                                                    heads_in(n, Dh))  # fmt: skip
        if lay.qkv_bias:
            m[stored + f"self_attn.{w}_proj.bias"] = (ours + f"b_{w.upper()}", (n * Dh,),
                                                      heads_bias(n, Dh))  # fmt: skip
    if lay.qk_norm:
        for w in "qk":
            m[stored + f"self_attn.{w}_norm.weight"] = (ours + f"{w}_norm_w", (Dh,), same)
    if lay.o_bias:
        m[stored + "self_attn.o_proj.bias"] = (ours + "b_O", (D,), same)
    for hf, name, shape in (("gate_proj", "gate", (M, D)), ("up_proj", "in", (M, D)),
                            ("down_proj", "out", (D, M))):  # fmt: skip
        m[stored + f"mlp.{hf}.weight"] = (ours + f"W_{name}", shape, T)
        if lay.mlp_bias:
            m[stored + f"mlp.{hf}.bias"] = (ours + f"b_{name}", shape[:1], same)
    return m


def lm_key_map(stored: str, lay) -> dict:
    """The key map of a Llama-layout LM whose body is stored under `stored` (e.g. "lm.":
    `embed_tokens`, `layers.{i}.*`, `norm`) to our `lm/` part (layer i into row i of
    the stacked `lm/blocks/*`), with its unembedding
    `HEAD` where `lay` (`models.layout.LMLayout`) is not tied; shapes as
    `models.layout.lm_shapes`."""
    D, V = lay.width, lay.vocab
    m = {stored + "embed_tokens.weight": ("lm/E", (V, D), same),
         stored + "norm.weight": ("lm/lnf_w", (D,), same)}  # fmt: skip
    for i in range(lay.layers):  # the blocks stacked (`models.layout.BLOCKS`)
        m |= decoder_block_map(f"{stored}layers.{i}.", "lm/blocks/", lay, i)
    return m if lay.tied else m | {HEAD: ("lm/W_U", (V, D), T)}


# The layout transforms a key map names: a Linear [out, in] -> TransformerLens's
# per-head [H, D, Dh] / [H, Dh, D], a transpose, or the tensor as it is.


def heads_in(H: int, Dh: int):
    """Linear [H Dh, D] (out, in) -> [H, D, Dh]."""
    return lambda w: w.reshape(H, Dh, -1).transpose(0, 2, 1)


def heads_out(H: int, Dh: int):
    """Linear [D, H Dh] -> W_O [H, Dh, D]."""
    return lambda w: w.T.reshape(H, Dh, -1)


def heads_bias(H: int, Dh: int):
    """A Linear's bias [H Dh] -> per head [H, Dh]."""
    return lambda b: b.reshape(H, Dh)


def T(w):
    return w.T


def same(w):
    return w
