"""The LLaVA-1.5 forward as one pure function of (params, inputs).

    patches --W_patch--> + [CLS], + the learned position table --pre_layrnorm--> CLIP
    blocks --(the hidden state `feature_layer`, CLS dropped)--> Linear, GELU, Linear
    tokens --E--> embeddings, image features placed at the <image> tokens
                  --> Llama blocks (1D rotary, causal, grouped-query) --lnf--> logits

Params: `params.py` (TransformerLens layout). Inputs: `Inputs` below, as the processor
(`processor.py`) makes them. Numerics as the reference: norms, the rotary rotation and
the softmax in float32, everything else in the params' dtype.

Named sites (each a point where `Edits.replace` / `Edits.add` act and `capture` reads):

  vit/embed                     [B, 1 + P, E]  patch and class embeddings with positions
  vit/{point}.{i}               resid_pre (block 0's: after pre_layrnorm), q, k, v
                                ([B, 1 + P, H, Dh]), attn_scores, pattern, z, attn_out,
                                resid_mid, mlp_out, resid_post (no rot_q / rot_k: no
                                rotary in the ViT). Every block is named; the projector
                                reads block `feature_block - 1`'s output (LLaVA-1.5: the
                                second to last), and the blocks after it run only where
                                `capture` asks for one of their sites
  proj/out                      [B, I, D]  the image features the LM reads (I = P)
  lm/embed                      [B, S, D]  the LM's input (image features placed)
  lm/{point}.{i}                as the ViT's, with rot_q / rot_k (k, v: Hkv heads)
  lm/final                      [B, S, D]  after the last norm

Position edits: `Edits.vit_rows / vit_cols` ([P]: positions enter once) read the
position table's patch rows at those (row, col), bilinearly (`positions.table_at`: an
integer mirror is a column permutation, a half-cell shift an interpolation; the CLS
row fixed); `Edits.lm_pos_ids` ([S], [3, S] or [B, 3, S] with equal rows) replaces the
LM's ids; `Edits.image_order` ([I]) makes image slot i read image token image_order[i].

Partial runs: `forward(..., last_row=True)` runs the last LM block for the last row only
(logits [B, V]); `forward(..., resume=Resume(...))` runs the LM from one block on the
last rows only, the rows before read from another run's keys and values.

Axis names (`jaxmech.shapes`): B sequences, P patches, I image tokens, S LM tokens, E / D
ViT / LM width, H heads, Dh head width, R rotary pairs, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.families import hf_vlm
from jaxmech.families.llava import positions
from jaxmech.families.llava.checks import check_edits, check_inputs
from jaxmech.families.llava.config import LlavaConfig
from jaxmech.models.decoder import ACT, Resume, Sites, after, block_forward, inv_freq, layer_norm
from jaxmech.models.edits import NO_EDITS, Edits
from jaxmech.models.generate import Decoding
from jaxmech.models.precision import einsum, matmul
from jaxmech.models.scan import run_blocks

__all__ = ["Inputs", "Resume", "decoding", "forward", "image_features", "vision"]


# image_BxI: in patch order
Inputs = hf_vlm.PatchInputs


def _position_rows(vit, edits: Edits, c: LlavaConfig):
    """[P, E] the position table's patch rows as read under the edits."""
    if edits.vit_rows is None and edits.vit_cols is None:
        return vit["pos"][1:]
    rows, cols = positions.patch_grid(c.grid)
    rows = rows if edits.vit_rows is None else edits.vit_rows
    cols = cols if edits.vit_cols is None else edits.vit_cols
    return positions.table_at(vit["pos"], rows, cols)


def vision(params, inputs: Inputs, c: LlavaConfig, edits: Edits, site) -> jax.Array:
    """[B, I, D] the projected image features."""
    vit = params["vit"]
    pixels = inputs.pixels_BxPxF.astype(vit["W_patch"].dtype)
    patches = einsum("bpf,fe->bpe", pixels, vit["W_patch"]) + _position_rows(vit, edits, c)
    cls = jnp.broadcast_to(vit["cls"] + vit["pos"][0], (patches.shape[0], 1, c.vit_width))
    x = site("vit/embed", jnp.concatenate([cls.astype(patches.dtype), patches], 1))
    x = layer_norm(x, vit["ln_pre_w"], vit["ln_pre_b"], c.vit_eps)
    mask = jnp.ones((x.shape[0], x.shape[1], x.shape[1]), bool)

    def block(w, x, s, i, _):
        return block_forward(w, x, None, mask, s, "vit", i, c.vit_eps, ACT[c.vit_act])

    # the blocks to the projector's under one scan (`models.scan.run_blocks`), its
    # features the output of block feature_block - 1 (a tap where later ones run too)
    n, f = vit_blocks_run(site.capture, c), c.feature_block
    taps = [f"vit/resid_post.{f - 1}"] if 0 < f < n else []
    out, tapped = run_blocks(vit, c.vit_depth, x, range(n), block, site, taps=taps)
    feats = x if f == 0 else tapped[taps[0]] if taps else out
    return site("proj/out", projector(params["proj"], feats[:, 1:], c))


def vit_blocks_run(capture, c: LlavaConfig) -> int:
    """How many ViT blocks to run: those the projector reads (LLaVA-1.5: all but the
    last), or every block where `capture` asks for a site of a later one (True, a
    name without its block, or a block's name). Not tracing the rest keeps the
    compiled programs smaller (XLA would drop them, after building them)."""
    if capture is True:
        return c.vit_depth
    for name in capture or ():
        part, _, block = name.partition(".")
        if (
            part.startswith("vit/")
            and part != "vit/embed"
            and (not block or int(block) >= c.feature_block)
        ):
            return c.vit_depth
    return c.feature_block


def projector(p, x, c: LlavaConfig):
    """Linear, activation, Linear (biases where the checkpoint has them)."""
    x, p = after(x, p)
    h = matmul(x, p["W1"]) + p["b1"] if "b1" in p else matmul(x, p["W1"])
    h = matmul(ACT[c.proj_act](h), p["W2"])
    return h + p["b2"] if "b2" in p else h


def forward(params, inputs: Inputs, edits: Edits | None = None, *, config: LlavaConfig,
            capture=False, rows=None, resume: Resume | None = None, last_row: bool = False):  # fmt: skip
    """(logits, aux): logits [B, S, V], or [B, V] at `rows` ([B] positions) or at the last
    token (`last_row`: the last block then runs that row only, and its sites hold it
    alone); aux the captured sites (module docstring). `resume`: run the LM from a block
    on the last rows only (`Resume`; `rows` still count from 0). Jittable with `config`
    static; vmappable over stacked edits."""
    return hf_vlm.placed_forward(params, inputs, edits, config, capture, rows, resume, last_row,
                                 checks=(check_inputs, check_edits), vision=vision,
                                 act=config.lm_act, images=hf_vlm.has_patches)  # fmt: skip


def image_features(params, inputs: Inputs, *, config: LlavaConfig) -> jax.Array:
    """[B, I, D] the projector's output, unedited."""
    return vision(params, inputs, config, NO_EDITS, Sites(NO_EDITS, False))


def decoding(config: LlavaConfig) -> Decoding:
    """What `models.generate` needs of the LM (`hf_vlm.text_decoding`)."""
    freq = inv_freq(config.lm_head_dim, config.lm_rope_theta)
    return hf_vlm.text_decoding(forward, config, freq, config.lm_act)
