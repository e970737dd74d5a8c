"""What every Hugging Face VLM checkpoint family (each registered in `families.registry`)
has in the same shape, so that a new family writes only what differs:
its config.json parsing and refusals, its key map, its vision tower and projector, its
positions, its image geometry and its chat template.

* `checkpoint_family`: the `CheckpointFamily` record from a family's modules (`load`,
  `params`, `checks`, `model`, `processor`) and what is its own (describe, trainable,
  windows, ...); the fields every family fills alike are filled here.
* `PatchGeometry`, `lm_fields`, `lm_layout`: a config's derived patch sizes, the
  Llama-layout LM's config fields read from a `text_config`, its `LMLayout`.
* `loaders`, `HUB_PREFIXES` / `PROJ_LM_PREFIXES`, `clip_block_map`,
  `clip_block_shapes`: a family's `read_config` / `load_checkpoint` (`models.hub`), the
  stored-name prefixes of the `vision_tower` / `multi_modal_projector` /
  `language_model` layout, the CLIP / SigLIP ViT block's key map and shapes.
* `text_decoding`: what greedy generation needs of an LM with one rotary id per token.
* `lm_site_names`, `check_patches`, `check_edits`: the ViT-then-LM site list, the
  patches' shape check and the outline of a family's edit checks (`models.checks`).
* `with_resize`, `padded_rows`, `image_rows`, `grid_spans`: a processor's resize
  backend, its prompts' token rows, where their image tokens are, and the `Spans` of a
  square grid of image tokens.
* `Rendering`, `decoder_view`: a family's `VLMView` from what differs (how it encodes
  and places a batch, its pixels' decoding, forward, positions, image geometry); the
  rest (drawn scenes, photographs and text asked, the answer-row forward, resumed runs,
  greedy replies, the text's rotary ids) is filled here alike.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np

from jaxmech.data.inputs import pictures, prompts
from jaxmech.data.inputs.pixels import decoded
from jaxmech.data.inputs.resize import BACKENDS
from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily, contract_forward
from jaxmech.families.vlm_view import Spans, VLMView, generate_rendered, one_image_grid, placed
from jaxmech.models import checks, hub, layout
from jaxmech.models.checks import shape
from jaxmech.models.decoder import (
    POINTS,
    RESUME_SITES,
    UNROTATED_POINTS,
    answer_forward,
    block_sites,
    next_token_logprobs,
)
from jaxmech.models.generate import Decoding, continued_ids, generate
from jaxmech.models.hf_config import get
from jaxmech.models.hub import T, heads_bias, heads_in, heads_out, same
from jaxmech.models.layout import authors_vit_mlp
from jaxmech.models.positions import rotary_angles, view_ids

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
    `processor.load_processor` and `processor.encode` (or `encode`); `own`: the rest of
    the contract's fields (`stand_in`, `authors_windows`, `authors_wordings`)."""
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
        **own,
    )


# ---- configs ---------------------------------------------------------------------------


class PatchGeometry:
    """The derived sizes of a config with `image_size`, `patch_size`, `vit_in_chans`,
    `vit_width` and `vit_heads` fields (a mixin of the families' frozen dataclasses: it
    adds no field)."""

    @property
    def grid(self) -> int:
        """Patches per side of the ViT's square input."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        """P, the ViT's patches (a CLS token not counted)."""
        return self.grid**2

    @property
    def vit_head_dim(self) -> int:
        return self.vit_width // self.vit_heads

    @property
    def patch_features(self) -> int:
        """One flattened patch's length: C x patch x patch, channel first."""
        return self.vit_in_chans * self.patch_size**2


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


def clip_block_map(c, i: int) -> dict:
    """The key map of CLIP / SigLIP ViT block i (`vision.encoder.layers.{i}.`: two
    LayerNorms, q / k / v / out projections with biases, fc1 / fc2) to `vit/block_{i}/`."""
    E, H, Dh, M = c.vit_width, c.vit_heads, c.vit_head_dim, c.vit_mlp
    b, out = f"vision.encoder.layers.{i}.", f"vit/block_{i}/"
    m = {}
    for hf, ours in (("layer_norm1", "ln1"), ("layer_norm2", "ln2")):
        m |= {b + f"{hf}.weight": (out + f"{ours}_w", (E,), same),
              b + f"{hf}.bias": (out + f"{ours}_b", (E,), same)}  # fmt: skip
    for w in "qkv":
        m[b + f"self_attn.{w}_proj.weight"] = (out + f"W_{w.upper()}", (E, E), heads_in(H, Dh))
        m[b + f"self_attn.{w}_proj.bias"] = (out + f"b_{w.upper()}", (E,), heads_bias(H, Dh))
    m |= {b + "self_attn.out_proj.weight": (out + "W_O", (E, E), heads_out(H, Dh)),
          b + "self_attn.out_proj.bias": (out + "b_O", (E,), same),
          b + "mlp.fc1.weight": (out + "W_in", (M, E), T), b + "mlp.fc1.bias": (out + "b_in", (M,), same),
          b + "mlp.fc2.weight": (out + "W_out", (E, M), T), b + "mlp.fc2.bias": (out + "b_out", (E,), same)}  # fmt: skip
    return m


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


def lm_layout(c, vocab: int | None = None, **switches) -> layout.LMLayout:
    """The LM's `models.layout.LMLayout` from a config's `lm_*` fields (`vocab`: the
    embedding's rows where they are not `lm_vocab`); `switches`: its biases and norms."""
    return layout.LMLayout(c.lm_width, c.lm_heads, c.lm_kv_heads, c.lm_head_dim, c.lm_mlp,
                           c.lm_layers, c.lm_vocab if vocab is None else vocab,
                           c.tie_embeddings, **switches)  # fmt: skip


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
