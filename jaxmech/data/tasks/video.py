"""The video task (`task_kind = "video"`): objects in frames, "did X come before Y?".

A video is the scenes task's grid read as time: grid row f is frame f (T = `grid_h`
frames of `grid_w` cells each, cells frame-major, so the LM reads the frames in
order). Two objects always stand in different frames, and the only question is
before / after: `[is, X, before, or, after, of, Y, ?]` (the answer: X's frame is
earlier / later than Y's); a single-object question `... of mid ?` asks whether X
comes in the first or the second half of the video. Everything else is the scenes
task's (`data.tasks.scenes`: labels, colours, facings, the label split, absent-label
questions, held-out cells, eval sets), so the same model, evaluation and analyses run.

The words reuse the scene vocabulary's ids (`VIDEO_WORDS`): `before` / `after` are the
ids of `above` / `below`, so a video question is a vertical scene question and its
relation id is 1 (`ANSWER_RELATIONS`: metric name `t`).

Time reversal is the video's mirror: frame f -> T - 1 - f, before <-> after
(`data.spec.mirror_height`; facings stay). The eval sets' `mirror` and `mirror_pos` twins
are that reversal, so the mirror-swap tools read it unchanged. Model side: with
`vit_frames` the ViT sees each frame alone and has no row code, and the LM's
three-part position ids carry the frame in t (`families.toy_vlm.model`).

Axis names (`jaxmech.shapes`): B batch rows, L = T W cells.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxmech.config import ConfigError, TaskConfig
from jaxmech.data import spec
from jaxmech.data.tasks import scenes as sc


@dataclasses.dataclass(frozen=True)
class VideoConfig(sc.SceneConfig):
    """The video task's config: the scenes' fields, the grid's rows read as frames."""

    task_kind: str = "video"


VIDEO_WORDS = tuple({"above": "before", "below": "after"}.get(w, w) for w in sc.SCENE_WORDS)
TIME = 1  # the relation id of before / after (the scenes' vertical one)
ANSWER_RELATIONS = (("t", TIME),)
sample_batch = sc.sample_batch  # the scenes sampler, on the tables below


def _check(task: TaskConfig, n_layouts: int) -> None:
    if not isinstance(task, VideoConfig):
        raise ConfigError(
            f"task_kind = {task.task_kind!r} is invalid here: data.tasks.video needs a VideoConfig"
        )
    if task.layouts_per_pair > n_layouts:
        raise ConfigError(
            f"layouts_per_pair = {task.layouts_per_pair} is invalid for {task.grid_h} frames "
            f"of {task.grid_w} cells: allowed at most {n_layouts} (the layouts with the two "
            "objects in different frames)"
        )


def build_tables(task: TaskConfig) -> sc.SceneTables:
    """The scenes tables kept to layouts whose objects are in different frames (each
    pair's training order is the scenes order with the others left out) and to
    single-object questions about time."""
    t = sc.build_tables(task)
    keep = t.rel_ok[:, TIME]  # rows (frames) differ
    _check(task, int(keep.sum()))
    new_index = np.cumsum(keep) - 1
    n = t.pair_perm.shape[0]
    perm = t.pair_perm[keep[t.pair_perm]].reshape(n, n, -1)
    rel_ok = np.zeros((int(keep.sum()), 2), bool)
    rel_ok[:, TIME] = True
    single_ok = t.single_ok & (np.arange(2) == TIME)
    if not single_ok[1:].any((1, 2)).all():
        raise ConfigError(
            f"n_single_holdout = {task.n_single_holdout} is invalid for {task.grid_h} frames "
            f"with data_seed = {task.data_seed}: a label keeps no training cell outside the "
            "middle frame (lower it)"
        )
    return t._replace(
        layouts=t.layouts[keep],
        rel_ok=rel_ok,
        pair_perm=new_index[perm].astype(t.pair_perm.dtype),
        single_ok=single_ok,
    )


def build_eval_sets(task: TaskConfig, tables: sc.SceneTables) -> sc.SceneEvalSets:
    """The scenes eval sets on the video tables, their mirror twins time-reversed (the
    examples' specs, `data.spec.mirror_height`, rendered)."""
    sets = sc.build_eval_sets(task, tables)
    as_np = lambda tree: jax.tree_util.tree_map(np.asarray, tree)  # noqa: E731
    grid = sc.grid_of(task)

    def reversed_twins(s: sc.SceneEvalSet) -> sc.SceneEvalSet:
        examples = sc.eval_specs(task, s)["examples"]
        rev = as_np(sc.render(task, spec.mirror_height(grid, examples)))
        return s._replace(mirror=rev, mirror_pos=rev)

    return sc.SceneEvalSets(*(reversed_twins(s) for s in sets))


def eval_specs(task: TaskConfig, s: sc.SceneEvalSet) -> dict:
    """The set and its twins as scene specs (`scenes.eval_specs`), the mirrors reversed
    in time."""
    return sc.eval_specs(task, s, mirror_twin=spec.mirror_height)


def describe(batch: sc.SceneBatch, task: TaskConfig, i: int = 0) -> str:
    """Row i as text: one line per frame, then the question and its answer."""
    return sc.describe(batch, task, i, words=VIDEO_WORDS)
