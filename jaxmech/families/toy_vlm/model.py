"""The toy autoregressive VLM: ViT over grid cells -> projector -> causal LM.

Params (a plain nested dict; `init_params` builds it; blocks as `models.attention`):

  vit/    label_E [n_labels+1, D]  colour_E [n_colours+1, D]  facing_E [3, D]
          (learned2d: row_P [grid_h, D], col_P [grid_w, D])  block_0 .. block_{n-1}
  proj/   W [D, D], b [D] (linear)  or  W1, W2 [D, D], b1, b2 [D] (2-layer GELU MLP)
  lm/     E [V, D]  block_0 .. block_{lm_n_layers-1}  (lnf_w, lnf_b [D])  W_U [D, V]
  static/ constants, read with a stopped gradient (never trained):
          cell_rows, cell_cols [L]   each cell's row / column (L and the grid)
          lm_rope_freqs [R]          the LM's rotary frequencies rope_base^(-2i/Dh)
          lm_mrope []                1: three-part (t, row, col) ids; 0: sequential
          lm_mrope_axis [R]          which id (0 t, 1 row, 2 col) turns pair i
          tie_labels []              1: a label word is proj(vit/label_E[l]), not lm/E
          sincos_freqs [D/4], sincos_scale []   (sincos2d only)
          vit_rope_freqs, vit_rope_axis [R]     (rope2d only)
          vit_window [], vit_global [n_layers]  (window blocks only)
          cell_frames [L]            each cell's video frame (vit_frames only; the
                                     cells' rows are then 0: a frame is one row)
          id_target [L, D]           the spatial-ID loss's target (id_site > 0 only:
                                     `families.toy_vlm.id_loss`)
          lm_route []                1, present with planted_route only (its presence is
                                     the switch): question tokens other than the label
                                     words do not attend to the image tokens (`route_visible`)

V = 11 + n_labels (the scene words, then the labels: `data.tasks.scenes`). The ViT is
`families.toy_vlm.vit` (cells, positions, windows). The LM reads `[L image tokens][Q question
tokens]` causally with RoPE on q and k. Its position ids are three per token (t, row,
col), each frequency pair turned by one of them (`lm_mrope_axis`, interleaved t, row,
col, ... so every part gets high and low frequencies; Qwen2-VL uses contiguous
sections, which leaves the last part only the lowest frequencies). Sequential (LLaVA):
all three ids of token s are s. Three-part (Qwen2-VL): image cell (r, c) has (0, r, c),
or (f, 0, c) in a video (`vit_frames`: grid row f is frame f, and the ViT sees each
frame alone with no row code, so time reaches the LM only through its position ids);
question token j has `m + 1 + j` thrice, m the largest image id. With equal ids every
pair turns by the same id, which is 1D RoPE.

`forward` returns the logits [B, V] at the last position; the answer is the argmax
over the answer words (`data.tasks.scenes.SCENE_WORDS`). Architecture is read off the params,
so analyses call `forward(params, ...)` with no config; vmap over stacked params.

Axis names (`jaxmech.shapes`): B images, L cells, Q question tokens, S = L + Q the LM
sequence, D d_model, H heads, Dh d_head, R rotary pairs, V vocabulary.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from jaxmech.config import Config
from jaxmech.data.tasks.scenes import SCENE_WORDS
from jaxmech.families.toy_vlm import vit as vit2d
from jaxmech.families.toy_vlm.checks import check_edits, check_inputs, check_params
from jaxmech.families.toy_vlm.vit import read
from jaxmech.models.attention import Rotary, block_forward, layer_norm, n_blocks, rows_matmul
from jaxmech.models.edits import NO_EDITS, Edits

N_SCENE_WORDS = len(SCENE_WORDS)  # the question and answer words; labels follow at 10 + l


def vocab_size(config: Config) -> int:
    """The LM vocabulary: the 11 scene words and the labels."""
    return N_SCENE_WORDS + config.task.n_labels


# ---------------------------------------------------------------------------
# Parameters


def _normal(key, name: str, shape, std: float):
    """N(0, std^2) of `shape`, drawn from a stream named by `name` (stable across edits
    of the layout: adding a parameter shifts no other one's draw)."""
    return std * jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode())), shape)


def init_block(key, name: str, config: Config) -> dict:
    """One block's params (SPEC's initialisation, as the dual encoder's blocks)."""
    m = config.model
    H, D, Dh, M = m.n_heads, m.d_model, m.d_head, m.d_mlp
    p = {}
    for w in "QKV":
        p[f"W_{w}"] = _normal(key, f"{name}/W_{w}", (H, D, Dh), D**-0.5)
        p[f"b_{w}"] = jnp.zeros((H, Dh))
    p["W_O"] = _normal(key, f"{name}/W_O", (H, Dh, D), (H * Dh) ** -0.5)
    p["b_O"] = jnp.zeros((D,))
    if m.layernorm:
        for i in "12":
            p[f"ln{i}_w"], p[f"ln{i}_b"] = jnp.ones((D,)), jnp.zeros((D,))
    if m.mlp:
        p["W_in"] = _normal(key, f"{name}/W_in", (D, M), D**-0.5)
        p["b_in"] = jnp.zeros((M,))
        p["W_out"] = _normal(key, f"{name}/W_out", (M, D), M**-0.5)
        p["b_out"] = jnp.zeros((D,))
    return p


def _check_config(config: Config) -> None:
    m = config.model
    if m.vit_pos == "sincos2d" and m.d_model % 4:
        raise ValueError(
            f"d_model = {m.d_model}: expected a multiple of 4 with vit_pos = 'sincos2d'"
        )
    if m.vit_pos == "rope2d" and m.d_head % 4:
        raise ValueError(f"d_head = {m.d_head}: expected a multiple of 4 with vit_pos = 'rope2d'")
    if m.d_head % 2:
        raise ValueError(f"d_head = {m.d_head}: expected an even number (the LM uses RoPE)")


def static_params(config: Config) -> dict:
    """`params["static"]` for `config` (module docstring), all f32 (the planted
    `id_target` is drawn by `init_params`)."""
    m, t = config.model, config.task
    rows, cols = vit2d.cell_grid(t.grid_h, t.grid_w)
    R = m.d_head // 2
    s = {}
    if m.vit_frames:
        s["cell_frames"], rows = rows, jnp.zeros_like(rows)
    s |= {
        "cell_rows": rows,
        "cell_cols": cols,
        "lm_rope_freqs": m.rope_base ** (-2.0 * jnp.arange(R, dtype=jnp.float32) / m.d_head),
        "lm_mrope": jnp.float32(m.lm_pos_ids == "mrope"),
        "lm_mrope_axis": (jnp.arange(R) % 3).astype(jnp.float32),
        "tie_labels": jnp.float32(m.tie_labels),
    }
    if m.vit_pos == "sincos2d":
        s["sincos_freqs"] = vit2d.sincos_freqs(m.d_model)
        s["sincos_scale"] = jnp.float32(vit2d.sincos_scale(m.init_P))
    if m.vit_pos == "rope2d":
        s["vit_rope_freqs"], s["vit_rope_axis"] = vit2d.rope2d_tables(m.d_head, m.rope_base)
    if m.planted_route:
        s["lm_route"] = jnp.float32(1.0)
    if m.vit_window > 0:
        s["vit_window"] = jnp.float32(m.vit_window)
        glob = [float(i in m.global_blocks) for i in range(m.n_layers)]
        s["vit_global"] = jnp.asarray(glob, jnp.float32)
    return s


def planted_id_target(key, rows_L, cols_L, d_model: int):
    """[L, D] a linear grid ID, (column - mean) u + (row - mean) v with u, v orthonormal
    random directions of the residual stream: the from-scratch target of
    `families.toy_vlm.id_loss`."""
    g = jax.random.normal(key, (d_model, 2))
    q, _ = jnp.linalg.qr(g)
    rows, cols = rows_L - rows_L.mean(), cols_L - cols_L.mean()
    return cols[:, None] * q[:, 0] + rows[:, None] * q[:, 1]


def init_params(config: Config, key: jax.Array) -> dict:
    """A fresh params dict for `config` (module docstring; SPEC's initialisation:
    embeddings N(0, init_E^2), position tables N(0, init_P^2), W_Q/W_K/W_V/W_U N(0, 1/D),
    W_O N(0, 1/(H Dh)), projector N(0, 1/D), biases 0, LayerNorm weights 1)."""
    _check_config(config)
    m, t = config.model, config.task
    D, E, P = m.d_model, m.init_E, m.init_P
    vit = {
        "label_E": _normal(key, "vit/label_E", (t.n_labels + 1, D), E),
        "colour_E": _normal(key, "vit/colour_E", (t.n_colours + 1, D), E),
        "facing_E": _normal(key, "vit/facing_E", (3, D), E),
    }
    if m.vit_pos == "learned2d":
        vit["row_P"] = _normal(key, "vit/row_P", (1 if m.vit_frames else t.grid_h, D), P)
        vit["col_P"] = _normal(key, "vit/col_P", (t.grid_w, D), P)
    for i in range(m.n_layers):
        vit[f"block_{i}"] = init_block(key, f"vit/block_{i}", config)
    if m.projector == "linear":
        proj = {"W": _normal(key, "proj/W", (D, D), D**-0.5), "b": jnp.zeros((D,))}
    else:
        proj = {"W1": _normal(key, "proj/W1", (D, D), D**-0.5), "b1": jnp.zeros((D,))}
        proj |= {"W2": _normal(key, "proj/W2", (D, D), D**-0.5), "b2": jnp.zeros((D,))}
    V = vocab_size(config)
    lm = {"E": _normal(key, "lm/E", (V, D), E)}
    for i in range(m.lm_n_layers):
        lm[f"block_{i}"] = init_block(key, f"lm/block_{i}", config)
    if m.layernorm:
        lm["lnf_w"], lm["lnf_b"] = jnp.ones((D,)), jnp.zeros((D,))
    lm["W_U"] = _normal(key, "lm/W_U", (D, V), D**-0.5)
    static = static_params(config)
    if m.id_site > 0:
        rows, cols = vit2d.cell_grid(t.grid_h, t.grid_w)
        k = jax.random.fold_in(key, zlib.crc32(b"static/id_target"))
        static["id_target"] = planted_id_target(k, rows, cols, D)
    return {"vit": vit, "proj": proj, "lm": lm, "static": static}


# ---------------------------------------------------------------------------
# Forward


def project(proj, x_BxLxD):
    """The projector: x W + b, or GELU(x W1 + b1) W2 + b2 (GELU's tanh approximation,
    as the blocks' MLPs: `models.attention.mlp`)."""
    if "W" in proj:
        return rows_matmul(x_BxLxD, proj["W"]) + proj["b"]
    hidden = jax.nn.gelu(rows_matmul(x_BxLxD, proj["W1"]) + proj["b1"], approximate=True)
    return rows_matmul(hidden, proj["W2"]) + proj["b2"]


def lm_position_ids(params, n_question: int):
    """The LM's default position ids, f32 [3, S] (t, row, col per token; module docstring)."""
    rows, cols = read(params, "cell_rows"), read(params, "cell_cols")
    frames = read(params, "cell_frames") if "cell_frames" in params["static"] else 0.0 * rows
    L = rows.shape[0]
    seq = jnp.broadcast_to(jnp.arange(L + n_question, dtype=jnp.float32), (3, L + n_question))
    top = jnp.maximum(jnp.maximum(rows.max(), cols.max()), frames.max())
    text = top + 1.0 + jnp.arange(n_question, dtype=jnp.float32)
    image = jnp.stack([frames, rows, cols])
    mrope = jnp.concatenate([image, jnp.broadcast_to(text, (3, n_question))], axis=1)
    return jnp.where(read(params, "lm_mrope") > 0, mrope, seq)


def lm_angles(params, n_question: int, edits):
    """Rotary angles [S, R] of the LM tokens (the `lm_pos_ids` override, or the default)."""
    ids = edits.lm_pos_ids
    if ids is None:
        ids = lm_position_ids(params, n_question)
    ids = jnp.asarray(ids, jnp.float32)
    if ids.ndim == 1:
        ids = jnp.broadcast_to(ids, (3, ids.shape[0]))
    return vit2d.rotary_angles(ids, read(params, "lm_rope_freqs"), read(params, "lm_mrope_axis"))


def image_tokens(params, vit_out_BxLxD, edits, aux):
    """The projected image tokens `proj/out` and their LM order (`image_order`)."""
    out = edits("proj/out", project(params["proj"], vit_out_BxLxD))
    aux["proj/out"] = out
    if edits.image_order is not None:
        out = jnp.take(out, jnp.asarray(edits.image_order), axis=1)
    return out


def question_embedding(params, question_BxQ):
    """[B, Q, D] the question tokens' LM embeddings.

    With `static/tie_labels` 1, a label word is the projector applied to the ViT's own
    label row (`vit/label_E`), not a row of `lm/E`: the toy's stand-in for a pretrained
    VLM whose LM already knows the words its vision side aligns to. Without it the word
    and the picture of a label are unrelated until a training pair binds them, and the
    validation labels never appear in one (BUILD_NOTES.md, Results, paper 003).
    """
    words = params["lm"]["E"][question_BxQ]
    first_label = N_SCENE_WORDS - 1  # the token label 0 would have; label l is at 10 + l
    tied = project(params["proj"], params["vit"]["label_E"])
    label = jnp.clip(question_BxQ - first_label, 0, tied.shape[0] - 1)
    use = (read(params, "tie_labels") > 0) & (question_BxQ > first_label)
    return jnp.where(use[..., None], tied[label], words)


def route_visible(params, question_BxQ, L: int):
    """[B, S, S] bool, the keys each LM query may see under the planted route (None
    without it): every key, except that a question token other than a label word sees
    no image token (the causal mask is applied on top)."""
    if "lm_route" not in params["static"]:
        return None
    B, Q = question_BxQ.shape
    is_label = question_BxQ > N_SCENE_WORDS - 1  # label l's token is 10 + l
    query_sees_image = jnp.concatenate([jnp.ones((B, L), bool), is_label], axis=1)  # [B, S]
    key_is_image = jnp.arange(L + Q) < L
    return ~((~query_sees_image)[:, :, None] & key_is_image[None, None, :])


def lm_forward(params, image_BxLxD, question_BxQ, edits, aux, all_rows: bool):
    """The causal LM over [image tokens][question]: the last position's residual [B, D].

    `all_rows` False: the last block computes only the last query row (exact up to float
    rounding; the training path). True: every row (capture, e.g. per-position logits).
    """
    lm = params["lm"]
    B, Q = question_BxQ.shape
    x = jnp.concatenate([image_BxLxD, question_embedding(params, question_BxQ)], axis=1)
    S = x.shape[1]
    rotary = Rotary(lm_angles(params, Q, edits))
    route = route_visible(params, question_BxQ, image_BxLxD.shape[1])
    x = edits("lm/resid_pre.0", x)
    n = n_lm_blocks(params)
    for layer in range(n):
        last = layer == n - 1
        rows = None if all_rows or not last else jnp.full((B, 1), S - 1, jnp.int32)
        visible = None
        if route is not None:
            visible = (route if rows is None else route[:, S - 1 :])[:, None]  # [B, 1, Q, S]
        aux[f"lm/resid_pre.{layer}"] = x
        x, block_aux = block_forward(
            lm[f"block_{layer}"],
            x,
            causal=True,
            q_rows_BxQ=rows,
            edits=edits,
            prefix="lm/",
            suffix=f".{layer}",
            rotary=rotary,
            visible=visible,
        )
        aux.update(block_aux)
        if not last:
            x = edits(f"lm/resid_pre.{layer + 1}", x)
    final = edits("lm/final", x[:, -1])
    aux["lm/final"] = final
    return final


def n_lm_blocks(params) -> int:
    return n_blocks(params["lm"])


def site_name(site: int, n_blocks: int) -> str:
    """The intermediate of LM site `site`: the residual entering block `site`, or the
    last block's output for site = n_blocks (sites 0..n_blocks)."""
    if not 0 <= site <= n_blocks:
        raise ValueError(f"site = {site}: expected an LM site in [0, {n_blocks}]")
    return f"lm/resid_pre.{site}" if site < n_blocks else f"lm/resid_post.{n_blocks - 1}"


def unembed(params, resid_xD):
    """Logits [..., V] of residual vectors (final LayerNorm if the LM has one, W_U)."""
    lm = params["lm"]
    h = layer_norm(resid_xD, lm["lnf_w"], lm["lnf_b"]) if "lnf_w" in lm else resid_xD
    return h @ lm["W_U"]


def forward(
    params,
    labels_BxL,
    colours_BxL,
    facings_BxL,
    question_BxQ,
    *,
    edits: Edits | None = None,
    capture: bool = False,
):
    """The VLM's one forward pass: the LM's logits at the last position, and the named
    intermediates.

    Args:
      params: one model's params (module docstring; vmap over stacked ones).
      labels_BxL: int cell labels in [0, n_labels] (0 background), row-major cells.
      colours_BxL: int colours in [0, n_colours]; facings_BxL: int in [0, 2]
        (0 background, 1 left, 2 right).
      question_BxQ: int LM token ids in [0, V - 1] (`data.tasks.scenes`), the answer
        predicted after the last one.
      edits: interventions as data (`models.edits.Edits`; names: `edit_names`).
      capture: compute every intermediate whole (static under jit): the last LM block
        then computes every query row (same logits up to float rounding); without it
        that block computes the answer row only (the training path), so its
        intermediates hold that one row.

    Returns:
      (logits_BxV, intermediates), the family contract: `vit/content`,
      `vit/row_part`, `vit/col_part`, `vit/{point}.{layer}`, `proj/out`,
      `lm/{point}.{layer}` (points: `families.toy_vlm.checks.POINTS`; `rot_q`, `rot_k`
      with rotary positions) and `lm/final` (the last position's residual, [B, D]).
    """
    edits = NO_EDITS if edits is None else edits
    check_params(params)
    check_inputs(params, labels_BxL, colours_BxL, facings_BxL, question_BxQ)
    check_edits(params, edits, question_BxQ.shape[1])
    vit_out, aux = vit2d.vit_forward(params, labels_BxL, colours_BxL, facings_BxL, edits)
    image = image_tokens(params, vit_out, edits, aux)
    final = lm_forward(params, image, question_BxQ, edits, aux, all_rows=capture)
    logits = unembed(params, final)
    return logits, aux
