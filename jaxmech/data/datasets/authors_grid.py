"""Paper 003's fine-tuning data as the authors' `spatial_finetuning/train.py` reads it: a
folder of pictures named "obj1_x1-y1_obj2_x2-y2.png" (x the column, y the row of the
grid cell each object was pasted at; object names may hold spaces and underscores),
each asked left / right where the columns differ and above / below where the rows
differ (smaller y is higher), in their words:

    Is {obj1} to the left or right of {obj2}? Answer with "left" or "right" only.
    Is {obj1} above or below {obj2}? Answer with "above" or "below" only.

Their split (`split_pairs`) holds out whole object pairs (obj1, obj2): the pairs in the
order their files are first listed, shuffled by `random.Random(seed)` (Python's own
generator, as theirs), the first max(1, int(n * frac)) held out (none where frac <= 0
or there is one pair). Their batches (`batches`): without the ID loss, the training
questions in order, `batch_size` at a time (their DataLoader keeps the last, short
one); with it, their `FixedObj1BatchSampler`: the questions grouped by (obj1, x1, y1,
obj2), each group of more than one split into `batch_size` chunks, chunks of one
dropped. Their shuffles (the DataLoader's and the sampler's global `random`) are
unseeded; here the order is the listing's, or `seed`'s permutation of the batches and
of each group (`batches(seed=...)`), so a run equals theirs where an epoch is one batch.

The listing order: theirs is `os.listdir`'s, which `read_folder` keeps (the split
depends on it); `items(names)` takes any order.
"""

from __future__ import annotations

import os
import random
import re
from typing import NamedTuple

import numpy as np

COORDS = re.compile(r"_(\d+)-(\d+)")
QUESTIONS = {
    "h": ('Is {} to the left or right of {}? Answer with "left" or "right" only.', "left", "right"),
    "v": ('Is {} above or below {}? Answer with "above" or "below" only.', "above", "below"),
}  # fmt: skip


class Item(NamedTuple):
    """One training question: its picture's file, the question, the answer word, the two
    objects and their cells (x1, y1, x2, y2)."""

    path: str
    question: str
    answer: str
    obj1: str
    obj2: str
    coords: tuple


def parse_name(name: str) -> tuple:
    """(obj1, x1, y1, obj2, x2, y2) of a file name "obj1_x1-y1_obj2_x2-y2.png" (their
    `parse_filename`: the last two "_x-y" are the cells, obj1 before the first of them,
    obj2 between). ValueError naming the file where it has fewer than two."""
    stem = name[: -len(".png")] if name.endswith(".png") else name
    found = list(COORDS.finditer(stem))
    if not name.endswith(".png") or len(found) < 2:
        raise ValueError(f"{name!r}: expected a name 'obj1_x1-y1_obj2_x2-y2.png'")
    a, b = found[-2], found[-1]
    obj2 = stem[a.end() : b.start()].strip()
    obj2 = obj2[1:] if obj2.startswith("_") else obj2
    return stem[: a.start()].strip(), int(a[1]), int(a[2]), obj2, int(b[1]), int(b[2])


def items(folder: str, names) -> list[Item]:
    """The questions of the pictures `names` (in that order; names not ending in .png are
    skipped, as theirs) in `folder`: per picture left / right first, then above / below.
    ValueError naming a file whose name does not parse."""
    out = []
    for name in names:
        if not name.endswith(".png"):
            continue
        o1, x1, y1, o2, x2, y2 = parse_name(name)
        for kind, differs, first in (("h", x1 != x2, x1 < x2), ("v", y1 != y2, y1 < y2)):
            if differs:
                text, yes, no = QUESTIONS[kind]
                out.append(Item(os.path.join(folder, name), text.format(o1, o2),
                                yes if first else no, o1, o2, (x1, y1, x2, y2)))  # fmt: skip
    return out


def read_folder(folder: str) -> list[Item]:
    """`items` of every picture in `folder`, in `os.listdir`'s order (theirs). ValueError
    naming the folder where it is missing or asks nothing."""
    if not os.path.isdir(folder):
        raise ValueError(f"train_dir = {folder!r}: not a folder")
    out = items(folder, os.listdir(folder))
    if not out:
        raise ValueError(f"train_dir = {folder!r}: no picture named 'obj1_x1-y1_obj2_x2-y2.png' "
                         "whose objects differ in column or row")  # fmt: skip
    return out


def split_pairs(its: list[Item], frac: float = 0.15, seed: int = 42):
    """(train indices, held-out indices, held-out pairs) of their object-pair split
    (module docstring), indices sorted."""
    pairs = list(dict.fromkeys((it.obj1, it.obj2) for it in its))
    held = set()
    if frac > 0 and len(pairs) >= 2:
        shuffled = pairs[:]
        random.Random(seed).shuffle(shuffled)
        n = min(max(1, int(len(pairs) * frac)), len(pairs) - 1)
        held = set(shuffled[:n])
    train = [i for i, it in enumerate(its) if (it.obj1, it.obj2) not in held]
    out = [i for i, it in enumerate(its) if (it.obj1, it.obj2) in held]
    return train, out, sorted(held)


def batches(its: list[Item], train: list[int], batch_size: int, grouped: bool,
            seed: int | None = None) -> list[list[int]]:  # fmt: skip
    """One epoch's batches of indices into `its` (module docstring): `grouped` their
    ID-loss sampler's, else their DataLoader's; `seed` None: in order, else a seeded
    shuffle where theirs is unseeded. ValueError naming `batch_size` below 1."""
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: expected at least 1")
    rng = None if seed is None else np.random.default_rng(seed)
    if not grouped:
        order = list(train) if rng is None else [int(i) for i in rng.permutation(train)]
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    keep, groups = set(train), {}
    for i, it in enumerate(its):
        groups.setdefault((it.obj1, *it.coords[:2], it.obj2), []).append(i)
    chosen = [[i for i in g if i in keep] for g in groups.values()]
    chosen = [g for g in chosen if len(g) > 1]
    if rng is not None:
        chosen = [chosen[k] for k in rng.permutation(len(chosen))]
        chosen = [[int(i) for i in rng.permutation(g)] for g in chosen]
    return [g[i : i + batch_size] for g in chosen for i in range(0, len(g), batch_size)
            if len(g[i : i + batch_size]) > 1]  # fmt: skip
