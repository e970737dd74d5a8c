"""Opening a real checkpoint for the paper 003 / 004 reports (`open_checkpoint`): its
options and questions checked before any weight is read, its weights checked against
the memory budget (`model.check_fits`), then loaded through the one model handle
(`model.load`: a folder or a Hub name, `place` one device or sharded), as a one-model
`subjects.LoadedRun` whose subject is a `subjects.CheckpointSubject` holding the `Model`.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.data.datasets.questions import PROTOCOLS
from jaxmech.families.vlm_view import VLMView
from jaxmech.memory import (
    device_bytes,
    memory_budget,
    release_freed,
    tree_bytes,
    tree_devices,
)
from jaxmech.models.hub import check_place
from jaxmech.reports.subjects import CheckpointSubject, LoadedRun


def open_checkpoint(folder: str, *, grid=(4, 4), size: int | None = None, questions: int = 64,
                    seed: int | None = None, layers=None, batch: int | None = None,
                    dtype="float32", place: str = "auto",
                    video: bool = False, memory: str | None = None,
                    protocol: str = "jaxmech", questions_from: str = "drawn",
                    data: str | None = None, per_block: bool = False,
                    log=print) -> LoadedRun:  # fmt: skip
    """A real checkpoint (a folder, or a Hub name `ORG/NAME[@REVISION]` resolved through
    the Hugging Face cache: `hub_names.checkpoint_folder`) as a one-model `LoadedRun` for
    the paper 003 / 004 reports: params stacked [1, ...], its subject a
    `CheckpointSubject` (the family's VLM view of `grid` scenes drawn `size` pixels
    square (None: the family's default size for them, e.g. 448 for Qwen2-VL),
    `questions` pair questions per spatial relation drawn from `seed`; `batch` per compiled call, None: sized by memory), no
    config, settings or task. `video`: the scenes drawn as videos (the family's video
    view), asked about time only (relation 1: before / after). `memory`: the budget
    (`memory.memory_budget`: GB, a fraction or a percent; None: the default) every
    table's rows per call are planned within. `place`: the weights on one device
    ("one"), each matrix split over every device ("shard": `models.hub._sharding`), or
    "auto" (sharded where they do not fit one device); sharded, a table's rows are
    planned per device (`CheckpointSubject.rows_per_call`). `layers`: as the authors
    index them (layer L the residual after L blocks, `lm/resid_pre.L`; 0..n).
    `protocol`: "authors"
    (their scripts' wording, answer words and table protocols) or "jaxmech"
    (`protocol_of`). `questions_from`: "drawn", or a dataset (`data.datasets.questions.SOURCES`)
    read from folder `data`, at most `questions` of them (None: the source's default:
    every one, COCO-Spatial's 100) drawn from `seed` (None: 0, and a dataset's sample
    under the authors' protocol 42, their `random.seed(42)`:
    `data.datasets.questions.sample_seed`). `per_block`: the counterfactual table
    also mirrors the ViT's positions in one block at a time (`analysis.counterfactuals.
    names_for`; 2 rows per ViT block, off by default at a checkpoint's size). Bad
    options and malformed records raise ValueError naming them, before the weights are
    read."""
    from jaxmech.chunks import file_stamps
    from jaxmech.data.datasets.questions import sample_seed
    from jaxmech.data.spec import Grid
    from jaxmech.families.registry import read_checkpoint_config
    from jaxmech.hub_names import checkpoint_folder

    photos = _photo_questions(questions_from, data, questions, sample_seed(seed, protocol), video)
    seed = 0 if seed is None else seed  # the drawn scenes' (and the twins') seed
    questions = 64 if questions is None else questions
    _check_options(questions, batch, protocol)
    check_place(place)
    budget = memory_budget(memory)
    folder = checkpoint_folder(folder)  # a Hub name: its cached snapshot, fetched if need be
    family, config = read_checkpoint_config(folder)
    view = family.view(folder, config, Grid(*grid), size, video=video, wording=protocol)
    size = view.size
    _check_layers(layers, view.n_lm_blocks(None))
    # drawn before the weights are read, so a grid with no question of a relation is
    # refused at once (`spec.check_pair_grid`)
    specs = _pair_specs(view, questions, seed, video)
    model = _load_model(folder, dtype, place, budget, log)
    key = {"checkpoint": os.path.abspath(folder), "files": file_stamps(folder), "grid": grid,
           "size": size, "questions": questions, "seed": seed, "dtype": dtype, "video": video,
           "protocol": protocol}  # fmt: skip
    from jaxmech.reports.batches import source_record

    source = "drawn" if photos is None else source_record(photos, data)
    if photos is not None:
        key |= {"source": source, "questions_from": questions_from}
        log(f"questions: {photos.source} from {data}, {len(photos.questions)} "
            f"({photos.sample})")  # fmt: skip
    params = jax.tree_util.tree_map(_stacked, model.params)  # held once: [1, ...] only
    model = dataclasses.replace(model, params=None)
    subject = CheckpointSubject(model, view, specs, None if layers is None else tuple(layers),
                                batch, key, budget=budget, protocol=protocol, photos=photos,
                                source=source, per_block=per_block)  # fmt: skip
    return LoadedRun(path=folder, config=None, params=params, settings=None, data=None,
                     results=[{"model": 0, "diverged_step": -1}], models=(0,), excluded=(),
                     family=model.family, examples=None, subject=subject)  # fmt: skip


def _load_model(folder: str, dtype: str, place: str, budget, log):
    """The checkpoint in `folder` as a `model.Model` (`model.load`), its params in
    `dtype` placed by `place`: refused before any weight is read where they alone exceed
    `budget` (`model.check_fits`), the host copies released after, what was
    loaded logged."""
    from jaxmech.model import check_fits, load
    from jaxmech.models.precision import describe

    check_fits(folder, getattr(jnp, dtype), place, budget)
    log(f"loading {folder} ({dtype}, place={place})")
    model = load(folder, dtype=getattr(jnp, dtype), place=place)
    params = model.params
    log(describe(dtype))  # which products, and why (models.precision)
    release_freed()  # the tensors' host copies
    log(f"checkpoint {folder}: {model.describe()}, {dtype}, weights "
        f"{tree_bytes(params) / 2**30:.2f} GB{placement_text(params)}; memory budget "
        f"{budget.bytes / 2**30:.1f} GB ({budget.how})")  # fmt: skip
    return model


def placement_text(params) -> str:
    """How loaded `params` lie on the devices, for the log ("" on one device)."""
    devices = tree_devices(params)
    if devices == 1:
        return ""
    leaves = jax.tree_util.tree_leaves(params)
    split = sum(not x.sharding.is_fully_replicated for x in leaves)
    return (f", sharded over {devices} devices ({split} of {len(leaves)} arrays split, the "
            f"others replicated): {device_bytes(params) / 2**30:.2f} GB on each")  # fmt: skip


def _check_options(questions: int, batch, protocol: str) -> None:
    for name, v in (("questions", questions), ("batch", 1 if batch is None else batch)):
        if v < 1:
            raise ValueError(f"{name} = {v}: expected at least 1")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol = {protocol!r}: expected one of {', '.join(PROTOCOLS)}")


def _check_layers(layers, n: int) -> None:
    """`layers` as the authors index them must lie in [0, n] for an LM of n blocks."""
    if layers is not None and (not layers or min(layers) < 0 or max(layers) > n):
        raise ValueError(
            f"layers = {list(layers)}: expected LM layers in [0, {n}] (layer L: the "
            f"residual after L of the {n} blocks)"
        )


def _pair_specs(view: VLMView, questions: int, seed: int, video: bool) -> dict:
    """{"examples": spec, twin: spec}: `questions` drawn pair questions per relation
    (a video's: relation 1 only), the relations concatenated."""
    from jaxmech.data.spec import SceneSpec, pair_questions

    per_rel = [pair_questions(view.grid, questions, view.n_labels, view.n_colours, seed, rel)
               for rel in ((1,) if video else (0, 1))]  # fmt: skip
    return {k: SceneSpec(*map(np.concatenate, zip(*(d[k] for d in per_rel)))) for k in per_rel[0]}


def _photo_questions(source: str, data, n, seed: int, video: bool):
    """The QuestionSet of `--questions_from` (None: drawn scenes), every record checked."""
    from jaxmech.data.datasets.questions import SOURCES, load_questions

    if source == "drawn":
        if data:
            raise ValueError(f"data = {data!r}: only read with a dataset's --questions_from")
        return None
    if source not in SOURCES:
        raise ValueError(f"questions_from = {source!r}: expected drawn or one of "
                         f"{', '.join(SOURCES)}")  # fmt: skip
    if video:
        raise ValueError(f"questions_from = {source!r}: a video report asks drawn videos only")
    if not data:
        raise ValueError(f"questions_from = {source!r}: give the dataset's folder (--data)")
    return load_questions(source, data, n=n, seed=seed)


def _stacked(x):
    """x [...] as one model [1, ...], the unstacked copy freed at once (so a loaded
    checkpoint's weights are never held twice)."""
    y = x[None]
    x.delete()
    return y
