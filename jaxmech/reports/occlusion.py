"""Paper 003's occlusion experiment (Fig. 8B) as the authors run it (`--protocol=authors`;
their `ground_truth_deviation/coco_blur.py`, `coco_blur.sh`, `fig_8b.ipynb`) on a real
checkpoint and COCO-Spatial's rows of both relations.

Per question (a row whose X and Y each have an instance of their exact COCO category;
the others left out, counted): X's and Y's boxes chosen among all instances
(`data.inputs.occlusion_boxes.pick_pair`), 10 boxes of X's size elsewhere meeting neither
(`boxes_elsewhere`, jaxmech's seeded rng: their hash-seeded draw cannot be repeated;
`elsewhere=` injects boxes), blurred at radius 20; the model asked their wording, "Is the
X to the left or right of the Y? Answer Left or Right." ("above or below", "Above or
Below"), the text *before* the image in the chat message (Qwen's template renders it so;
LLaVA's renders every image first), through the checkpoint's default processor (their
`AutoProcessor(use_fast=True)`: torchvision's resize); read: log p of the correct and the
wrong word's first token (`tokenize(word)` without special tokens: "▁Left" for Llama's
pieces, "Left" for Qwen's) at the first generated token, for the 12 images [original, X
blurred, 10 elsewhere] (`logp_Qx12x2`).

The figure (`figure_8b`): per question min(cc[3:7]) - cc[1] over the correct word's log
p `cc` (`sensitivity`: the worst of the 2nd-5th boxes elsewhere minus X blurred;
positive: blurring X hurts more than blurring elsewhere; cc[2], the first box elsewhere,
is not read: their docstring's old layout named it Y's blur), split by Fig. 8A's verdict
on the question (`verdicts`: True / False; None or missing left out, as theirs). Their
results are keyed by image id, so a later question on the same image replaces an earlier
one (kept so here). Means with 95% t intervals per group (n = 0 said).

Writes OUT/occlusion_authors/questions.csv (image id, relation, sensitivity, verdict,
the 12 log p of each word) and summary.json (`run`).
"""

from __future__ import annotations

import csv
import json
import os

import numpy as np

from jaxmech.data.inputs import occlusion_boxes as ob
from jaxmech.data.inputs.image_twins import BLUR_RADIUS, open_image
from jaxmech.stats import mean_ci

WORDS = {"left": ("Left", "Right"), "right": ("Right", "Left"), "above": ("Above", "Below"),
         "below": ("Below", "Above")}  # fmt: skip
OTHERS = slice(3, 7)  # `fig_8b.ipynb`: cc[3:7]


def authors_question(x: str, y: str, relation: str) -> str:
    """Their wording (`_question_from_caption`) of X `relation` Y."""
    if relation not in WORDS:
        raise ValueError(f"relation = {relation!r}: expected one of {', '.join(WORDS)}")
    if relation in ("left", "right"):
        return f"Is the {x} to the left or right of the {y}? Answer Left or Right."
    return f"Is the {x} above or below the {y}? Answer Above or Below."


def answer_ids(tokenizer, relation: str) -> tuple[int, int]:
    """(correct, wrong) answer word's first token id, no special tokens (theirs:
    `tokenizer(text=[correct, wrong], add_special_tokens=False)`)."""
    if relation not in WORDS:
        raise ValueError(f"relation = {relation!r}: expected one of {', '.join(WORDS)}")
    out = []
    for word in WORDS[relation]:
        ids = tokenizer.encode(word, add_special_tokens=False).ids
        if not ids:
            raise ValueError(f"the tokenizer gives no token for {word!r}")
        out.append(int(ids[0]))
    return out[0], out[1]


def check_family(model) -> str:
    """The checkpoint's family name (`model`: a `Model`, or the family itself, so a
    command can refuse before any weight is read); ValueError where the family offers
    no `encode_text_first` (their prompt: the text before the image)."""
    family = getattr(model, "family", model)
    if family.encode_text_first is None:
        raise ValueError(f"checkpoint family {family.name!r}: the authors' occlusion prompt "
                         f"is known for {', '.join(_text_first_families())} only")  # fmt: skip
    return family.name


def _text_first_families() -> list[str]:
    """The registered checkpoint families offering `encode_text_first` (for a message)."""
    from jaxmech.families.registry import LISTED, get_family

    return sorted(f.name for f in LISTED if f.checkpoint_types
                  and get_family(f.name).encode_text_first is not None)  # fmt: skip


def encode_authors(model, images, question: str):
    """The family's encoding of `images` (one size), each asked `question` in a message
    whose text comes before the image (`CheckpointFamily.encode_text_first`)."""
    check_family(model)
    return model.family.encode_text_first(model.processor, images, [question] * len(images))


def first_token_logp(model, images, question: str, ids) -> np.ndarray:
    """float32 [N, len(ids)] log p of tokens `ids` as the first generated token after
    `question` about each of `images` (uint8 [H, W, 3], one size)."""
    logp = np.asarray(model.next_token_logprobs(encode_authors(model, images, question)))
    return logp[:, list(ids)].astype(np.float32)


def sensitivity(corr_QxN) -> np.ndarray:
    """float [Q] min(cc[3:7]) - cc[1] per question's correct-word log p `cc` (NaN where
    it has no cc[3]: their `min([])` raises and the question is skipped)."""
    out = []
    for cc in np.asarray(corr_QxN, np.float64):
        others = cc[OTHERS][np.isfinite(cc[OTHERS])]
        out.append(others.min() - cc[1] if len(others) else np.nan)
    return np.asarray(out)


def figure_8b(corr_QxN, verdicts) -> dict:
    """{"positive" / "negative": {"values", "mean", "ci", "n"}}: `sensitivity` split by
    the Fig. 8A verdict of each question (True / False; None: left out)."""
    s = sensitivity(corr_QxN)
    if len(verdicts) != len(s):
        raise ValueError(f"verdicts: {len(verdicts)} for {len(s)} questions")
    out = {}
    for name, want in (("positive", True), ("negative", False)):
        v = [float(x) for x, d in zip(s, verdicts) if d is want and np.isfinite(x)]
        mean, lo, hi, n = mean_ci(v, lo=None, hi=None)
        out[name] = {"values": v, "mean": mean, "ci": [lo, hi], "n": n}
    return out


def question_boxes(coco: dict, image_id: int, x: str, y: str, relation: str, size_hw,
                   rng: np.random.Generator, elsewhere=None):  # fmt: skip
    """(X's box, Y's box, int [N, 4] boxes elsewhere) of one question, or None where X or
    Y has no instance of its exact category; `elsewhere` given: used as it is."""
    xs, ys = (ob.category_boxes(coco, image_id, w) for w in (x, y))
    if not xs or not ys:
        return None
    xb, yb = ob.pick_pair(xs, ys, relation)
    if elsewhere is None:
        elsewhere = ob.boxes_elsewhere(xb, [xb, yb], size_hw[1], size_hw[0], rng)
    return xb, yb, np.asarray(elsewhere, np.int64).reshape(-1, 4)


def compute(model, questions, coco: dict, seed: int = 42, elsewhere=None,
            radius: float = BLUR_RADIUS, log=print) -> dict:  # fmt: skip
    """Per question of `questions` (`data.datasets.questions.ImageQuestion`s with `image_id`s in
    their file names) that `question_boxes` can box: {"image_id" [Q], "relation" [Q],
    "boxes_Qx2x4", "elsewhere" [Q] arrays, "logp_Qx12x2" (NaN past a question's N),
    "skipped"}; `elsewhere`: {image id: boxes} to use instead of drawing."""
    check_family(model)
    rng, rows, skipped = np.random.default_rng(seed), {}, 0
    for q in questions:
        image_id = int(os.path.splitext(os.path.basename(str(q.image)))[0])
        x, y = (w.lower() for w in q.objects)
        pixels = open_image(q.image)
        given = None if elsewhere is None else elsewhere.get(image_id)
        boxes = question_boxes(coco, image_id, x, y, q.relation, pixels.shape[:2], rng, given)
        if boxes is None:
            skipped += 1
            continue
        images = ob.occlusion_images(pixels, boxes[0], boxes[2], radius)
        lp = first_token_logp(model, images, authors_question(x, y, q.relation),
                              answer_ids(model.tokenizer, q.relation))  # fmt: skip
        full = np.full((2 + ob.N_ELSEWHERE, 2), np.nan, np.float32)
        full[: len(lp)] = lp
        rows.pop(image_id, None)  # theirs: keyed by image id, the later question kept
        rows[image_id] = (q.relation, boxes, full)
    if skipped:
        log(f"  {skipped} question(s) without an instance of X's or Y's exact category: left out")
    ids = list(rows)
    return {
        "image_id": np.asarray(ids, np.int64),
        "relation": [rows[i][0] for i in ids],
        "boxes_Qx2x4": np.asarray([rows[i][1][:2] for i in ids], np.float64).reshape(-1, 2, 4),
        "elsewhere": [rows[i][1][2] for i in ids],
        "logp_Qx12x2": np.asarray([rows[i][2] for i in ids], np.float32).reshape(-1, 12, 2),
        "skipped": skipped,
    }


def fig_8a_verdicts(model, questions, max_new_tokens: int = 250) -> dict:
    """{image id: True / False / None} Fig. 8A's verdict on each question: the greedy
    reply to `coco_deviation.py`'s question ("... Answer left or right only.", the image
    first, Pillow's resize as their slow processor) contains the correct word and not
    the wrong one (True), the reverse (False), else None (`models.generate`)."""
    from jaxmech.models.generate import reply_text, sequences, text_verdict

    proc = model.family.processor(model.folder, model.config, resize="pil")
    out = {}
    for q in questions:
        x, y = q.objects
        rel = "to the left or right of" if q.relation in ("left", "right") else "above or below"
        words = "left or right" if q.relation in ("left", "right") else "above or below"
        enc = model.family.encode(
            proc, [q.image], [f"Is the {x} {rel} the {y}? Answer {words} only."]
        )
        g = model.generate(enc, max_new_tokens=max_new_tokens)
        text = reply_text(model.tokenizer, sequences(enc, g)[0])
        v = text_verdict(text, *q.answers)
        image_id = int(os.path.splitext(os.path.basename(str(q.image)))[0])
        out[image_id] = {"correct": True, "wrong": False}.get(v)
    return out


def run(model, questions, coco: dict, out_dir: str, seed: int = 42,
        max_new_tokens: int = 250, log=print) -> dict:  # fmt: skip
    """`compute`, Fig. 8A's verdicts, `figure_8b`, written to OUT/occlusion_authors/."""
    res = compute(model, questions, coco, seed, log=log)
    verdicts = fig_8a_verdicts(model, questions, max_new_tokens)
    v = [verdicts.get(int(i)) for i in res["image_id"]]
    fig = figure_8b(res["logp_Qx12x2"][..., 0], v)
    folder = os.path.join(out_dir, "occlusion_authors")
    os.makedirs(folder, exist_ok=True)
    s = sensitivity(res["logp_Qx12x2"][..., 0])
    with open(os.path.join(folder, "questions.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image_id", "relation", "sensitivity", "verdict"]
                   + [f"{word}_{k}" for word in ("correct", "wrong") for k in range(12)])  # fmt: skip
        for q in range(len(s)):
            lp = res["logp_Qx12x2"][q]
            w.writerow([int(res["image_id"][q]), res["relation"][q], s[q], v[q]]
                       + lp[:, 0].tolist() + lp[:, 1].tolist())  # fmt: skip
    summary = {"n_questions": len(s), "skipped": res["skipped"], "seed": seed, **fig}
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(_no_nan(summary), f, indent=2)  # strict JSON: NaN (n < 2) as null
    for name, g in fig.items():
        said = "n = 0" if not g["n"] else f"{g['mean']:.3f} [{g['ci'][0]:.3f}, {g['ci'][1]:.3f}]"
        log(f"occlusion (authors, Fig. 8B) {name} answers: min(cc[3:7]) - cc[1] = {said}")
    return summary


def _no_nan(x):
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return None if isinstance(x, float) and not np.isfinite(x) else x
