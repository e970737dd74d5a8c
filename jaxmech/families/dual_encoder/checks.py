"""Input checks at the dual encoder's public boundary, and the static-params subtree.

`params["static"]` holds the behaviour switches that have no trained parameter, as f32
scalars (stacked [K] with the params): `causal_text` (1: causal text mask, 0: none),
`logit_scale_max` (the cap of the learned log temperature) and `cls_position` (1: the
vision P has a row for CLS). The forward reads them with a stopped gradient, so a
training step leaves them unchanged; analyses need no keyword to get them right. A
counterfactual model (e.g. a bidirectional text tower) is the same params with an edited
switch: `with_static(params, causal_text=0.0)`, the one way to change them.

Every check runs before tracing: structure and shapes always (they are static under
`jax.jit` / `jax.vmap`), values only on concrete arrays (`jaxmech.shapes`). Errors are
ValueErrors naming the argument, the value and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.models.attention import BLOCK_KEYS, n_blocks
from jaxmech.shapes import check_int_array, check_positions, is_concrete

STATIC_KEYS = ("causal_text", "logit_scale_max", "cls_position")
TOWERS = ("vision", "text")


def read_static(params, key: str):
    """`params["static"][key]` with a stopped gradient; a ValueError names what is missing."""
    if not isinstance(params, Mapping) or "static" not in params:
        raise ValueError(
            f"params have no 'static' subtree (needed for {key!r}): build params with "
            "families.dual_encoder.model.init_params, or add params['static'] = static_params(config)"
        )
    if key not in params["static"]:
        raise ValueError(
            f"params['static'] is missing {key!r}: expected keys {', '.join(STATIC_KEYS)}"
        )
    value = params["static"][key]
    if np.ndim(value) != 0:
        raise ValueError(
            f"params['static'][{key!r}] has shape {np.shape(value)}: params look stacked "
            "over K models: vmap over them (one model's params per call)"
        )
    if key != "logit_scale_max" and is_concrete(value) and float(value) not in (0.0, 1.0):
        raise ValueError(f"params['static'][{key!r}] = {float(value)}: expected 0.0 or 1.0")
    return jax.lax.stop_gradient(value)


def with_static(params, **values):
    """`params` with entries of `params["static"]` replaced, e.g. `causal_text=0.0`.

    Values (bools, floats or traced scalars) become f32 broadcast to the entry's shape,
    so this works on one model's params and on params stacked [K] alike (a [K] value
    sets each model's own). Keys must be `STATIC_KEYS`; the values are checked where the
    forward reads them (`read_static`). Nothing else is copied or changed.
    """
    unknown = [k for k in values if k not in STATIC_KEYS]
    if unknown:
        raise ValueError(f"with_static: unknown keys {unknown}: expected some of {STATIC_KEYS}")
    if not isinstance(params, Mapping) or "static" not in params:
        raise ValueError("with_static: params have no 'static' subtree (see static_params)")
    static = dict(params["static"])
    for key, value in values.items():
        shape = jnp.shape(static[key]) if key in static else ()
        static[key] = jnp.broadcast_to(jnp.asarray(value, jnp.float32), shape)
    return {**params, "static": static}


def _check_keys(where: str, tree, keys) -> None:
    if not isinstance(tree, Mapping):
        raise ValueError(f"{where} is a {type(tree).__name__}: expected a dict of arrays")
    missing = [k for k in keys if k not in tree]
    if missing:
        raise ValueError(f"{where} is missing {', '.join(map(repr, missing))}")


def _check_block(where: str, block) -> None:
    _check_keys(where, block, BLOCK_KEYS)
    if "ln1_w" in block or "ln2_w" in block:
        _check_keys(where, block, ("ln1_w", "ln1_b", "ln2_w", "ln2_b"))
    if "W_in" in block:
        _check_keys(where, block, ("W_in", "b_in", "W_out", "b_out"))
    ndim = np.ndim(block["W_Q"])
    if ndim != 3:
        stacked = ": params look stacked over K models: vmap over them" if ndim == 4 else ""
        raise ValueError(
            f"{where}['W_Q'] has shape {np.shape(block['W_Q'])}: expected [H, D, Dh]{stacked}"
        )


def check_tower(params, tower: str) -> None:
    """Checks that `params[tower]` has every key the forward reads (one model's params)."""
    if tower not in TOWERS:
        raise ValueError(f"tower = {tower!r}: expected 'vision' or 'text'")
    if not isinstance(params, Mapping):
        raise ValueError(f"params is a {type(params).__name__}: expected the params dict")
    if "logit_scale" in params and np.ndim(params["logit_scale"]) != 0:
        raise ValueError(
            f"params['logit_scale'] has shape {np.shape(params['logit_scale'])}: params look "
            "stacked over K models: vmap over them (one model's params per call)"
        )
    _check_keys("params", params, (tower,))
    t = params[tower]
    _check_keys(f"params[{tower!r}]", t, ("E", "W_proj", "block_0"))
    if "rope_freqs" not in t:
        _check_keys(f"params[{tower!r}] (a tower without rope_freqs)", t, ("P",))
    if "lnf_w" in t or "lnf_b" in t:
        _check_keys(f"params[{tower!r}]", t, ("lnf_w", "lnf_b"))
    for name in sorted(k for k in t if k.startswith("block_")):
        _check_block(f"params[{tower!r}][{name!r}]", t[name])


def check_images(params, images_BxL, positions=None, positions_name="positions") -> None:
    """Images [B, L] of pixel ids in [0, V - 2] (V - 1 is CLS) and their positions.

    On a learned-P tower the image length must match P (L rows, or L + 1 with a CLS
    position row: `params["static"]["cls_position"]`), and positions lie in [0, L - 1].
    """
    check_tower(params, "vision")
    tower = params["vision"]
    V = tower["E"].shape[0]
    note = f" (pixel ids; {V - 1} is CLS, which the encoder prepends itself)"
    check_int_array("images_BxL", images_BxL, 2, 0, V - 2, "[B, L] int pixel ids", note)
    B, L = np.shape(images_BxL)
    if "rope_freqs" in tower:
        if positions is not None:
            check_positions(positions_name, positions, L, B)
        return
    rows = tower["P"].shape[0]
    cls = read_static(params, "cls_position")
    if is_concrete(cls):
        want = L + int(cls)
        if rows != want:
            kind = "with a CLS position row" if int(cls) else "without a CLS position row"
            raise ValueError(
                f"images_BxL has length {L}, but this model's vision P has {rows} rows "
                f"{kind}: expected images of length {rows - int(cls)}"
            )
    elif rows not in (L, L + 1):
        raise ValueError(f"images_BxL has length {L}; the vision P has {rows} rows")
    if positions is not None:
        check_positions(positions_name, positions, L, B, 0, L - 1)


def check_captions(params, captions_CxT, positions=None, positions_name="positions") -> None:
    """Captions [C, T] of token ids in [0, V - 1], each with an EOT (id V - 1), T <= P rows."""
    check_tower(params, "text")
    V = params["text"]["E"].shape[0]
    rows = params["text"]["P"].shape[0]
    expected = "[C, T] int token ids"
    check_int_array("captions_CxT", captions_CxT, 2, 0, V - 1, expected, " (text token ids)")
    C, T = np.shape(captions_CxT)
    if T > rows:
        raise ValueError(
            f"captions_CxT has length {T}, but the text P has {rows} position rows: "
            f"expected T <= {rows}"
        )
    if is_concrete(captions_CxT):
        no_eot = np.flatnonzero(~(np.asarray(captions_CxT) == V - 1).any(axis=1))
        if no_eot.size:
            raise ValueError(
                f"captions_CxT rows {no_eot[:5].tolist()} have no EOT token (id {V - 1}): "
                "expected one per caption (the text embedding is read at the first EOT)"
            )
    if positions is not None:
        check_positions(positions_name, positions, T, C, 0, rows - 1)


POINTS = (
    "resid_pre", "q", "k", "v", "rot_q", "rot_k", "attn_scores", "pattern", "z",
    "attn_out", "resid_mid", "mlp_out", "resid_post",
)  # fmt: skip
TOWER_POINTS = ("e_part", "p_part", "readout", "embed")


def check_edit_name(name: str, params) -> None:
    """Raises unless `name` is `"{tower}/{point}.{layer}"` or `"{tower}/{readout|embed}"`
    of a tower and block these params have (a misspelt name would edit nothing)."""
    tower, _, rest = name.partition("/")
    point, _, layer = rest.partition(".")
    ok = tower in TOWERS and isinstance(params, Mapping) and tower in params
    if ok and layer:
        ok = point in POINTS and layer.isdigit() and f"block_{layer}" in params[tower]
    elif ok:
        ok = point in TOWER_POINTS[2:]
    if not ok:
        raise ValueError(
            f"edit name {name!r}: expected '<tower>/<point>.<layer>' with tower in "
            f"{TOWERS}, point in {POINTS} and a block of that tower, or "
            "'<tower>/readout' / '<tower>/embed'"
        )


def check_edits(params, edits, tower: str) -> None:
    """Checks the edits that `tower`'s encoder reads: keys, shapes and names.

    term_keep [H, 9], vp_keep [H], rope_keep [H] or [Y, H] per tower (one model's
    edits: vmap or lax.map over stacked ones); replace / add names must exist.
    """
    for field in ("vit_rows", "vit_cols", "lm_pos_ids", "image_order"):
        if getattr(edits, field) is not None:
            raise ValueError(
                f"edits.{field}: the dual encoder has no such position override (its "
                "towers' positions are the forward's vision_positions / text_positions)"
            )
    H = params[tower]["block_0"]["W_Q"].shape[0]
    n_layers = n_blocks(params[tower])
    fields = {"term_keep": ((H, 9),), "vp_keep": ((H,),), "rope_keep": ((H,), (n_layers, H))}
    for field, shapes in fields.items():
        table = getattr(edits, field)
        unknown = [k for k in table if k not in TOWERS]
        if unknown:
            raise ValueError(f"edits.{field} has keys {unknown}: expected towers in {TOWERS}")
        if tower in table and np.shape(table[tower]) not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise ValueError(
                f"edits.{field}[{tower!r}] has shape {np.shape(table[tower])}: expected {want} "
                "(one model's edits; lax.map or vmap over a stack of them)"
            )
    for name in (*edits.replace, *edits.add):
        if name.startswith(f"{tower}/"):
            check_edit_name(name, params)
        elif name.partition("/")[0] not in TOWERS:
            check_edit_name(name, params)
