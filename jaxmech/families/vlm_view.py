"""What a paper 003 / 004 method may ask of a VLM family: its VLM view.

The methods (`analysis.patching`, `spatial_ids`, `counterfactuals`, ...) take a
`VLMView`, one model's params and scene specs (`data.spec`); they never import a
family's own modules. A family's view:

  grid                          the cell grid its scenes live on (`data.spec.Grid`)
  n_labels, n_colours           how many object labels (1..n_labels) and colours it
                                  can draw and name
  render(specs, ask=None) -> (inputs, spans)
                                the specs drawn as the family's inputs (a pytree whose
                                  leaves lead with B; pixels and a tokenizer for a real
                                  family) and where each part landed (`Spans`); `ask`:
                                  the specs whose questions are asked (default specs'
                                  own), so a twin keeps its example's question
  forward(params, inputs, edits=None, capture=False) -> (logits_BxV, aux)
                                logits at each scene's answer position and the named
                                  intermediates (`sites` below), whole with `capture`
                                  (without it a family may compute only what the
                                  logits need: the toy's last block, the answer row)
  answer_words [3, 2]           token ids of each relation's (first, second) answer word
                                  (relation ids as `data.spec`: 0 h, 1 v, 2 presence);
                                  a checkpoint's [5, 2] adds photographs' 3 on / under
                                  and 4 front / behind (`relation_words` says whether
                                  they can be read)
  n_lm_blocks(params)           the LM's blocks
  lm_position_ids(params, spans) -> [3, S] or [B, 3, S]
                                the LM's (t, row, col) position ids, as `Edits.lm_pos_ids`
                                  takes them (per row where rows are left-padded)
  vit_positions(params) -> (rows_P, cols_P, (h, w))
                                the (row, col) each ViT token sees and the extent of
                                  those positions, as `Edits.vit_rows / vit_cols` take
                                  them (004's mirrors are h - 1 - row, w - 1 - col)
  vit_blocks(params) -> int     blocks whose rotary positions can be set one at a time
                                  (0: positions enter once, at the ViT's input)
  vit_table                     bool (default False): a rotary ViT whose positions also
                                  enter once, through a learned table read at the ViT's
                                  input (Qwen3-VL); its per-block position edits are then
                                  [1 + vit_blocks, P], row 0 the table's
  position_basis(params) -> [I, F]
                                the ViT's position features of each image token (the
                                  basis of the spatial IDs' rank-k fits)
  forward_from(params, inputs, layer, start, x_BxTxD, aux) -> logits_BxV
                                optional (None: not offered): the answer's logits of a
                                  run resumed at LM block `layer` from the residual of
                                  rows start..S-1 (ints, static; `layer` traced too
                                  where `resume_any_layer`), the rows before read
                                  from a run whose intermediates `aux` hold the sites
                                  `cache_sites` (a causal LM's key / value cache); a
                                  patch then costs only the rows and blocks after it
  generate(params, inputs, *, max_new_tokens, edits=None, logits=False, model=None)
                                optional (None: not offered): greedy replies to rendered
                                  `inputs` (a `models.generate.Generation`), `edits` on
                                  the prompt's forward only, `model` an index into
                                  params stacked over models; a checkpoint's is
                                  `generate_rendered` bound to its family's `decoding`
  render_images(images, questions, words) -> (inputs, spans)
                                optional (None: drawn scenes only): photographs (uint8
                                  [H, W, 3] arrays of one `image_grid`) asked `questions`
                                  (the final text) whose object words are `words` [(X, Y)]
                                  through the checkpoint's own processor (its resize);
                                  `cell_I` on `grid`, as a drawn scene's
  render_text(questions, words) -> (inputs, spans)
                                optional: the questions asked without an image (no
                                  image tokens), the authors' text-only baseline
  image_grid(height, width) -> tuple
                                the processed grid a photograph of that size becomes; one
                                  compiled call holds photographs of one grid
  at_image_grid(grid) -> VLMView
                                the view whose `vit_positions` / `position_basis` are
                                  those of processed grid `grid` (a photograph bucket's)
  size                          int or None: the pixels a drawn scene's side is drawn at
                                  (a checkpoint's; None: a toy's cells are tokens)
  image_frame(height, width) -> (top, left, h, w)
                                optional (None: the whole photograph, resized): the
                                  region of a height x width photograph, in its own
                                  pixels, that the processed image shows (a centre crop
                                  cuts it; a pad to a square reaches past it), so boxes
                                  map onto the cells through it

Sites, in TransformerLens's words for every family: `lm/resid_pre.{i}`,
`lm/resid_post.{i}`, `lm/attn_out.{i}`, `lm/v.{i}`, `lm/pattern.{i}` (`[B, H, S, S]`),
`vit/...` likewise and the projector's output (`proj/out` or `merger/out`). The
edits a method hands to `forward` are one `models.edits.Edits`: replace / add at a
site, the ViT's positions, the LM's position ids, the image tokens' order.

Axis names (`jaxmech.shapes`): B scenes, S LM tokens, I image tokens, P ViT tokens,
V vocabulary.
"""

from __future__ import annotations

import types
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.data.spec import PRESENCE, Grid, SceneSpec, first_word
from jaxmech.models import generate as gen


class Spans(NamedTuple):
    """Where the parts of B rendered scenes sit in the LM's sequence (int32 arrays; one
    image size per batch, so every row has the same image tokens).

    image_BxI: the LM positions of the image tokens. image_trc_Ix3: each image token's
    (t, row, col) in the token grid. cell_I: the spec cell each image token lies in.
    x_B, y_B: the position of the last sub-token of the first- and second-named object
    words (the authors read the last sub-token). question_BxS: bool, the question's
    tokens (not the image, not a template). answer_B: the position whose logits answer.
    first_B: each row's first real token where rows are left-padded (None: none are).
    """

    image_BxI: Any
    image_trc_Ix3: Any
    cell_I: Any
    x_B: Any
    y_B: Any
    question_BxS: Any
    answer_B: Any
    first_B: Any = None

    @property
    def length(self) -> int:
        """S, the LM sequence's length."""
        return self.question_BxS.shape[1]


class VLMView(NamedTuple):
    """One VLM family's view (module docstring)."""

    name: str
    grid: Grid
    n_labels: int
    n_colours: int
    render: Callable
    forward: Callable
    answer_words: Any
    n_lm_blocks: Callable
    lm_position_ids: Callable
    vit_positions: Callable
    vit_blocks: Callable
    position_basis: Callable
    forward_from: Callable | None = None
    cache_sites: tuple = ()
    render_images: Callable | None = None
    render_text: Callable | None = None
    image_grid: Callable | None = None
    at_image_grid: Callable | None = None
    image_frame: Callable | None = None
    vit_table: bool = False
    size: int | None = None
    resume_any_layer: bool = False  # forward_from takes a traced layer (models.decoder.Resume)
    # a video view: seconds per drawn frame, and its scenes rendered asked given questions
    # ((specs, ask=None, *, questions) -> (Inputs, Spans)); None: pictures, or fixed wording
    video_clock: float | None = None
    render_asked: Callable | None = None
    generate: Callable | None = None


def placed(inputs, spans: Spans):
    """(inputs on the device, `spans` with `first_B`, each row's first real token) of a
    rendered batch of left-padded rows (`inputs.valid_BxS`): what a checkpoint view's
    `render` / `render_images` / `render_text` return. Placed now so the host's copy is
    freed: a report holds its rendered inputs once."""
    first = np.argmax(np.asarray(inputs.valid_BxS), 1).astype(np.int32)
    return jax.device_put(inputs), spans._replace(first_B=first)


def generate_rendered(decoding, config, folder: str, decode, params, inputs, *,
                      max_new_tokens: int, edits=None, logits: bool = False,
                      model: int | None = None):  # fmt: skip
    """Greedy replies (`models.generate.generate`: a `Generation`, the folder's
    end-of-sequence and pad ids) to a view's rendered batch `inputs`, `decode(inputs)`
    first (its uint8 pixel codes to the model's pixels, as the view's forward does);
    `edits` act on the prompt's forward only (the authors' steering hooks); `logits`:
    each step's logits too; `model`: an index into params stacked over models (read
    inside the compiled calls, `models.generate.generate`). A checkpoint view's
    `generate`, bound to the family's `decoding`, config, folder and decode."""
    encoded = types.SimpleNamespace(inputs=decode(inputs))  # what `generate` reads of one
    return gen.generate(decoding, config, params, encoded, max_new_tokens=max_new_tokens,
                        edits=edits, logits=logits, folder=folder, model=model)  # fmt: skip


def with_reply(inputs, tokens_BxN):
    """A checkpoint view's rendered batch `inputs` (rows left-padded) with tokens_BxN
    appended to every row: real tokens whose position ids continue as generation places
    them (`models.generate.continued_ids`: new token k at the prompt's largest id + 1 +
    k, on every row of M-RoPE's three). A forward on it computes at each prompt and new
    row what the cached generation of those tokens computed there (rows are causal), so
    the states of a reply can be read. Raises ValueError naming `inputs` where it has no
    position ids (`pos_BxS` / `pos_Bx3xS`)."""
    name = next((f for f in ("pos_Bx3xS", "pos_BxS") if f in getattr(inputs, "_fields", ())), None)
    if name is None:
        raise ValueError(f"inputs: expected a checkpoint view's rendered batch with pos_BxS or "
                         f"pos_Bx3xS, got {type(inputs).__name__}")  # fmt: skip
    new = jnp.asarray(tokens_BxN, jnp.int32)
    if new.shape[1] == 0:
        return inputs
    pos = jnp.asarray(getattr(inputs, name))
    ids = jnp.stack([gen.continued_ids(pos, k) for k in range(new.shape[1])], -1)  # [B, N]
    ids = ids[:, None].repeat(3, 1) if pos.ndim == 3 else ids
    return inputs._replace(**{
        "tokens_BxS": jnp.concatenate([jnp.asarray(inputs.tokens_BxS), new], 1),
        "valid_BxS": jnp.concatenate([jnp.asarray(inputs.valid_BxS, bool),
                                      jnp.ones(new.shape, bool)], 1),
        name: jnp.concatenate([pos, ids.astype(pos.dtype)], -1),
    })  # fmt: skip


def one_image_grid(view: VLMView) -> VLMView:
    """`view` as every photograph bucket's (`at_image_grid` gives it back): a family
    whose photographs all become one processed grid (the ViT's one size)."""
    return view._replace(at_image_grid=lambda grid: one_image_grid(view))


OUTLINE_ELEMENTS = 2**20  # leaves this large stand in as shapes in `model_outline`


def model_outline(params_K, k: int = 0):
    """Model k of stacked params [K, ...] for a view's questions about a model's shape
    and switches (`n_lm_blocks`, `vit_positions`, `vit_blocks`, `lm_position_ids`, ...,
    or lowering a program): leaves under OUTLINE_ELEMENTS sliced, larger ones as
    `jax.ShapeDtypeStruct`s, so a real checkpoint's weights are not copied (an eager
    slice copies: 4.1 GB more for Qwen2-VL-2B). A toy's params are all small: whole."""

    def one(x):
        if x.size // x.shape[0] >= OUTLINE_ELEMENTS:
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        return x[k]

    return jax.tree_util.tree_map(one, params_K)


def over_models(fn, models_K):
    """`fn(model)` for every model of a stack (a pytree whose leaves lead with K), in a
    `lax.map` (one at a time), stacked [K, ...]. Under jit. One model (a checkpoint) is
    not mapped: a scan slices each model's weights into its loop, a copy of them all
    (4.1 GB more for Qwen2-VL-2B), where a size-1 axis taken off is free."""
    if jax.tree_util.tree_leaves(models_K)[0].shape[0] == 1:
        out = fn(jax.tree_util.tree_map(lambda x: x[0], models_K))
        return jax.tree_util.tree_map(lambda x: x[None], out)
    return jax.lax.map(fn, models_K)


def resid_site(site: int, n_blocks: int) -> str:
    """The LM's residual stream at site `site` in 0..n_blocks: entering block `site`, or
    the last block's output for site = n_blocks."""
    if not 0 <= site <= n_blocks:
        raise ValueError(f"site = {site}: expected an LM site in [0, {n_blocks}]")
    return f"lm/resid_pre.{site}" if site < n_blocks else f"lm/resid_post.{n_blocks - 1}"


def answer_ids(view: VLMView, specs: SceneSpec) -> tuple[jax.Array, jax.Array]:
    """([B] the answer word's id, [B] the other word of its relation) of each scene.

    A question naming X where X is not drawn (cell -1: the toy's absent-label rows) is
    answered "no" whatever its relation, as the toy renders it (`data.tasks.scenes.render`),
    against "yes": its side has no answer, and a left / right margin there would read
    a word the model was never taught for it."""
    words = jnp.asarray(view.answer_words)[jnp.asarray(specs.relation_B)]
    first = jnp.asarray(first_word(view.grid, specs))
    answer = jnp.where(first, words[:, 0], words[:, 1])
    other = jnp.where(first, words[:, 1], words[:, 0])
    absent = jnp.asarray(specs.cells_BxK)[:, 0] < 0
    yes, no = (jnp.asarray(view.answer_words)[PRESENCE, i] for i in (0, 1))
    return jnp.where(absent, no, answer), jnp.where(absent, yes, other)


def relation_words(view: VLMView, relation: int):
    """(first, second) token ids of relation `relation`'s answer words, or (None, why)
    where they cannot be read: the view has no row for it (a toy's or a video's
    answer words stop at presence) or both words begin with the same token (a tokenizer
    without them, e.g. the fixtures' word-level ones reading both as [UNK]: a margin
    between them is 0 whatever the model says). Left / right and above / below are
    refused when the view is built instead (`data.inputs.prompts.answer_ids`): every table
    needs them, where a photograph's relations are asked only of datasets that have
    them."""
    words = np.asarray(view.answer_words)
    if not 0 <= relation < len(words):
        return None, f"relation {relation}: {view.name}'s view has no answer words for it"
    first, second = (int(w) for w in words[relation])
    if first == second:
        return None, (f"relation {relation}: both answer words begin with token {first} in "
                      f"{view.name}'s tokenizer, so their margin cannot tell them apart")  # fmt: skip
    return first, second


def rows_at(x_BxSx, pos_B) -> jax.Array:
    """[B, ...] row b of `x` at position pos_B[b]."""
    return x_BxSx[jnp.arange(x_BxSx.shape[0]), jnp.asarray(pos_B)]


def cell_tokens(spans: Spans, cell_N) -> jax.Array:
    """[N, T] the LM positions of every image token in each example's cell cell_N[n]
    (row n of `spans`; T the tokens per cell, in the image's order). Every one, not the
    first: at 448 px a Qwen cell is 4 x 4 merged tokens and its first (top-left) is
    mostly background, so a reader averages over them (`spatial_ids.at_two_positions`).
    Raises ValueError where the cells hold different numbers of tokens."""
    index = cell_token_index(spans.cell_I)[jnp.asarray(cell_N)]  # [N, T]
    return jnp.take_along_axis(jnp.asarray(spans.image_BxI), index, 1)


def cell_token_index(cell_I) -> np.ndarray:
    """[L, T] the indices into the image tokens of each cell's T tokens (host NumPy)."""
    cell_I = np.asarray(cell_I)
    counts = np.bincount(cell_I)
    if (counts != counts[0]).any():
        raise ValueError(f"cells hold {sorted(set(counts.tolist()))} image tokens: expected "
                         "the same number in every cell")  # fmt: skip
    return np.argsort(cell_I, kind="stable").reshape(len(counts), counts[0])


class Examples(NamedTuple):
    """Scene specs rendered by a family, with each scene's answer word and the other word
    of its relation [B] (`answer_ids`)."""

    spec: SceneSpec
    inputs: Any
    spans: Spans
    answer_B: jax.Array
    other_B: jax.Array


def examples(view: VLMView, spec: SceneSpec) -> Examples:
    """`spec` rendered by the view, with its answer words."""
    inputs, spans = view.render(spec)
    return Examples(spec, inputs, spans, *answer_ids(view, spec))


def margin(logits_BxV, answer_B, other_B) -> jax.Array:
    """[B] logit(answer) - logit(the other word of its relation): > 0 answers right."""
    return rows_at(logits_BxV, answer_B) - rows_at(logits_BxV, other_B)
