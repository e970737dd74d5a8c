"""What every Hugging Face VLM checkpoint family (each registered in `families.registry`)
has in the same shape, so that a new family writes only what differs:
its config.json parsing and refusals, its key map, its vision tower and projector, its
positions, its image geometry and its chat template.

* `checkpoint_family`: the `CheckpointFamily` record from a family's modules (`load`,
  `params`, `checks`, `model`, `processor`) and what is its own (describe, trainable,
  windows, ...); the fields every family fills alike are filled here.
* `vit_fields`, `lm_fields`, `lm_layout`: the CLIP / SigLIP ViT's config fields read
  from a `vision_config`, the Llama-layout LM's from a `text_config` (the fields:
  `families.fields`), its `LMLayout`.
* `loaders`, `HUB_PREFIXES` / `PROJ_LM_PREFIXES`, `norm_map`, `mlp_map`,
  `clip_block_map`, `clip_block_shapes`: a family's `read_config` / `load_checkpoint`
  (`models.hub`), the stored-name prefixes of the `vision_tower` /
  `multi_modal_projector` / `language_model` layout, a ViT block's LayerNorms' and MLP's
  key maps, the CLIP / SigLIP ViT block's key map and shapes.
* `lm_start`, `placed_forward`, `has_patches`: the start of a forward whose LM reads
  image features placed at its image tokens (checks, sites, resume, `lm/embed`), and
  the whole forward where that LM is a Llama-layout stack with 1-D rotary ids.
* `text_decoding`: what greedy generation needs of an LM with one rotary id per token.
* `lm_site_names`, `check_patches`, `check_edits`: the ViT-then-LM site list, the
  patches' shape check and the outline of a family's edit checks (`models.checks`).
* `with_resize`, `preprocessor_json`, `flat_patches`, `padded_rows`, `image_rows`,
  `grid_spans`: a processor's resize backend, its preprocessor_config.json, an image's
  flattened patches, its prompts' token rows, where their image tokens are, and the
  `Spans` of a square grid of image tokens.
* `PatchInputs`, `GridEncoded`, `grid_inputs`, `grid_encoders`: the model inputs and
  encoded batch of a family whose every image is one square of patches, and its
  `encode` / `encode_text`.
* `Rendering`, `decoder_view`: a family's `VLMView` from what differs (how it encodes
  and places a batch, its pixels' decoding, forward, positions, image geometry); the
  rest (drawn scenes, photographs and text asked, the answer-row forward, resumed runs,
  greedy replies, the text's rotary ids) is filled here alike; `patch_decoder`,
  `patch_square`, `check_drawn_size`, `check_cells`: a view's pixel decoding, ViT
  positions and image grid of one square of patches, and its size and grid refusals.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxmech.data.inputs import pictures, prompts
from jaxmech.data.inputs.pixels import decoded
from jaxmech.data.inputs.resize import BACKENDS
from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily, contract_forward
from jaxmech.families.vlm_view import Spans, VLMView, generate_rendered, one_image_grid, placed
from jaxmech.models import checks, hub, layout
from jaxmech.models.checks import check_resume, shape
from jaxmech.models.decoder import (
    POINTS,
    RESUME_SITES,
    UNROTATED_POINTS,
    Sites,
    answer_forward,
    block_sites,
    inv_freq,
    logits_at,
    next_token_logprobs,
    place_images,
    run_lm,
)
from jaxmech.models.edits import NO_EDITS
from jaxmech.models.generate import Decoding, continued_ids, generate
from jaxmech.models.hf_config import get
from jaxmech.models.hub import T, heads_bias, heads_in, heads_out, same
from jaxmech.models.layout import authors_vit_mlp
from jaxmech.models.positions import edited_ids, rotary_angles, text_ids, view_ids

# the reports of a family whose view has no video (`temporal_ids` needs one)
IMAGE_REPORTS = tuple(r for r in VLM_REPORTS if r != "temporal_ids")


# ---- the family record -----------------------------------------------------------------


def processor_tokenizer(proc):
    """The contract's `tokenizer(processor)`: every family's processor holds its own."""
    return proc.tokenizer


def _sites(site_names, config, p=None):
    return site_names(config)


def authors_vit_and_projector(p) -> str:
    """The authors' trained leaves as a `train_only` spec where their selector takes the
    projector (named `multi_modal_projector` in the checkpoint): the MLP weights (W_in,
    W_out; no biases) of the ViT's last min(6, depth) blocks
    (`models.layout.authors_vit_mlp`) and the whole projector."""
    return "+".join(authors_vit_mlp(p) + [f"proj/{name}" for name in p["proj"]])


def checkpoint_family(name, checkpoint_types, modules, *, view, describe, trainable, encode=None,
                      generates=True, reports=IMAGE_REPORTS, **own) -> CheckpointFamily:  # fmt: skip
    """A `CheckpointFamily` from a family's modules `(load, params, checks, model,
    processor)`: `load.read_config`, `load.load_checkpoint`, `params.init_params`,
    `checks.site_names(config)` (the sites), `model.forward` (the forward, next-token
    log-probs) and `model.decoding` (greedy generation; `generates` False: none),
    `processor.load_processor` and `processor.encode` (or `encode`), `load.key_map` and
    `load.canonical` (the stored leaves); `own`: the rest of the contract's fields
    (`stand_in`, `authors_windows`, `authors_wordings`, `answer_turn`,
    `encode_text_first`)."""
    load, params, sites, model, processor = modules
    return CheckpointFamily(
        name=name,
        checkpoint_types=tuple(checkpoint_types),
        read_config=load.read_config,
        load=load.load_checkpoint,
        init_params=params.init_params,
        view=view,
        processor=processor.load_processor,
        encode=encode or processor.encode,
        tokenizer=processor_tokenizer,
        next_token=functools.partial(next_token_logprobs, model.forward),
        generate=functools.partial(generate, model.decoding) if generates else None,
        describe=describe,
        trainable=trainable,
        forward=functools.partial(contract_forward, model.forward),
        sites=functools.partial(_sites, sites.site_names),
        reports=reports,
        stored_leaves=functools.partial(_stored_leaves, load),
        **own,
    )


def _stored_leaves(load, config, names) -> dict:
    """{stored name: (our leaf path, transform to our layout), or None where the key map
    places it nowhere} of `names` (the contract's `stored_leaves`)."""
    m, out = load.key_map(config), {}
    for n in names:
        entry = m.get(load.canonical(n))
        out[n] = None if entry is None else (entry[0], entry[2])
    return out


# ---- loading -----------------------------------------------------------------------------


def loaders(what: str, from_hf, canonical, key_map, **options):
    """(read_config, load_checkpoint) of a family named `what` in messages:
    `read_config(folder)` the folder's config.json through `from_hf` (a LoadError naming
    the path); `load_checkpoint(folder, dtype, place)` -> (config, params) by
    `models.hub.load_checkpoint` with the family's `canonical` and `key_map` (and
    `options`: `unused`, `stored_head_wins`)."""

    def read_config(folder: str):
        return hub.read_config(folder, from_hf)

    def load_checkpoint(folder: str, dtype=np.float32, place: str = "auto"):
        return hub.load_checkpoint(folder, dtype, place, from_hf=from_hf, canonical=canonical,
                                   key_map=key_map, **options)  # fmt: skip

    read_config.__doc__ = (
        f"The folder's config.json as a {what} config (LoadError naming the path)."
    )
    load_checkpoint.__doc__ = (
        f"(config, params) of a {what} checkpoint folder (`models.hub.load_checkpoint`: "
        '`dtype` the params\', `place` "auto", "one" or "shard").'
    )
    return read_config, load_checkpoint


# stored name prefix -> canonical prefix, first match wins (`models.hub.prefix_renamer`):
# the Hub's files (`multi_modal_projector.*`, `language_model.model.*`,
# `language_model.lm_head.*`) and transformers 5's in-memory names (`model.*`, `lm_head.*`)
PROJ_LM_PREFIXES = (
    ("model.multi_modal_projector.", "proj."),
    ("multi_modal_projector.", "proj."),
    ("model.language_model.", "lm."),
    ("language_model.model.", "lm."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
# and the vision tower's: `vision_tower.vision_model.*` (the Hub's), `vision_tower.*`
# (transformers 5's saves) and `model.vision_tower.*` (in memory), before the rest
HUB_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision."),
    ("model.vision_tower.", "vision."),
    ("vision_tower.vision_model.", "vision."),
    ("vision_tower.", "vision."),
    *PROJ_LM_PREFIXES,
)


def norm_map(b: str, out: str, names: dict, E: int, parts=("weight", "bias")) -> dict:
    """The key map of a ViT block's LayerNorms (each [E], stored as is): for each stored
    `{b}{hf}.{part}` (`names` {hf: ours}, `parts` of "weight", "bias") our
    `{out}{ours}_w` / `_b`, in that order."""
    return {b + f"{hf}.{part}": (out + f"{ours}_{part[0]}", (E,), same)
            for hf, ours in names.items() for part in parts}  # fmt: skip


def mlp_map(b: str, out: str, names: dict, E: int, M: int) -> dict:
    """The key map of a ViT block's MLP Linears with biases: stored `{b}{hf}.weight` /
    `.bias` (`names` {hf: ours}, ours "in", "gate" ([M, E] stored) or "out" ([E, M]))
    to our `{out}W_{ours}` (transposed) / `b_{ours}`."""
    m = {}
    for hf, ours in names.items():
        shape = (E, M) if ours == "out" else (M, E)
        m[b + f"{hf}.weight"] = (out + f"W_{ours}", shape, T)
        m[b + f"{hf}.bias"] = (out + f"b_{ours}", shape[:1], same)
    return m


def clip_block_map(c, i: int) -> dict:
    """The key map of CLIP / SigLIP ViT block i (`vision.encoder.layers.{i}.`: two
    LayerNorms, q / k / v / out projections with biases, fc1 / fc2) to `vit/block_{i}/`."""
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    b, out = f"vision.encoder.layers.{i}.", f"vit/block_{i}/"
    m = norm_map(b, out, {"layer_norm1": "ln1", "layer_norm2": "ln2"}, E)
    for w in "qkv":
        m[b + f"self_attn.{w}_proj.weight"] = (out + f"W_{w.upper()}", (E, E), heads_in(H, Dh))
        m[b + f"self_attn.{w}_proj.bias"] = (out + f"b_{w.upper()}", (E,), heads_bias(H, Dh))
    m |= {b + "self_attn.out_proj.weight": (out + "W_O", (E, E), heads_out(H, Dh)),
          b + "self_attn.out_proj.bias": (out + "b_O", (E,), same)}  # fmt: skip
    return m | mlp_map(b, out, {"mlp.fc1": "in", "mlp.fc2": "out"}, E, M)


def clip_block_shapes(c) -> dict:
    """One CLIP / SigLIP ViT block's shapes in TransformerLens layout (`clip_block_map`)."""
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    s = {n: (E,) for n in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")}
    for w in "QKV":
        s |= {f"W_{w}": (H, E, Dh), f"b_{w}": (H, Dh)}
    return s | {"W_O": (H, Dh, E), "b_O": (E,), "W_in": (E, M), "b_in": (M,), "W_out": (M, E),
                "b_out": (E,)}  # fmt: skip


# ---- the language model ------------------------------------------------------------------


def lm_fields(text, *, head_dim: bool = True, eps: float = 1e-6) -> dict:
    """The Llama-layout LM's sizes from a `text_config` (as a dict): `lm_vocab`,
    `lm_width`, `lm_layers`, `lm_heads`, `lm_kv_heads` (default: the heads), `lm_mlp`,
    `lm_eps` (default `eps`) and, with `head_dim`, `lm_head_dim` (default width /
    heads). A KeyError names a size the text config lacks."""
    width, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    out = dict(lm_vocab=int(text["vocab_size"]), lm_width=width,
               lm_layers=int(text["num_hidden_layers"]), lm_heads=heads,
               lm_kv_heads=int(get(text, "num_key_value_heads", default=heads)),
               lm_mlp=int(text["intermediate_size"]),
               lm_eps=float(get(text, "rms_norm_eps", default=eps)))  # fmt: skip
    if head_dim:
        out["lm_head_dim"] = int(get(text, "head_dim", default=width // heads))
    return out


def vit_fields(v) -> dict:
    """The CLIP / SigLIP ViT's sizes from a `vision_config` (as a dict, the reference's
    class defaults filled): `vit_depth`, `vit_width`, `vit_heads`, `vit_mlp`,
    `vit_in_chans`, `image_size`, `patch_size`, `vit_eps`, `vit_act`."""
    return dict(vit_depth=int(v["num_hidden_layers"]), vit_width=int(v["hidden_size"]),
                vit_heads=int(v["num_attention_heads"]), vit_mlp=int(v["intermediate_size"]),
                vit_in_chans=int(v["num_channels"]), image_size=int(v["image_size"]),
                patch_size=int(v["patch_size"]), vit_eps=float(v["layer_norm_eps"]),
                vit_act=str(v["hidden_act"]))  # fmt: skip


def lm_layout(c, vocab: int | None = None, **switches) -> layout.LMLayout:
    """The LM's `models.layout.LMLayout` from a config's `lm_*` fields (`vocab`: the
    embedding's rows where they are not `lm_vocab`); `switches`: its biases and norms."""
    return layout.LMLayout(c.lm_width, c.lm_heads, c.lm_kv_heads, c.lm_head_dim, c.lm_mlp,
                           c.lm_layers, c.lm_vocab if vocab is None else vocab,
                           c.tie_embeddings, **switches)  # fmt: skip


def has_patches(inputs) -> bool:
    """Whether a batch's `pixels_BxPxF` hold an image (P > 0: `lm_start`'s `images`)."""
    return inputs.pixels_BxPxF.shape[1] > 0


def lm_start(params, inputs, edits, config, capture, resume, *, checks, vision, images=None,
             embed=None):  # fmt: skip
    """(edits, site, x) of a family's `model.forward` whose LM reads `vision(params,
    inputs, config, edits, site)`'s image features [B, I, D] placed at `inputs.image_BxI`
    (`edits.image_order` reordering them; `images(inputs)` False: no image, the ViT not
    run; None: always run): the edits (None: none) and the `Sites` after `checks`
    (check_inputs, check_edits), x the LM's input `lm/embed` ([B, S, D]; `embed(lm,
    tokens_BxS, config)` the text's, default the rows of `E`), or the resumed rows."""
    edits = NO_EDITS if edits is None else edits
    check_inputs, check_edits = checks
    check_inputs(inputs, config)
    check_edits(edits, inputs, config)
    site = Sites(edits, capture, config.remat)
    lm = params["lm"]
    if resume is not None:
        check_resume(resume, inputs.tokens_BxS, config.lm_layers, config.lm_width)
        return edits, site, resume.x_BxTxD
    x = lm["E"][inputs.tokens_BxS] if embed is None else embed(lm, inputs.tokens_BxS, config)
    if images is None or images(inputs):
        feats = vision(params, inputs, config, edits, site)
        if edits.image_order is not None:
            feats = feats[:, jnp.asarray(edits.image_order)]
        x = place_images(x, feats, inputs.image_BxI)
    return edits, site, site("lm/embed", x)


def placed_forward(params, inputs, edits, config, capture, rows, resume, last_row, *, act: str,
                   **start):  # fmt: skip
    """A family's `model.forward` (logits, aux) whose LM starts at `lm_start(..., **start)`
    and is a causal Llama-layout stack with one rotary id per token (`inputs.pos_BxS`,
    base `config.lm_rope_theta`; `act` its MLP's)."""
    edits, site, x = lm_start(params, inputs, edits, config, capture, resume, **start)
    lm = params["lm"]
    freq = inv_freq(config.lm_head_dim, config.lm_rope_theta)
    angles = rotary_angles(edited_ids(inputs.pos_BxS, edits.lm_pos_ids), freq)
    x = run_lm(lm, x, angles, inputs.valid_BxS, config.lm_layers, config.lm_eps, site, resume,
               last_row, act)  # fmt: skip
    return logits_at(lm, x, rows, resume, last_row), site.aux


# ---- generation ----------------------------------------------------------------------


def text_decoding(forward, config, freq, act: str, step=None) -> Decoding:
    """What `models.generate` needs of an LM with one rotary id per token: generated token
    k of a row at rotary id m + 1 + k, m the row's largest prompt id (its real tokens
    counted on, as `generate`'s position ids from the attention mask); `freq` [R] the
    LM's inverse frequencies, `step` a family's own decode step (None: `models.generate`'s)."""

    def angles(inputs, k):
        return rotary_angles(continued_ids(inputs.pos_BxS, k)[:, None], freq)

    return Decoding(forward, config.lm_layers, config.lm_eps, act, angles, step)


# ---- sites and edit checks ---------------------------------------------------------------


def lm_site_names(c, vision: tuple, proj: tuple) -> tuple[str, ...]:
    """`vision`'s sites, the ViT's blocks (no rotary: no rot_q / rot_k), the `proj` sites,
    then the LM's (`lm/embed`, its blocks, `lm/final`)."""
    vit = block_sites("vit", c.vit_depth, UNROTATED_POINTS)
    lm = block_sites("lm", c.lm_layers, POINTS)
    return (*vision, *vit, *proj, "lm/embed", *lm, "lm/final")


def check_patches(inputs, c) -> None:
    """`inputs.pixels_BxPxF` against the tokens' batch and the config: 0 patches (no
    image) or `c.n_patches`, each of `c.patch_features`."""
    B = shape(inputs.tokens_BxS)[0]
    Bp, P, F = shape(inputs.pixels_BxPxF)
    if Bp != B:
        raise ValueError(f"pixels_BxPxF: batch {Bp}, tokens have {B}")
    if P not in (0, c.n_patches) or F != c.patch_features:
        raise ValueError(
            f"pixels_BxPxF: {P} patches of {F} features, expected {c.n_patches} (or 0: no "
            f"image) of {c.patch_features} (channels x patch_size^2)"
        )


def check_edits(edits, inputs, c, site_names, family: str, name: str, vit_note: str, *,
                examples=None, vit_shapes=None, n_image=None, one_id: bool = True) -> None:  # fmt: skip
    """The outline of a family's `check_edits`: site names (`family` in messages, `name`
    the family's registry name; `examples` of sites, default a ViT block's, `proj/out`
    and the last LM block's), the ViT position edits' shapes (`vit_shapes`, default one
    position per patch, `vit_note` why), the LM position ids' (one id per token where
    `one_id`) and the image order's (`n_image` image tokens, default `inputs.image_BxI`'s);
    values when concrete."""
    if examples is None:
        examples = ("vit/resid_pre.0", "proj/out", f"lm/resid_post.{c.lm_layers - 1}")
    checks.check_names(edits, site_names(c), family, examples, name)
    B, S = shape(inputs.tokens_BxS)
    checks.check_vit_positions(edits, vit_shapes or [(c.n_patches,)], vit_note)
    checks.check_lm_pos_ids(edits.lm_pos_ids, B, S, family if one_id else None)
    checks.check_image_order(edits.image_order,
                             shape(inputs.image_BxI)[1] if n_image is None else n_image)  # fmt: skip


# ---- processors --------------------------------------------------------------------------


def with_resize(images, resize: str | None):
    """Image settings (a NamedTuple with `resize`) resizing by `resize` (None: as they
    are); a ValueError naming a backend `data.inputs.resize` does not have."""
    if resize is None:
        return images
    if resize not in BACKENDS:
        raise ValueError(f"resize = {resize!r}: expected one of {', '.join(BACKENDS)}")
    return images._replace(resize=resize)


def preprocessor_json(folder: str) -> tuple[str, dict | None]:
    """(path, contents) of the folder's preprocessor_config.json (None: no such file)."""
    path = os.path.join(folder, "preprocessor_config.json")
    if not os.path.exists(path):
        return path, None
    with open(path) as f:
        return path, json.load(f)


def flat_patches(x_HxWx3, patch: int, table=None) -> np.ndarray:
    """[P, C p p] the patches of a processed uint8 [H, W, 3] image, row-major, each
    flattened (C, p, p): float32 normalised by `table` ([3, 256] each channel's value of
    every uint8 level), or the uint8 levels where `table` is None (a quarter of the
    bytes; `data.inputs.pixels.decode_pixels` gives the floats)."""
    x = x_HxWx3.transpose(2, 0, 1)
    gh, gw = x.shape[1] // patch, x.shape[2] // patch
    x = x.reshape(3, gh, patch, gw, patch).transpose(1, 3, 0, 2, 4).reshape(gh * gw, -1)
    if table is None:
        return np.ascontiguousarray(x)
    return table[np.arange(x.shape[1]) // patch**2, x]


def padded_rows(tokenizer, texts, pad: str, **options) -> prompts.Rows:
    """`data.inputs.prompts.token_rows` of `texts`, left-padded with token `pad`'s id (0 where
    the tokenizer has none); `options` its own."""
    pad_id = tokenizer.token_to_id(pad)
    return prompts.token_rows(tokenizer, texts, 0 if pad_id is None else pad_id, **options)


def image_rows(tokens_BxS, valid_BxS, token_id: int, n: int, token: str) -> np.ndarray:
    """int32 [B, n] each row's positions of its `n` image tokens (`token`, id
    `token_id`); a ValueError where a prompt holds another count."""
    where = [np.flatnonzero((row == token_id) & ok) for row, ok in zip(tokens_BxS, valid_BxS)]
    if any(len(w) != n for w in where):
        raise ValueError(f"questions: expected {n} image tokens in each prompt, found "
                         f"{sorted({len(w) for w in where})} (is {token} in a question?)")  # fmt: skip
    return np.stack(where).astype(np.int32).reshape(len(where), n)


class GridEncoded(NamedTuple):
    """A batch ready for a family's `model.forward` whose image tokens are a row-major
    square (`grid_spans`), with what `spans` needs: the prompts (image tokens expanded),
    each token's character offsets [B, S, 2] (-1 at padding), the question's character
    range in each prompt [B, 2], the image tokens' grid side (0: no image); the
    picture's side in pixels and what its image tokens are, for `describe`."""

    inputs: Any
    prompts: list
    offsets_BxSx2: np.ndarray
    question_Bx2: np.ndarray
    grid: int
    image_px: int
    tokens: str  # e.g. "patches = image tokens"

    def describe(self) -> str:
        """One line for logs: the picture's size, its image tokens and the tokens."""
        g, S = self.grid, self.inputs.tokens_BxS.shape[1]
        if not g:
            return f"no image, {S} tokens"
        return f"image {self.image_px} x {self.image_px} px, {g * g} {self.tokens}, {S} tokens"


class PatchInputs(NamedTuple):
    """One batch for the `model.forward` of a family with one square image of patches per
    sequence, or none (every leaf leads with B).

    tokens_BxS: int32 token ids. pixels_BxPxF: the flattened patches (`flat_patches`; P =
    0 for questions without an image). image_BxI: int32 the LM positions of the image
    tokens, in their grid's row-major order. pos_BxS: int32 the LM's position ids
    (`models.positions.text_ids`). valid_BxS: bool, False at (left) padding, which no
    token attends to.
    """

    tokens_BxS: Any
    pixels_BxPxF: Any
    image_BxI: Any
    pos_BxS: Any
    valid_BxS: Any


def grid_inputs(rows: prompts.Rows, pixels_BxPxF, token_id: int, n: int, token: str):
    """The `PatchInputs` of token `rows` (`padded_rows`) holding `n` image tokens each
    (`image_rows`), the rotary ids each row's real tokens counted from 0."""
    tokens, valid = rows.tokens_BxS, rows.valid_BxS
    image_BxI = image_rows(tokens, valid, token_id, n, token)
    return PatchInputs(tokens, pixels_BxPxF, image_BxI, text_ids(valid), valid)


def grid_encoders(patches, encode_rows):
    """(encode, encode_text) of a family whose every image becomes one square of
    `config.n_patches` patches: `patches(image, proc.images, patch_size, codes)` one
    image's [P, F], `encode_rows(proc, pixels_BxPxF, questions, image)` the batch."""

    def encode(proc, images, questions, codes: bool = False):
        prompts.check_batch(images, questions)
        c = proc.config
        out = [patches(im, proc.images, c.patch_size, codes) for im in images]
        if any(p.shape[0] != c.n_patches for p in out):
            raise ValueError(f"images: processed to {sorted({p.shape[0] for p in out})} patches, "
                             f"the ViT reads {c.n_patches} (a {c.image_size} px square)")  # fmt: skip
        return encode_rows(proc, np.stack(out), questions, image=True)

    def encode_text(proc, questions):
        prompts.check_batch(None, questions)
        F = proc.config.patch_features
        return encode_rows(proc, np.zeros((len(questions), 0, F), np.uint8), questions, image=False)

    encode.__doc__ = (
        "Images (paths, PIL images or arrays) and one question each -> an `Encoded` batch "
        "(`codes`: its pixels as uint8 levels, `data.inputs.pixels.decode_pixels` before "
        "`model.forward`)."
    )
    encode_text.__doc__ = (
        "Questions asked without an image (`chat_prompt(image=False)`) -> an `Encoded` batch "
        "with no patches and no image tokens: the authors' text-only baseline."
    )
    return encode, encode_text


def grid_spans(enc, words, cells=(1, 1)) -> Spans:
    """The VLM interface's `Spans` of a batch whose image tokens are a row-major square
    of `enc.grid` per side (0: no image), at (0, row, col); `words` are each row's
    (first, second) object words as they appear in its question; `cells` the (rows,
    cols) of the scene grid that `cell_I` indexes (row-major)."""
    xy = prompts.word_positions(enc.prompts, enc.question_Bx2, enc.offsets_BxSx2, words)
    g = enc.grid
    r, c = np.divmod(np.arange(g * g), max(g, 1))
    question = prompts.question_mask(enc.offsets_BxSx2, enc.question_Bx2)
    S = enc.offsets_BxSx2.shape[1]
    return Spans(enc.inputs.image_BxI, np.stack([0 * r, r, c], 1).astype(np.int32),
                 ((r * cells[0] // max(g, 1)) * cells[1] + c * cells[1] // max(g, 1)).astype(np.int32),
                 xy[:, 0], xy[:, 1], question, np.full(len(xy), S - 1, np.int32))  # fmt: skip


# ---- the VLM view ------------------------------------------------------------------------


class Rendering(NamedTuple):
    """How a family makes a placed batch (inputs on the device, `Spans`): `encode(proc,
    images, questions)` and `encode_text(proc, questions)` -> its `Encoded`,
    `place(enc, words, grid)` -> (inputs, Spans); `encode_photos` photographs' encode
    where it is not `encode`'s (e.g. each squashed to one tile)."""

    encode: Callable
    encode_text: Callable
    place: Callable
    encode_photos: Callable | None = None


def spans_placed(spans, enc, words, grid):
    """`Rendering.place` of a family whose `spans(enc, words, cells=(rows, cols))` gives
    an encoded batch's `Spans`: (inputs on the device, Spans with `first_B`)."""
    return placed(enc.inputs, spans(enc, words, cells=(grid.h, grid.w)))


def rendering(module, encode_photos=None) -> Rendering:
    """The `Rendering` of a family's processor `module` with `encode(proc, images,
    questions, codes=True)` (uint8 pixel codes, decoded in the forward), `encode_text`
    and `spans(enc, words, cells)`."""
    return Rendering(functools.partial(module.encode, codes=True), module.encode_text,
                     functools.partial(spans_placed, module.spans), encode_photos)  # fmt: skip


def render_scenes(proc, rendering: Rendering, grid, size: int, specs, ask=None,
                  templates=pictures.TEMPLATES):  # fmt: skip
    """(Inputs, Spans) of `specs` drawn `size` px square and asked (`pictures.asked`);
    `ask`: the specs whose questions are asked (default `specs`'), so a twin keeps its
    example's question; `templates` their wording."""
    images, questions, words = pictures.asked(grid, specs, size, ask, templates)
    enc = rendering.encode(proc, list(images), list(questions))
    return rendering.place(enc, [tuple(w) for w in words], grid)


def render_photos(proc, rendering: Rendering, grid, images, questions, words):
    """(Inputs, Spans) of photographs (uint8 [H, W, 3]) asked `questions` (the final
    text), their object words `words` [(X, Y)], through the processor's own resize."""
    encode = rendering.encode_photos or rendering.encode
    enc = encode(proc, list(images), list(questions))
    return rendering.place(enc, [tuple(w) for w in words], grid)


def render_text(proc, rendering: Rendering, grid, questions, words):
    """(Inputs, Spans) of `questions` asked without an image (no image tokens)."""
    enc = rendering.encode_text(proc, list(questions))
    return rendering.place(enc, [tuple(w) for w in words], grid)


def pixel_decoder(field: str, table, features_per_channel: int):
    """`decode(inputs)`: a rendered batch's uint8 pixel levels in `field` normalised by
    `table` (`data.inputs.pixels.decoded`), as the model reads them."""
    return functools.partial(_decode, field, table, features_per_channel)


def patch_decoder(processor, proc, field: str = "pixels_BxPxF"):
    """`pixel_decoder` of a family's `processor` module whose (C, p, p) patches' levels
    are normalised by `processor.pixel_table(proc.images)`, p the config's patch size."""
    table = processor.pixel_table(proc.images)
    return pixel_decoder(field, table, proc.config.patch_size**2)


def _decode(field, table, features_per_channel, inputs):
    return decoded(inputs, field, table, features_per_channel)


def answer_row_forward(model_forward, config, decode, params, inputs, edits=None,
                       capture=False, resume=None):  # fmt: skip
    """(logits [B, V] at the last token, intermediates): `model_forward` at the answer
    row (`models.decoder.answer_forward`: the last block runs that row only unless the
    capture needs every row), the rendered pixels decoded first (`decode`)."""
    return answer_forward(functools.partial(model_forward, config=config), config.lm_layers,
                          params, decode(inputs), edits, capture, resume)  # fmt: skip


def resumed(forward, Resume, params, inputs, layer, start, x_BxTxD, aux):  # noqa: N803
    """The answer's logits [B, V] of a view `forward` resumed at LM block `layer` from
    rows start.. (`x_BxTxD`), the rows before from `aux`'s cache (the family's `Resume`)."""
    return forward(params, inputs, resume=Resume(layer, start, x_BxTxD, aux))[0]


def text_position_ids(params, spans: Spans):
    """[B, 3, S] 1-D rotary ids (each row's real tokens counted from 0), three equal rows
    as `Edits.lm_pos_ids` takes them."""
    return view_ids(spans.first_B, *np.shape(spans.question_BxS))


def check_drawn_size(size: int, image_size: int, others: str = "resizing") -> None:
    """A ValueError naming `size` where a drawn picture is not the ViT's `image_size`,
    the one size the processor keeps (`others`: what it does to the rest)."""
    if size != image_size:
        raise ValueError(f"size = {size}: the processor makes every picture {image_size} x "
                         f"{image_size} px (the ViT's size), {others} others; draw at size = "
                         f"{image_size}")  # fmt: skip


def check_cells(grid, side: int, what: str, cell: str) -> None:
    """A ValueError naming `grid` where its rows or columns do not divide `side`, the
    picture's `what` per side (its cells would not be whole `cell`)."""
    if side % grid.h or side % grid.w:
        raise ValueError(f"grid = {grid.h} x {grid.w}: must divide {what} (each cell whole {cell})")


def patch_square(g: int) -> dict:
    """`decoder_view`'s `vit_positions` and `image_grid` of a view whose every picture is
    one g x g patch grid: each patch's float32 (row, col), row-major, on the g x g extent."""
    rows, cols = np.divmod(np.arange(g * g), g)
    return dict(vit_positions=(rows.astype(np.float32), cols.astype(np.float32), (g, g)),
                image_grid=(1, g, g))  # fmt: skip


def refuse_video(video: bool, name: str, why: str = "") -> None:
    """A ValueError naming `video` where a family (`name`) without a video view is asked
    for one; `why` appended to the message."""
    if video:
        raise ValueError(f"video = True: the {name} family has no video view{why}")


def _const(value):
    return lambda *args: value


def decoder_view(name: str, *, config, folder: str, proc, model, rendering: Rendering,
                 grid, size: int, templates, answer_words, position_basis, vit_positions,
                 image_grid, decode=None, forward=None, forward_from=True, generates=True,
                 vit_blocks: int = 0, render=None, lm_position_ids=text_position_ids,
                 **own) -> VLMView:  # fmt: skip
    """A checkpoint family's `VLMView` (`families.vlm_view`) from what differs per family:
    `rendering` (drawn scenes, photographs and text through `proc`; `render` its own drawn
    scenes' instead), `decode` (None: inputs as they are) and `model` (`model.forward` at
    the answer row, or `forward`; `model.Resume`: `forward_from` True resumes any LM block
    from its key / value cache, False none, or the family's; `model.decoding`: `generate`
    with `folder`'s end-of-sequence ids, unless not `generates`), `answer_words` [R, 2],
    `position_basis(params)`, `vit_positions` (rows, cols, extent), `vit_blocks`,
    `lm_position_ids` (default the text's 1-D ids), `image_grid` (a tuple: every
    photograph's, `at_image_grid` this view; or `image_grid(h, w)`, the family giving
    `at_image_grid`); `own`: the other `VLMView` fields (`image_frame`, `vit_table`,
    `resume_any_layer`, ...)."""
    if forward is None:
        forward = functools.partial(answer_row_forward, model.forward, config, decode)
    if forward_from is True:
        forward_from = functools.partial(resumed, forward, model.Resume)
    one_grid = isinstance(image_grid, tuple)
    view = VLMView(
        name=name, grid=grid, n_labels=len(pictures.SHAPES), n_colours=len(pictures.COLOURS),
        render=render or functools.partial(render_scenes, proc, rendering, grid, size,
                                           templates=templates),
        forward=forward, answer_words=answer_words,
        n_lm_blocks=_const(config.lm_layers), lm_position_ids=lm_position_ids,
        vit_positions=_const(vit_positions), vit_blocks=_const(vit_blocks),
        position_basis=position_basis,
        forward_from=forward_from or None,
        cache_sites=RESUME_SITES if forward_from else (),
        resume_any_layer=bool(forward_from),
        generate=functools.partial(generate_rendered, model.decoding, config, folder,
                                   decode) if generates else None,
        render_images=functools.partial(render_photos, proc, rendering, grid),
        render_text=functools.partial(render_text, proc, rendering, grid),
        image_grid=_const(image_grid) if one_grid else image_grid,
        size=size,
    )._replace(**own)  # fmt: skip
    return one_image_grid(view) if one_grid else view
