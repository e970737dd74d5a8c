"""What the loaded families' architecture configs share: lookups in a `config.json`'s
nested dicts as transformers writes them (a field under either of its names, the
rotary settings under `rope_parameters` or `rope_scaling`, the tying and the dtype
either level may hold), and the checks each frozen config runs on construction.

Shared because every family's `from_hf` reads the same transformers conventions (4.x
Hub files and 5.x saves differ alike in every model type), and every config refuses
the same impossible sizes in the same words (`jaxmech.config`'s errors, naming the
field and the allowed range).
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxmech.config import fail, float_in, int_in


def get(d: Mapping[str, Any], *names, default=None):
    """The first of `names` that `d` holds and is not None, else `default`."""
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def rope_params(text: Mapping[str, Any], names=("rope_parameters", "rope_scaling")) -> dict:
    """The LM's rotary settings: transformers 5's `rope_parameters` or 4.x's
    `rope_scaling` (the first of `names` present), {} where neither."""
    return get(text, *names, default={}) or {}


def rope_theta(rope: Mapping[str, Any], text: Mapping[str, Any], default: float) -> float:
    """The rotary base: the rotary settings' `rope_theta` (5.x), else the text config's
    (4.x), else the model class's `default`."""
    return float(get(rope, "rope_theta", default=get(text, "rope_theta", default=default)))


def tied(raw: Mapping[str, Any], text: Mapping[str, Any]) -> bool:
    """Whether the embeddings are tied: if either level says so, as the reference reads
    files that kept it in `text_config`."""
    return bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings"))


def stored_dtype(raw: Mapping[str, Any], text: Mapping[str, Any]) -> str:
    """The checkpoint's stored dtype (informational): `dtype` (5.x) or `torch_dtype`
    (4.x), at the top level or in `text_config`; "float32" where neither says."""
    return str(get(raw, "dtype", "torch_dtype",
                   default=get(text, "dtype", "torch_dtype", default="float32")))  # fmt: skip


def check_positive(c, ints=(), floats=()) -> None:
    """The fields `ints` of config `c` ints >= 1 and `floats` floats > 0 (a ConfigError
    naming the first that is not)."""
    for name in ints:
        int_in(name, getattr(c, name), 1)
    for name in floats:
        float_in(name, getattr(c, name), 0.0, lo_open=True)


def check_heads(c, vit: bool = True, head_dim: bool = True) -> None:
    """Attention sizes of config `c`: `vit_width` a multiple of `vit_heads` (`vit`), the
    LM's `lm_kv_heads` dividing `lm_heads` (grouped-query), and `lm_head_dim` even
    (rotary pairs; `head_dim`)."""
    if vit and c.vit_width % c.vit_heads:
        fail("vit_width", c.vit_width, f"a multiple of vit_heads = {c.vit_heads}")
    if c.lm_heads % c.lm_kv_heads:
        fail("lm_kv_heads", c.lm_kv_heads, f"a divisor of lm_heads = {c.lm_heads}")
    if head_dim and c.lm_head_dim % 2:
        fail("lm_head_dim", c.lm_head_dim, "an even width (rotary pairs)")
