"""A Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint's VLM view (`families.vlm_view`): scene
specs drawn as pictures (`data.inputs.pictures`), asked in the papers' wording through the
checkpoint's own processor, and its forward, sites and positions.

One picture size per view (`size`, default 448: 32 x 32 patches, 16 x 16 merged
tokens). It must be a size the processor keeps as it is (no resize, so each merged
token covers one cell's pixels only) and a multiple of 28 x the grid (each cell whole
merged tokens; Qwen3-VL's patches are 16 px: 32 x the grid, e.g. 512 for 4 x 4 cells);
the view refuses others by name.

Qwen3-VL: its ViT reads positions twice, from a learned table at its input and by
rotary in every block, so its position edits are [1 + blocks, P] (`vit_table`; the
counterfactual table mirrors each mechanism alone and both); its resumed runs
(`forward_from`) before a DeepStack injection rerun the rows before `start`.

Answer words (`answer_words`): the first token of "Left" / "Right", "Above" / "Below",
"Yes" / "No" in the checkpoint's tokenizer, capitalised and without a leading space:
the answer starts the assistant's turn on a new line, where a chat model writes a
capitalised word. The first token only (not a sum over spellings). The papers' authors'
wording (`checkpoint_view(wording="authors")`) asks 'Answer "left" or "right" only.'
and reads "left" / "right" (`pictures.AUTHORS_ANSWERS`), as their Qwen scripts do.

The LM's position ids (`lm_position_ids`) are the M-RoPE ids the processor made: text
ids count from each row's first real token, the image tokens' (row, col) ids are offset
by the image's start (`positions.mrope_ids`).

`generate`: greedy replies to a rendered batch (`vlm_view.generate_rendered`, the
folder's end-of-sequence ids), what the authors' steering judges.

A video view (`checkpoint_view(..., video=True)`) draws each scene as a video whose
frame f is the scene's grid row f (`pictures.draw_video`, as the toy's video task reads
its grid), each frame one temporal patch, and asks relation 1 as time ("Does the red
circle appear before or after the blue square?", answers "Before" / "After"): the seed
003 temporal-ID report's input.

Axis names (`jaxmech.shapes`): B scenes, S LM tokens, P patches, I merged image tokens.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxmech.data.inputs import pictures, prompts
from jaxmech.data.spec import Grid, SceneSpec
from jaxmech.families import hf_vlm
from jaxmech.families.qwen2_vl import model, positions, processor
from jaxmech.families.qwen2_vl.config import QwenVLConfig
from jaxmech.families.vlm_view import VLMView

VIDEO_FPS = 2.0  # a rendered video's frame rate: each scene frame shown for one second
GRID = Grid(4, 4)  # the default scene grid: 448 px = 4 cells of 4 x 4 merged tokens
RENDERING = hf_vlm.rendering(processor)


def check_size(proc: processor.Processor, grid: Grid, size: int, video: bool = False) -> None:
    """Refuses (ValueError naming `size`) a picture (or video frame) size the processor
    would resize, or whose cells are not whole merged tokens."""
    s = proc.videos if video else proc.images
    unit = s.patch_size * s.merge_size
    rows = 1 if video else grid.h  # a video frame is one row of cells
    if size % (unit * grid.w) or size % (unit * rows):
        raise ValueError(
            f"size = {size}: must be a multiple of {unit} x the grid's {rows} x {grid.w} "
            "(each cell whole merged tokens)"
        )
    if video and s.frames_in_budget:  # each scene row one frame, over a temporal patch
        kept = processor.video_smart_resize(grid.h * s.temporal_patch_size, size, size, s)
    else:
        kept = processor.smart_resize(size, size, unit, s.min_pixels, s.max_pixels)
    if kept != (size, size):
        what = "video processor" if video else "processor"
        raise ValueError(
            f"size = {size}: the {what} would resize it to {kept[0]} x {kept[1]} "
            f"(min_pixels {s.min_pixels}, max_pixels {s.max_pixels}); pick a size it keeps"
        )


def render(proc: processor.Processor, grid: Grid, size: int, specs: SceneSpec, ask=None,
           video: bool = False, templates=pictures.TEMPLATES, questions=None):  # fmt: skip
    """(Inputs, Spans) of `specs` drawn and asked (`hf_vlm.render_scenes`); `video`: drawn
    as videos (`pictures.draw_video`), each frame repeated over the temporal patch so
    that each scene frame is one temporal patch, at `VIDEO_FPS`, asked about time (or
    `questions`, one per scene: `VLMView.render_asked`)."""
    if not video:
        return hf_vlm.render_scenes(proc, RENDERING, grid, size, specs, ask, templates)
    ask = specs if ask is None else ask
    frames = np.repeat(pictures.draw_video(grid, specs, size), proc.videos.temporal_patch_size, 1)
    asked = pictures.questions(ask, pictures.VIDEO_TEMPLATES) if questions is None else questions
    enc = processor.encode_video(proc, list(frames), asked, VIDEO_FPS, codes=True)
    words = [(x, y or x) for x, y in pictures.object_names(ask)]  # presence names X only
    return RENDERING.place(enc, words, grid)


def image_grid(proc: processor.Processor, height: int, width: int) -> tuple:
    """(1, h, w) the patch grid a height x width photograph is resized to."""
    s = proc.images
    h, w = processor.smart_resize(height, width, s.patch_size * s.merge_size, s.min_pixels,
                                  s.max_pixels)  # fmt: skip
    return (1, h // s.patch_size, w // s.patch_size)


def forward_from(config: QwenVLConfig, forward, params, inputs, layer, start, x_BxTxD, aux):
    """The answer's logits [B, V] of a run resumed at LM block `layer` (`model.Resume`).
    Before a DeepStack injection (Qwen3-VL, layer < len(vit_deepstack)) the rows before
    `start` are not taken from `aux`'s cache: the later blocks add these inputs'
    DeepStack features at the image tokens, which `aux`'s run (a twin's) may not have
    had; they are rerun from `aux`'s `lm/resid_pre.{layer}` instead, with the ViT."""
    if config.vit_deepstack and start and layer < len(config.vit_deepstack):  # layer static
        name = f"lm/resid_pre.{layer}"
        if name not in aux:
            raise ValueError(f"aux: lacks {name!r}, which a run resumed before a DeepStack "
                             "injection reads (capture it)")  # fmt: skip
        x_BxTxD = jnp.concatenate([aux[name][:, :start].astype(x_BxTxD.dtype), x_BxTxD], 1)
        start = 0
    return hf_vlm.resumed(forward, model.Resume, params, inputs, layer, start, x_BxTxD, aux)


def lm_position_ids(config: QwenVLConfig, spans, interval: float = 1.0,
                    per_frame: bool = False) -> np.ndarray:  # fmt: skip
    """[B, 3, S] the M-RoPE ids of rendered scenes, from their spans (module docstring);
    `interval`: a video's time ids per frame (`positions.mrope_ids`); `per_frame`: each
    frame its own block of tokens with an image's ids (Qwen3-VL's timestamped videos),
    the text between them counting on."""
    image, trc = np.asarray(spans.image_BxI), np.asarray(spans.image_trc_Ix3)
    B, S = np.asarray(spans.question_BxS).shape
    first = np.zeros(B, np.int64) if spans.first_B is None else np.asarray(spans.first_B)
    out = np.zeros((B, 3, S), np.int64)
    extent = int(trc[:, 1:].max()) + 1
    t = np.zeros(len(trc)) if per_frame else np.floor(trc[:, 0] * interval)
    runs = [np.arange(len(trc))]  # the image tokens' blocks: one, or one per frame
    if per_frame:
        runs = np.split(runs[0], np.flatnonzero(np.diff(trc[:, 0])) + 1)
    for b in range(B):
        pos, next_id = first[b], 0
        for run in runs:
            s0, s1 = int(image[b, run[0]]), int(image[b, run[-1]]) + 1
            out[b, :, pos:s0] = next_id + np.arange(s0 - pos)
            next_id += s0 - pos
            out[b, :, s0:s1] = next_id + np.stack([t[run], trc[run, 1], trc[run, 2]])
            next_id, pos = next_id + extent, s1
        out[b, :, pos:] = next_id + np.arange(S - pos)
    return out.astype(np.int32)


def vit_positions(grid_thw, merge: int):
    """(rows [P], cols [P], (h, w)): each patch's rotary position and the patch grid."""
    rows, cols, _ = positions.patch_grid(grid_thw, merge)
    return rows, cols, (grid_thw[1], grid_thw[2])


def position_basis(config: QwenVLConfig, grid_thw) -> jnp.ndarray:
    """[I, F] each merged token's ViT position features: cos / sin of every rotary angle
    of its merge_size^2 patches, side by side; with a position table (Qwen3-VL), then
    the weight its patches give each of the table's n x n cells (summed), the table's
    rows being the codes those weights mix (params-free: a checkpoint's table is not
    read here)."""
    rows, cols, _ = positions.patch_grid(grid_thw, config.merge_size)
    freq = positions.inv_freq(config.vit_head_dim // 2, config.vit_rope_theta)
    angles = positions.vit_angles(jnp.asarray(rows)[None], jnp.asarray(cols)[None], freq)[0]
    feats = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=1)
    unit = config.merge_size**2
    feats = feats.reshape(feats.shape[0] // unit, -1)
    if not config.vit_pos_table:
        return feats
    extent = jnp.asarray([grid_thw[1:]])
    index, weight = positions.table_taps(rows[None], cols[None], extent, config.vit_pos_side)
    cells = (
        jnp.zeros((len(rows), config.vit_pos_table))
        .at[jnp.arange(len(rows))[:, None], index[0]]
        .add(weight[0])
    )
    return jnp.concatenate([feats, cells.reshape(-1, unit, cells.shape[1]).sum(1)], 1)


DEFAULT_SIZE = 448  # pixels: the papers' Qwen2-VL pictures (16 x 16 merged tokens)


def default_size(proc: processor.Processor, grid: Grid, video: bool = False) -> int:
    """The smallest size >= DEFAULT_SIZE whose cells are whole merged tokens: 448 for
    14 px patches (28 px tokens) on a 4 x 4 grid, 512 for Qwen3-VL's 16 px patches."""
    s = proc.videos if video else proc.images
    unit = s.patch_size * s.merge_size * int(np.lcm(1 if video else grid.h, grid.w))
    return -(-DEFAULT_SIZE // unit) * unit


def checkpoint_view(folder: str, config: QwenVLConfig, grid: Grid = GRID, size: int | None = None,
                    video: bool = False, wording: str = "jaxmech") -> VLMView:  # fmt: skip
    """The view of the checkpoint in `folder` (its tokenizer and image settings), with
    scenes on `grid` drawn `size` pixels square (None: `default_size`); `video`: as videos of grid.h frames
    (`render`), relation 1 asking about time (`pictures.VIDEO_ANSWERS`). `wording`
    "authors": pictures asked in the papers' authors' words (`pictures.wording`); videos
    keep jaxmech's. Raises ValueError naming `size`, `wording` or the tokenizer before
    any compute."""
    templates, answers = pictures.wording(wording)
    if video:
        templates, answers = pictures.TEMPLATES, pictures.VIDEO_ANSWERS
    # their transformers (4.53) loads the slow Qwen2VLImageProcessor: Pillow's resize
    pil = wording == "authors" and not video
    proc = processor.load_processor(folder, config, **({"resize": "pil"} if pil else {}))
    size = default_size(proc, grid, video) if size is None else size
    check_size(proc, grid, size, video)
    p = size // config.patch_size
    interval = processor.time_interval(proc, VIDEO_FPS) if video else 1.0
    table = processor.pixel_table(proc.videos if video else proc.images)
    parts = dict(proc=proc, config=config, grid=grid, folder=folder, video=video,
                 words=prompts.answer_ids(proc.tokenizer, answers), interval=interval,
                 render=functools.partial(render, proc, grid, size, video=video,
                                          templates=templates),
                 decode=hf_vlm.pixel_decoder("pixels_BxPxF", table, config.patch_features // 3))  # fmt: skip
    view = _view((grid.h if video else 1, p, p), parts)._replace(size=size)
    if not video:
        return view
    return view._replace(video_clock=proc.videos.temporal_patch_size / VIDEO_FPS,
                         render_asked=functools.partial(render, proc, grid, size, video=True))  # fmt: skip


def _view(grid_thw, parts) -> VLMView:
    """The view whose ViT positions are those of patch grid `grid_thw` (its drawn
    scenes', or a photograph bucket's: `at_image_grid`; `size` only on the first)."""
    config, proc, video = parts["config"], parts["proc"], parts["video"]
    forward = functools.partial(hf_vlm.answer_row_forward, model.forward, config, parts["decode"])
    view = hf_vlm.decoder_view(
        config.variant, config=config, folder=parts["folder"], proc=proc, model=model,
        rendering=RENDERING, grid=parts["grid"], size=None, templates=None,
        render=parts["render"], decode=parts["decode"], forward=forward,
        forward_from=functools.partial(forward_from, config, forward), answer_words=parts["words"],
        lm_position_ids=lambda params, spans: lm_position_ids(
            config, spans, parts["interval"], video and config.video_timestamps),
        vit_positions=vit_positions(grid_thw, config.merge_size),
        vit_blocks=config.vit_depth,
        position_basis=lambda params: position_basis(config, grid_thw),
        image_grid=functools.partial(image_grid, proc),
        at_image_grid=lambda thw: _view(tuple(thw), parts),
        vit_table=bool(config.vit_pos_table),
        resume_any_layer=not config.vit_deepstack,  # a DeepStack layer reruns its rows
    )  # fmt: skip
    return view._replace(render_images=None) if video else view
