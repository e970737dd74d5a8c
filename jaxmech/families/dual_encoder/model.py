"""The CLIP-style dual encoder: one pure forward, and the Flax module that declares it.

Params (a plain nested dict; `init_params` builds it):

  vision/ E [V_img, D]   P [L (+1 with cls_position), D]   block_0 ... block_{n-1}
          (or, with vision_pos = "rope", rope_freqs [R] instead of P)
          (lnf_w, lnf_b [D] with LayerNorm)   W_proj [D, Z]
  text/   E [V_txt, D]   P [T, D]   block_*   (lnf_*)   W_proj [D, Z]
  logit_scale []
  static/ causal_text, logit_scale_max, cls_position []  (`families.dual_encoder.checks`)

Everything the forward needs about the architecture is read off the params (number
of blocks, heads, LayerNorm, MLP, whether the CLS token has a position row, rotary
positions), and the behaviour switches without a trained parameter (the text tower's
causal mask, the logit-scale cap) from `params["static"]`, so analysis code calls
`forward(params, ...)` with no module, config object or switch keyword. A
counterfactual (e.g. a bidirectional text tower) is a model with edited switches:
`forward(families.dual_encoder.checks.with_static(params, causal_text=0.0), ...)`.

Rotary vision tower (`vision_pos = "rope"`): the vision params hold `rope_freqs`
(R = Dh/2 frequencies `rope_base ** (-2i / Dh)`, a constant: the forward stops its
gradient, so training never changes it) and no `P`. The input is `E[tokens]` only;
every vision block rotates q and k by `rotary position x rope_freqs`, with CLS at
rotary position 0 and pixel i at `1 + positions[i]` (default positions 0..L-1, so the
rotary position is the sequence index). Pixel-pixel logits depend only on differences
of pixel positions; the CLS row sees each pixel at its offset from CLS, which is how
the tower knows absolute position (left/right of the image).

Vision input: `[CLS, x_0 .. x_{L-1}]`; output = residual stream at CLS (row 0).
Text input: `BOS w.. EOT PAD..`; output = residual stream at the first EOT, whose id is
the last text token id (`data.tasks.vocab`).

Axis names: the glossary of `jaxmech.shapes` (B images, C captions, L image length, T
caption length, S sequence, D d_model, H heads, Dh d_head, Z embedding width, R rotary
frequency pairs, V vocabulary).

Under `jax.jit`, `readout_only` must be static (`static_argnames`); params, inputs,
positions and edits may be traced. Inputs are checked before tracing
(`families.dual_encoder.checks`): ValueErrors name the argument, the value and what was expected.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmech.config import Config
from jaxmech.data.tasks import task_vocab
from jaxmech.data.tasks.vocab import CAPTION_LEN
from jaxmech.families.dual_encoder.checks import (
    check_captions,
    check_edits,
    check_images,
    read_static,
)
from jaxmech.families.dual_encoder.config import DualEncoderConfig
from jaxmech.models.attention import FirstBlock, Rotary, block_forward, layer_norm, select_rows
from jaxmech.models.attention import n_blocks as count_blocks
from jaxmech.models.edits import NO_EDITS, Edits

LOGIT_SCALE_MAX = math.log(100.0)


def static_params(config: Config) -> dict:
    """`params["static"]` for `config`: the switches without a trained parameter (f32 [])."""
    m = config.model
    return {
        "causal_text": jnp.float32(1.0 if m.causal_text else 0.0),
        "logit_scale_max": jnp.float32(m.logit_scale_max),
        "cls_position": jnp.float32(1.0 if m.cls_position else 0.0),
    }


def _position_rows(P, positions):
    """Rows of P at (possibly fractional) positions: linear interpolation for floats."""
    positions = jnp.asarray(positions)
    if jnp.issubdtype(positions.dtype, jnp.integer):
        return P[positions]
    lo = jnp.clip(jnp.floor(positions).astype(jnp.int32), 0, P.shape[0] - 1)
    hi = jnp.clip(lo + 1, 0, P.shape[0] - 1)
    frac = (positions - jnp.floor(positions))[..., None]
    return (1.0 - frac) * P[lo] + frac * P[hi]


def is_rotary(tower) -> bool:
    """Whether a tower uses rotary positions (has `rope_freqs`, no `P`)."""
    return "rope_freqs" in tower


def rope_positions(image_len: int, positions=None):
    """Rotary positions of the vision sequence, float [S] (or [B, S]): CLS 0, pixel i at
    1 + positions[i] (default: 1..L)."""
    if positions is None:
        positions = jnp.arange(image_len)
    pix = jnp.asarray(positions, jnp.float32) + 1.0
    cls = jnp.zeros(pix.shape[:-1] + (1,), jnp.float32)
    return jnp.concatenate([cls, pix], axis=-1)


def rope_angles(tower, rope_pos):
    """Angles [..., S, R] = rotary position x frequency (the frequencies are constants)."""
    freqs = jax.lax.stop_gradient(tower["rope_freqs"])
    return jnp.asarray(rope_pos, jnp.float32)[..., None] * freqs


def rope_frequencies(d_head: int, base: float):
    """The standard RoPE frequencies base^(-2i / d_head), i = 0 .. d_head/2 - 1."""
    return base ** (-jnp.arange(d_head // 2, dtype=jnp.float32) * 2.0 / d_head)


def vision_inputs(tower, images_BxL, positions=None):
    """Tokens [B, S] (CLS first) and position rows of the vision input.

    `positions` ([L] or [B, L], int or float) are the pixel positions whose rows of P
    are added (default: natural order 0..L-1). Mirrored codes are `L - 1 - arange(L)`;
    fractional positions interpolate between neighbouring rows. The position rows are
    [S, D] (or [B, S, D] for batched positions); the CLS row is zero unless P has a row
    for it (P with L + 1 rows: `cls_position`). A rotary tower has no position rows:
    they are None (its positions enter as angles, `rope_positions`). Takes one tower's
    params; `encode_images` checks the inputs against the whole params first.
    """
    B, L = images_BxL.shape
    E = tower["E"]
    cls_id = E.shape[0] - 1
    tokens = jnp.concatenate([jnp.full((B, 1), cls_id, images_BxL.dtype), images_BxL], axis=1)
    if is_rotary(tower):
        return tokens, None
    P = tower["P"]
    if P.shape[0] not in (L, L + 1):
        raise ValueError(
            f"vision P has {P.shape[0]} rows but images have length {L}: expected {L} "
            f"(CLS without position) or {L + 1} (CLS at position 0)"
        )
    cls_has_pos = P.shape[0] == L + 1
    if positions is None:
        positions = jnp.arange(L)
    pix = _position_rows(P, jnp.asarray(positions) + int(cls_has_pos))
    cls = P[0] if cls_has_pos else jnp.zeros((P.shape[1],), P.dtype)
    cls = jnp.broadcast_to(cls, pix.shape[:-2] + (1, P.shape[1]))
    return tokens, jnp.concatenate([cls, pix], axis=-2)


def text_inputs(tower, captions_CxT, positions=None):
    """Tokens [C, T] and position rows ([T, D], or [C, T, D] for batched positions)."""
    T = captions_CxT.shape[1]
    if positions is None:
        positions = jnp.arange(T)
    return captions_CxT, _position_rows(tower["P"], positions)


def eot_index(tower, captions_CxT):
    """Position [C] of the first EOT token (the last text token id) in each caption."""
    eot = tower["E"].shape[0] - 1
    return jnp.argmax(captions_CxT == eot, axis=1)


def _first_block(tower, tokens_BxS, p_rows, name: str, edits: Edits):
    """The first block's input parts and fast path (`attention.FirstBlock`), and its aux."""
    e_part = tower["E"][tokens_BxS]
    if is_rotary(tower):
        p_part = jnp.zeros_like(e_part)
    else:
        p_part = jnp.broadcast_to(p_rows, e_part.shape)
    first_in = f"{name}/resid_pre.0"
    # Layer 0 sees x = E[tokens] + P: its projections can be looked up from E W and P W
    # unless LayerNorm or an edit of resid_pre.0 comes between.
    factored = (
        "ln1_w" not in tower["block_0"]
        and first_in not in edits.replace
        and first_in not in edits.add
    )
    first = FirstBlock(
        tokens_BxS,
        tower["E"],
        p_rows,
        e_part,
        p_part,
        factored=factored,
        term_keep=edits.term_keep.get(name),
        vp_keep=edits.vp_keep.get(name),
    )
    # The token and position parts of the input (what the logit decomposition splits).
    return first, {f"{name}/e_part": e_part, f"{name}/p_part": p_part}


def _rotary(tower, rope_pos, name: str, edits: Edits):
    """(angles [..., S, R] or None, rope_keep [H] / [Y, H] or None) of a tower."""
    rotary = is_rotary(tower)
    if rotary and rope_pos is None:
        raise ValueError("a rotary tower needs rope_pos (see rope_positions)")
    rope_keep = edits.rope_keep.get(name)
    if rope_keep is not None and not rotary:
        raise ValueError(f"rope_keep[{name!r}]: the {name} tower has no rotary positions")
    return (rope_angles(tower, rope_pos) if rotary else None), rope_keep


def _embed(tower, readout_BxD, name: str, edits: Edits, aux: dict):
    """The readout row -> (final LayerNorm) -> W_proj -> L2-normalised embedding [B, Z]."""
    readout = edits(f"{name}/readout", readout_BxD)
    aux[f"{name}/readout"] = readout
    h = layer_norm(readout, tower["lnf_w"], tower["lnf_b"]) if "lnf_w" in tower else readout
    proj = h @ tower["W_proj"]
    embed = proj / jnp.linalg.norm(proj, axis=-1, keepdims=True).clip(1e-12)
    embed = edits(f"{name}/embed", embed)
    aux[f"{name}/embed"] = embed
    return embed


def encode(
    tower,
    tokens_BxS,
    p_rows,
    readout_idx_B,
    *,
    name: str,
    causal,
    readout_only: bool = False,
    edits: Edits = NO_EDITS,
    rope_pos=None,
):
    """Runs one tower and reads out one row per sequence.

    Args:
      tower: this tower's params.
      tokens_BxS: input token ids; the input is `E[tokens] + p_rows`.
      p_rows: position rows, [S, D] shared or [B, S, D]; None for a rotary tower.
      readout_idx_B: int [B], the row to read out (CLS: 0; each caption's EOT).
      name: "vision" or "text" (prefix of intermediates and edit names).
      causal: causal self-attention mask: a bool, or a scalar flag array (0: none;
        `params["static"]["causal_text"]`).
      readout_only: compute the last layer's attention for the readout row only
        (exact; the training fast path). Last-layer intermediates then have one row.
      edits: named interventions.
      rope_pos: rotary positions [S] or [B, S] of every sequence row (rotary towers
        only; `rope_positions`).

    Returns:
      (embed_BxZ L2-normalised, intermediates dict).
    """
    if is_rotary(tower) != (p_rows is None):
        raise ValueError("a rotary tower takes p_rows=None; a learned-P tower needs p_rows")
    angles, rope_keep = _rotary(tower, rope_pos, name, edits)
    first, aux = _first_block(tower, tokens_BxS, p_rows, name, edits)
    x = edits(f"{name}/resid_pre.0", first.e_part + first.p_part)
    readout_rows_Bx1 = readout_idx_B[:, None]
    n = count_blocks(tower)
    for layer in range(n):
        last = layer == n - 1
        keep = rope_keep
        if keep is not None and keep.ndim == 2:
            keep = keep[layer]
        aux[f"{name}/resid_pre.{layer}"] = x
        x, block_aux = block_forward(
            tower[f"block_{layer}"],
            x,
            causal=causal,
            q_rows_BxQ=readout_rows_Bx1 if readout_only and last else None,
            edits=edits,
            prefix=f"{name}/",
            suffix=f".{layer}",
            first=first if layer == 0 else None,
            rotary=None if angles is None else Rotary(angles, keep),
        )
        aux.update(block_aux)
        if not last:
            x = edits(f"{name}/resid_pre.{layer + 1}", x)
    readout = x[:, 0] if readout_only else select_rows(x, readout_rows_Bx1)[:, 0]
    return _embed(tower, readout, name, edits, aux), aux


def encode_images(params, images_BxL, *, positions=None, readout_only=False, edits=NO_EDITS):
    """Vision embeddings and intermediates of int images.

    Args:
      params: one model's params (vmap over stacked ones).
      images_BxL: int pixel ids in [0, V_img - 2] (V_img - 1 is CLS, which the encoder
        prepends); L must match the vision P (L rows, or L + 1 with `cls_position`).
      positions: pixel positions [L] or [B, L], int or float (in [0, L - 1] with a
        learned P; any value is a rotary position in a rotary tower). Default 0..L-1.
      readout_only: compute the last layer's CLS row only (exact, faster).
      edits: interventions (`models.edits`).

    Returns:
      (embed_BxZ L2-normalised, intermediates dict).
    """
    check_images(params, images_BxL, positions)
    check_edits(params, edits, "vision")
    tower = params["vision"]
    tokens, p_rows = vision_inputs(tower, images_BxL, positions)
    idx = jnp.zeros((images_BxL.shape[0],), jnp.int32)
    rope_pos = rope_positions(images_BxL.shape[1], positions) if is_rotary(tower) else None
    return encode(
        tower,
        tokens,
        p_rows,
        idx,
        name="vision",
        causal=False,
        readout_only=readout_only,
        edits=edits,
        rope_pos=rope_pos,
    )


def encode_texts(params, captions_CxT, *, positions=None, readout_only=False, edits=NO_EDITS):
    """Text embeddings and intermediates of int captions.

    The causal mask is `params["static"]["causal_text"]` (`checks.with_static` edits it).

    Args:
      params: one model's params (vmap over stacked ones).
      captions_CxT: int token ids in [0, V_txt - 1], each caption with an EOT (the last
        id); T at most the text P's rows.
      positions: token positions [T] or [C, T] in [0, T_P - 1] (default 0..T-1).
      readout_only, edits: as `encode_images`'s (the readout row is the EOT's).

    Returns:
      (embed_CxZ L2-normalised, intermediates dict).
    """
    check_captions(params, captions_CxT, positions)
    check_edits(params, edits, "text")
    causal = read_static(params, "causal_text")
    tower = params["text"]
    tokens, p_rows = text_inputs(tower, captions_CxT, positions)
    return encode(
        tower,
        tokens,
        p_rows,
        eot_index(tower, captions_CxT),
        name="text",
        causal=causal,
        readout_only=readout_only,
        edits=edits,
    )


def logit_scale(params):
    """exp(min(logit_scale, max)) []: the temperature of the similarities.

    The cap `max` is `params["static"]["logit_scale_max"]` (`checks.with_static`).
    """
    max_value = read_static(params, "logit_scale_max")
    return jnp.exp(jnp.minimum(params["logit_scale"], max_value))


def forward(
    params,
    images_BxL,
    captions_CxT,
    *,
    edits: Edits = NO_EDITS,
    vision_positions=None,
    text_positions=None,
    readout_only: bool = False,
):
    """The dual encoder's one forward pass.

    Args:
      params: one model's params (module docstring; vmap over stacked ones). The text
        mask and the logit-scale cap are its `static` switches (`checks.with_static`).
      images_BxL: int images. captions_CxT: int caption tokens (`encode_images`,
        `encode_texts` say what is accepted).
      edits: interventions as data (`models.edits`).
      vision_positions / text_positions: position ids ([L]/[T] or batched; float
        positions interpolate rows of P, or are rotary positions as they are in a
        rotary vision tower). Default: natural order.
      readout_only: last layers compute only the CLS / EOT query row (exact, faster;
        static under jit).

    Returns:
      (sims_BxC = exp(logit_scale) * cos(image, caption), intermediates dict with
      every named point of both towers, `vision/embed`, `text/embed`, `logit_scale`).
    """
    # checked here too, so that errors name forward's own arguments
    check_images(params, images_BxL, vision_positions, "vision_positions")
    check_captions(params, captions_CxT, text_positions, "text_positions")
    img, aux_v = encode_images(
        params, images_BxL, positions=vision_positions, readout_only=readout_only, edits=edits
    )
    txt, aux_t = encode_texts(
        params,
        captions_CxT,
        positions=text_positions,
        readout_only=readout_only,
        edits=edits,
    )
    scale = logit_scale(params)
    aux = {**aux_v, **aux_t, "logit_scale": scale}
    return scale * img @ txt.T, aux


# ---------------------------------------------------------------------------
# Flax modules: they declare the parameters (names, shapes, initialisers) and
# delegate the computation to `forward`, so there is one forward pass.


def _normal(std):
    return nn.initializers.normal(stddev=std)


class Block(nn.Module):
    """Declares one block's parameters and returns them as a dict."""

    cfg: DualEncoderConfig

    @nn.compact
    def __call__(self):
        c = self.cfg
        H, D, Dh = c.n_heads, c.d_model, c.d_head
        zeros = nn.initializers.zeros
        p = {}
        for w in "QKV":
            p[f"W_{w}"] = self.param(f"W_{w}", _normal(D**-0.5), (H, D, Dh))
            p[f"b_{w}"] = self.param(f"b_{w}", zeros, (H, Dh))
        p["W_O"] = self.param("W_O", _normal((H * Dh) ** -0.5), (H, Dh, D))
        p["b_O"] = self.param("b_O", zeros, (D,))
        if c.layernorm:
            for i in ("1", "2"):
                p[f"ln{i}_w"] = self.param(f"ln{i}_w", nn.initializers.ones, (D,))
                p[f"ln{i}_b"] = self.param(f"ln{i}_b", zeros, (D,))
        if c.mlp:
            p["W_in"] = self.param("W_in", _normal(D**-0.5), (D, c.d_mlp))
            p["b_in"] = self.param("b_in", zeros, (c.d_mlp,))
            p["W_out"] = self.param("W_out", _normal(c.d_mlp**-0.5), (c.d_mlp, D))
            p["b_out"] = self.param("b_out", zeros, (D,))
        return p


class Tower(nn.Module):
    """Declares one encoder's parameters and returns them as a dict."""

    cfg: DualEncoderConfig
    vocab_size: int
    n_pos: int
    n_layers: int
    rope: bool = False  # rotary positions: rope_freqs instead of P

    @nn.compact
    def __call__(self):
        c = self.cfg
        p = {"E": self.param("E", _normal(c.init_E), (self.vocab_size, c.d_model))}
        if self.rope:
            freqs = rope_frequencies(c.d_head, c.rope_base)
            p["rope_freqs"] = self.param("rope_freqs", lambda key, shape: freqs, freqs.shape)
        else:
            p["P"] = self.param("P", _normal(c.init_P), (self.n_pos, c.d_model))
        for i in range(self.n_layers):
            p[f"block_{i}"] = Block(c, name=f"block_{i}")()
        if c.layernorm:
            p["lnf_w"] = self.param("lnf_w", nn.initializers.ones, (c.d_model,))
            p["lnf_b"] = self.param("lnf_b", nn.initializers.zeros, (c.d_model,))
        p["W_proj"] = self.param("W_proj", _normal(c.d_model**-0.5), (c.d_model, c.d_embed))
        return p


class DualEncoder(nn.Module):
    """The two towers and the learned logit scale; `__call__` is `forward`."""

    config: Config

    @nn.compact
    def __call__(self, images_BxL, captions_CxT, **kwargs):
        c, t = self.config.model, self.config.task
        v = task_vocab(t)
        params = {
            "vision": Tower(
                c,
                v.image_vocab_size,
                t.image_len + int(c.cls_position),
                c.n_layers,
                rope=c.vision_pos == "rope",
                name="vision",
            )(),
            "text": Tower(c, v.text_vocab_size, CAPTION_LEN, c.text_layers, name="text")(),
            "logit_scale": self.param(
                "logit_scale", nn.initializers.constant(c.logit_scale_init), ()
            ),
        }
        # the switches are constants, not Flax params: `init_params` adds them after init
        params["static"] = static_params(self.config)
        return forward(params, images_BxL, captions_CxT, **kwargs)


def init_params(config: Config, key: jax.Array):
    """A fresh params dict for `config` (plain nested dict of arrays).

    The Flax init draws every trained parameter; `params["static"]` (`static_params`)
    is added after it, so it shifts no random stream.
    """
    t = config.task
    images = jnp.zeros((1, t.image_len), jnp.int32)
    captions = jnp.asarray([task_vocab(t).encode([1])], jnp.int32)
    params = DualEncoder(config).init(key, images, captions, readout_only=True)["params"]
    return {**params, "static": static_params(config)}
