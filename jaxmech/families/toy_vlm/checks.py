"""Checks at the autoregressive VLM's public boundary (`families.toy_vlm.model`), before tracing.

Structure and shapes are checked always (static under jit / vmap), values only on
concrete arrays (`jaxmech.shapes`). Errors are ValueErrors naming the argument, the
value seen and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxmech.models.attention import BLOCK_KEYS, n_blocks
from jaxmech.models.edits import VIT_TERMS, Edits
from jaxmech.shapes import check_int_array, is_concrete

POINTS = (
    "resid_pre", "q", "k", "v", "attn_scores", "pattern", "z",
    "attn_out", "resid_mid", "mlp_out", "resid_post",
)  # fmt: skip
ROTARY_POINTS = ("rot_q", "rot_k")
STATIC_REQUIRED = ("cell_rows", "cell_cols", "lm_rope_freqs", "lm_mrope", "lm_mrope_axis")


def _keys(where: str, tree, keys) -> None:
    if not isinstance(tree, Mapping):
        raise ValueError(f"{where} is a {type(tree).__name__}: expected a dict of arrays")
    missing = [k for k in keys if k not in tree]
    if missing:
        raise ValueError(
            f"{where} is missing {', '.join(map(repr, missing))}: build params with "
            "families.toy_vlm.model.init_params"
        )


def _blocks(where: str, part) -> list[str]:
    names = sorted((k for k in part if k.startswith("block_")), key=lambda k: int(k[6:]))
    if not names:
        raise ValueError(f"{where} has no block_0")
    for name in names:
        block = part[name]
        _keys(f"{where}[{name!r}]", block, BLOCK_KEYS)
        if np.ndim(block["W_Q"]) != 3:
            raise ValueError(
                f"{where}[{name!r}]['W_Q'] has shape {np.shape(block['W_Q'])}: expected "
                "[H, D, Dh] (params stacked over K models: vmap over them)"
            )
    return names


def check_params(params) -> None:
    """Checks that `params` has every key the forward reads (one model's params)."""
    _keys("params", params, ("vit", "proj", "lm", "static"))
    vit, lm, static = params["vit"], params["lm"], params["static"]
    _keys("params['vit']", vit, ("label_E", "colour_E", "facing_E"))
    if np.ndim(vit["label_E"]) != 2:
        raise ValueError(
            f"params['vit']['label_E'] has shape {np.shape(vit['label_E'])}: expected "
            "[n_labels + 1, D] (params look stacked over K models: vmap over them)"
        )
    _keys("params['static']", static, STATIC_REQUIRED)
    if "row_P" in vit or "col_P" in vit:
        _keys("params['vit'] (learned2d)", vit, ("row_P", "col_P"))
    elif "sincos_freqs" not in static:
        _keys("params['static'] (a ViT without row_P: rope2d)", static, ("vit_rope_freqs",))
    _blocks("params['vit']", vit)
    _blocks("params['lm']", lm)
    proj_keys = ("W", "b") if "W" in params["proj"] else ("W1", "b1", "W2", "b2")
    _keys("params['proj']", params["proj"], proj_keys)
    _keys("params['lm']", lm, ("E", "W_U"))
    if np.ndim(static["cell_rows"]) != 1:
        raise ValueError(
            f"params['static']['cell_rows'] has shape {np.shape(static['cell_rows'])}: "
            "expected [L] (one model's params)"
        )


def n_cells(params) -> int:
    return int(np.shape(params["static"]["cell_rows"])[0])


def check_cells(params, labels_BxL, colours_BxL, facings_BxL) -> int:
    """The three cell arrays: int [B, L] (L = the params' grid), in their tables' range.
    Returns B."""
    L = n_cells(params)
    tables = (
        ("labels_BxL", labels_BxL, "label_E", "labels (0 background)"),
        ("colours_BxL", colours_BxL, "colour_E", "colours (0 background)"),
        ("facings_BxL", facings_BxL, "facing_E", "facings (0 background, 1 left, 2 right)"),
    )
    B = None
    for name, x, table, what in tables:
        hi = params["vit"][table].shape[0] - 1
        check_int_array(name, x, 2, 0, hi, "[B, L] int", f" ({what})")
        if np.shape(x)[1] != L:
            raise ValueError(
                f"{name} has shape {np.shape(x)}: these params' grid has L = {L} cells"
            )
        if B is not None and np.shape(x)[0] != B:
            raise ValueError(f"{name} has {np.shape(x)[0]} rows: labels_BxL has {B}")
        B = np.shape(x)[0]
    return B


def check_inputs(params, labels_BxL, colours_BxL, facings_BxL, question_BxQ) -> None:
    """The four input arrays: int [B, L] cells (`check_cells`) and [B, Q] tokens."""
    B = check_cells(params, labels_BxL, colours_BxL, facings_BxL)
    V = params["lm"]["E"].shape[0]
    check_int_array("question_BxQ", question_BxQ, 2, 0, V - 1, "[B, Q] int", " (LM token ids)")
    if np.shape(question_BxQ)[0] != B:
        raise ValueError(f"question_BxQ has {np.shape(question_BxQ)[0]} rows: labels_BxL has {B}")
    if np.shape(question_BxQ)[1] < 1:
        raise ValueError("question_BxQ has no tokens: expected Q >= 1")


def edit_names(params) -> tuple[str, ...]:
    """Every intermediate the forward names (and `Edits.replace` / `add` accept)."""
    rotary_vit = "vit_rope_freqs" in params["static"]
    names = ["vit/content", "vit/row_part", "vit/col_part", "proj/out", "lm/final"]
    for part, rotary in (("vit", rotary_vit), ("lm", True)):
        points = POINTS + (ROTARY_POINTS if rotary else ())
        for block in _blocks(f"params[{part!r}]", params[part]):
            has_mlp = "W_in" in params[part][block]
            names += [f"{part}/{p}.{block[6:]}" for p in points if has_mlp or p != "mlp_out"]
    return tuple(names)


def _shape(name: str, x, shapes, what: str) -> None:
    if x is not None and tuple(np.shape(x)) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(
            f"edits.{name} has shape {tuple(np.shape(x))}: expected {want} ({what}; one "
            "model's edits: vmap over a stack of them)"
        )


def _check_learned_range(params, name: str, value) -> None:
    """Learned position tables (learned2d) are read by interpolation: a position may lie
    at most half a cell outside the table (read as the edge row; half-cell shifts and
    offset mirrors stay defined). Sin-cos and rotary codes take any position."""
    table = {"vit_rows": "row_P", "vit_cols": "col_P"}[name]
    if value is None or table not in params["vit"] or not is_concrete(value):
        return
    n = params["vit"][table].shape[0]
    lo, hi = float(np.min(value)), float(np.max(value))
    if not (-0.5 <= lo and hi <= n - 0.5):
        raise ValueError(
            f"edits.{name}: positions in [{lo}, {hi}], expected [-0.5, {n - 0.5}] (a learned "
            f"table of {n} rows is read at most half a cell beyond its edges)"
        )


def check_edits(params, edits, n_question: int) -> None:
    """Checks an `Edits` against the params: the fields this family reads, names,
    shapes, and a permutation order."""
    if not isinstance(edits, Edits):
        raise ValueError(
            f"edits is a {type(edits).__name__}: expected models.edits.Edits (or None)"
        )
    for field, allowed in (("term_keep", ("vit",)), ("vp_keep", ()), ("rope_keep", ())):
        unknown = [k for k in getattr(edits, field) if k not in allowed]
        if unknown:
            raise ValueError(
                f"edits.{field} has keys {unknown}: the toy VLM takes "
                + (f"only {list(allowed)}" if allowed else "none (a dual-encoder edit)")
            )
    term_keep = edits.term_keep.get("vit")
    known = set(edit_names(params))
    for field in ("replace", "add"):
        bad = [n for n in getattr(edits, field) if n not in known]
        if bad:
            raise ValueError(
                f"edits.{field} names {bad}: not intermediates of these params (see "
                "families.toy_vlm.checks.edit_names)"
            )
    L, H = n_cells(params), params["vit"]["block_0"]["W_Q"].shape[0]
    S = L + n_question
    _shape("term_keep['vit']", term_keep, [(H, len(VIT_TERMS))], "heads x VIT_TERMS")
    if term_keep is not None and "vit_rope_freqs" in params["static"]:
        raise ValueError(
            "edits.term_keep['vit']: this ViT uses rope2d (no additive position), so the "
            "content / row / column term split does not apply"
        )
    rotary_vit = "vit_rope_freqs" in params["static"]
    Y = n_blocks(params["vit"])
    per_block = [(Y, L)] if rotary_vit else []
    for name in ("vit_rows", "vit_cols"):
        value = getattr(edits, name)
        _shape(name, value, [(L,)] + per_block, "a position per cell (rope2d: or per block)")
        if value is not None and np.ndim(value) == 2 and not rotary_vit:
            raise ValueError(f"edits.{name}: per-block positions [{Y}, {L}] need a rope2d ViT")
        _check_learned_range(params, name, value)
    _shape("lm_pos_ids", edits.lm_pos_ids, [(S,), (3, S)], "per LM token, S = L + Q")
    order = edits.image_order
    _shape("image_order", order, [(L,)], "a permutation of the image tokens")
    if order is not None:
        check_int_array("edits.image_order", order, 1, 0, L - 1, "[L] int")
        if is_concrete(order) and sorted(np.asarray(order).tolist()) != list(range(L)):
            raise ValueError(
                f"edits.image_order = {np.asarray(order).tolist()}: expected a permutation "
                f"of 0..{L - 1}"
            )
