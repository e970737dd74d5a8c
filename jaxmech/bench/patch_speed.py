"""Speed of paper 003's patching table on a checkpoint family's random stand-in: one
compiled call against the one-forward-per-condition loop of the authors' code.

The config: the family's `stand_in.configs[kind]` (`families.contract.StandIn`; for
Qwen2-VL "bench" is its layout with random weights, LM width 512, 8 layers, the real
151936-word vocabulary, a 4-block ViT of width 256, 224 x 224 pictures; "real" is
Qwen2-VL-2B's size at 448 px), pictures of a 4 x 4 grid. The tokenizer is a word-level
one over the prompts' words, so sequences are a little shorter than under a real BPE.

The table: every LM layer x 4 token groups (image, question, objects, last) x the
images, mirror twin. Both sides compute the same patches and log-probabilities:

* batched: `analysis.patching.patch_table` (`patch_logp`) over every image, layer and
  group, `batch` images per compiled call (the clean and twin runs once; each patch
  runs only the blocks and rows after those it shares with them);
* loop: per image a clean and a twin forward (capturing every layer), then per (layer,
  group) one jitted full forward of that one image with the patch, as the authors' code
  does minus its process start per layer. Timed on `loop_images` images and quoted per
  cell.

Both are compiled before timing, then timed in turns (table, loop, table, loop, ...) in
this process, so each ratio compares them in the same minute; medians of `repeats`.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis.patching import (
    GROUPS,
    chunk_args,
    patch_table,
    table_call_for,
    token_groups,
)
from jaxmech.data.spec import Grid, pair_questions
from jaxmech.families.registry import stand_in_family
from jaxmech.families.vlm_view import examples
from jaxmech.models.edits import Edits

TABLE_GROUPS = ("image", "question", "objects", "last")


def _loop_calls(view, layers):
    """The loop's jitted calls: a forward capturing every patched site, and per site one
    full forward with a patch."""
    names = [f"lm/resid_pre.{y}" for y in layers]
    capture = jax.jit(lambda p, x: view.forward(p, x, capture=names))

    def patched_logp(p, x, v, m, a, n):
        logits = view.forward(p, x, Edits(replace={n: (m[:, :, None], v)}))[0]
        return jax.nn.log_softmax(logits[0])[a]

    patched = {n: jax.jit(functools.partial(patched_logp, n=n)) for n in names}
    return capture, patched


def _loop(calls, params, ex, twin, groups, images):
    """The authors' loop over `images`: clean and twin forwards with capture, then one
    jitted full forward per (layer, group) with the patch; returns its log p [Y, G, b]."""
    capture, patched = calls
    one = lambda tree, b: jax.tree_util.tree_map(lambda a: a[b : b + 1], tree)  # noqa: E731
    out = np.zeros((len(patched), len(groups), len(images)))
    for j, b in enumerate(images):
        x, t = one(ex.inputs, b), one(twin, b)
        capture(params, x)  # the clean run (its answer)
        _, aux = capture(params, t)
        for y, (n, f) in enumerate(patched.items()):
            for g in range(len(groups)):
                mask = jnp.asarray(groups[g, b : b + 1])
                out[y, g, j] = float(f(params, x, aux[n], mask, ex.answer_B[b]))
    return out


def _memory(call, args) -> dict:
    """The compiled chunk's memory analysis and the device's peak use, in bytes (NaN
    where the backend does not say)."""
    m = call.lower(*args).compile().memory_analysis()
    stats = jax.devices()[0].memory_stats() or {}
    get = lambda k: float(getattr(m, k, np.nan)) if m is not None else np.nan  # noqa: E731
    return {
        "temp_bytes": get("temp_size_in_bytes"),
        "argument_bytes": get("argument_size_in_bytes"),
        "peak_bytes": float(stats.get("peak_bytes_in_use", np.nan)),
    }


class Table(NamedTuple):
    """One patching table's inputs: the view, stacked params [1, ...], the examples,
    the mirror twins, the token groups [G, B, S] (`TABLE_GROUPS`) and the layers."""

    view: Any
    params_K: Any
    ex: Any
    twin: Any
    groups: np.ndarray
    layers: tuple


def setup(kind: str, n_images: int, dtype, layers=None, family: str | None = None) -> Table:
    """The table of the stand-in `kind` ("bench" or "real") of checkpoint family `family`
    (`registry.stand_in_family`) on `n_images` random pictures, random weights in
    `dtype`; `layers` None: every LM layer."""
    fam, config, view = _stand_in_view(family, kind)
    params = fam.init_params(config, jax.random.key(0), dtype)
    specs = pair_questions(view.grid, n_images, view.n_labels, view.n_colours)
    ex = examples(view, specs["examples"])
    twin = view.render(specs["mirror"], ask=specs["examples"])[0]
    groups = token_groups(ex.spans)[[GROUPS.index(g) for g in TABLE_GROUPS]]
    layers = tuple(range(view.n_lm_blocks(params))) if layers is None else tuple(layers)
    params_K = jax.tree_util.tree_map(lambda x: x[None], params)
    return Table(view, params_K, ex, twin, groups, layers)


def real_layers(family: str | None = None) -> tuple[str, int]:
    """(the real model's name, its LM blocks) of the family's "real" stand-in, for
    checking a layer range before any weight is made (a checkpoint view answers
    `n_lm_blocks` from its config: `families.contract`)."""
    fam, _, view = _stand_in_view(family, "real")
    return fam.stand_in.real_name or fam.name, view.n_lm_blocks(None)


def _stand_in_view(family: str | None, kind: str):
    """(the family, its stand-in config `kind`, that config's view of 4 x 4 scenes at the
    stand-in's picture size), the processor read from a temporary folder."""
    fam = stand_in_family(family)
    make, size = fam.stand_in.configs[kind]
    with tempfile.TemporaryDirectory() as folder:
        config = make(fam.stand_in.tokenizer(folder))
        view = fam.view(folder, config, Grid(4, 4), size)
    return fam, config, view


def batched_call(t: Table, batch: int | None):
    """(run, call): the table through `analysis.patching.patch_table` (`batch` images per
    call) with its one compiled program built first, and that program."""
    shared = np.asarray(t.ex.spans.image_BxI)[:, 0]  # the text before the picture is shared
    call = table_call_for(t.view, t.params_K, {"mirror": t.twin}, t.groups, t.layers, shared)

    def run():
        return patch_table(t.view, t.params_K, t.ex.inputs, {"mirror": t.twin}, t.groups,
                           t.ex.answer_B, t.ex.other_B, t.layers, shared, batch, call=call)  # fmt: skip

    return run, call


def _timed(f):
    t0 = time.perf_counter()
    out = jax.block_until_ready(f())
    return out, time.perf_counter() - t0


def patch_table_speed(n_images: int = 64, loop_images: int = 4, repeats: int = 3,
                      kind: str = "bench", dtype=jnp.float32, batch: int | None = None,
                      layers=None, family: str | None = None) -> dict:  # fmt: skip
    """Cells per second of the batched table (`batched_call`) and of the loop (module
    docstring; `loop_images` 0: no loop), timed in turns, `repeats` times each, so
    each ratio compares the two in the same minute (the machine drifts); medians. And
    the largest |difference| of their log-probabilities on the loop's images, the
    table's shape, the first call's time (compile included) and memory (`_memory`)."""
    t = setup(kind, n_images, dtype, layers, family)
    run, call = batched_call(t, batch)
    got, first_s = _timed(run)
    rows = np.arange(batch or n_images)
    args = chunk_args(t.ex.inputs, {"mirror": t.twin}, t.groups, t.ex.answer_B, t.ex.other_B, rows)

    cells = len(t.layers) * len(t.groups) * n_images
    out = {"config": kind, "cells": cells, "layers": len(t.layers),
           "tokens": int(t.ex.inputs.tokens_BxS.shape[1]),
           "image_tokens": int(t.ex.inputs.image_BxI.shape[1]), "first_call_s": first_s,
           **_memory(call, (t.params_K, *args))}  # fmt: skip
    images = list(range(min(loop_images, n_images)))
    params = jax.tree_util.tree_map(lambda x: x[0], t.params_K)
    loop_calls = _loop_calls(t.view, t.layers)
    if images:
        _loop(loop_calls, params, t.ex, t.twin, t.groups, images[:1])  # compile every call
    b_s, l_s = [], []
    for _ in range(repeats):
        b_s.append(_timed(run)[1])
        if images:
            loop, sec = _timed(lambda: _loop(loop_calls, params, t.ex, t.twin, t.groups, images))
            l_s.append(sec)
    out |= {
        "batched_s": statistics.median(b_s),
        "batched_cells_per_s": cells / statistics.median(b_s),
    }
    if not images:
        return out
    loop_cells = len(t.layers) * len(t.groups) * len(images)
    ratios = [(cells / b) / (loop_cells / sec) for b, sec in zip(b_s, l_s)]
    diff = np.abs(got["mirror"]["patched"][0][:, :, images] - loop).max()
    return out | {
        "loop_cells_per_s": loop_cells / statistics.median(l_s),
        "loop_cells": loop_cells,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "max_abs_diff": float(diff),
    }
