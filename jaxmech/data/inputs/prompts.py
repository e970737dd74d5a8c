"""Prompts as token rows, for every checkpoint family: a batch of questions checked
(`check_batch`) and put in the family's chat template with each question's character
range (`templated`), tokenized with each token's character offsets and left-padded to
one length (`token_rows`); where a word of a question lands (`word_range`,
`last_subtoken`, `word_positions`: the authors read an object word's last sub-token)
and which tokens are the question's (`question_mask`); the answer words' token ids
(`answer_ids`); a checkpoint's tokenizer and its special tokens' ids (`read_tokenizer`,
`check_token_id`).

Shared because every family's processor builds its prompts and spans the same way
from its tokenizer's character offsets; only the template and the image tokens differ.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import numpy as np


class Rows(NamedTuple):
    """Left-padded token rows: tokens_BxS int32, offsets_BxSx2 int32 each token's
    character range in its prompt (-1 at padding), valid_BxS bool (False at padding)."""

    tokens_BxS: np.ndarray
    offsets_BxSx2: np.ndarray
    valid_BxS: np.ndarray


def token_rows(tokenizer, texts, pad_id: int, add_special_tokens: bool = False) -> Rows:
    """`texts` tokenized by `tokenizer` (a `tokenizers.Tokenizer`), left-padded with
    `pad_id` to the longest."""
    encs = [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    S = max(len(e.ids) for e in encs)
    tokens = np.full((len(encs), S), pad_id, np.int32)
    offsets = np.full((len(encs), S, 2), -1, np.int32)
    valid = np.zeros((len(encs), S), bool)
    for b, e in enumerate(encs):
        n = len(e.ids)
        tokens[b, S - n :], offsets[b, S - n :], valid[b, S - n :] = e.ids, e.offsets, True
    return Rows(tokens, offsets, valid)


def word_range(question: str, word: str) -> tuple[int, int]:
    """The character range of `word`'s first whole-word occurrence in `question`."""
    m = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", question)
    if m is None:
        raise ValueError(f"words: {word!r} is not a word of the question {question!r}")
    return m.span()


def last_subtoken(offsets_Sx2, char_range) -> int:
    """The position of the last token whose character range overlaps `char_range`."""
    lo, hi = char_range
    hit = np.flatnonzero((offsets_Sx2[:, 0] < hi) & (offsets_Sx2[:, 1] > lo))
    return int(hit[-1])


def check_batch(images, questions, what: str = "images") -> None:
    """ValueError naming `questions` unless a non-empty list of strings, or `images`
    unless one per question (None: a text-only batch, no images to count). `what`:
    "images" (a list or tuple in place of an image, several images for one question,
    is refused by its position) or "videos" (each may be a list of frames)."""
    if isinstance(questions, str) or not len(questions):
        raise ValueError("questions: expected a non-empty list of strings")
    if images is None:
        return
    if isinstance(images, (str, os.PathLike)):
        raise ValueError(f"{what} = {str(images)!r}: expected a list, one per question")
    if len(images) != len(questions):
        raise ValueError(f"{what}: {len(images)} {what} for {len(questions)} questions (one each)")
    for i, image in enumerate(images if what == "images" else ()):
        if isinstance(image, (list, tuple)):
            raise ValueError(
                f"images[{i}]: a {type(image).__name__} of {len(image)}, expected one image "
                "(a path, a PIL image or an [H, W, 3] array) per question; a question "
                "about several images is not supported"
            )


def templated(questions, template, tail: str) -> tuple[list, np.ndarray]:
    """(texts, question_Bx2): each question in a chat template `template(question)`
    whose text ends with the question then `tail` (what follows it: the end of the
    user's turn, the assistant's prompt), and the question's [start, end) character
    range in it."""
    texts, ranges = [], []
    for q in questions:
        texts.append(template(q))
        start = len(texts[-1]) - len(q) - len(tail)
        ranges.append((start, start + len(q)))
    return texts, np.asarray(ranges)


def word_positions(texts, question_Bx2, offsets_BxSx2, words) -> np.ndarray:
    """[B, 2] int32 the last sub-token's position of each row's (first, second) object
    words `words` [(X, Y)], each found as a whole word in the row's question (its range
    `question_Bx2` in `texts`; tokens' character ranges `offsets_BxSx2`)."""
    if len(words) != len(texts):
        raise ValueError(f"words: {len(words)} pairs for {len(texts)} questions")
    xy = []
    for b, pair in enumerate(words):
        q0, q1 = int(question_Bx2[b, 0]), int(question_Bx2[b, 1])
        xy.append([last_subtoken(offsets_BxSx2[b], np.add(word_range(texts[b][q0:q1], w), q0))
                   for w in pair])  # fmt: skip
    return np.asarray(xy, np.int32)


def question_mask(offsets_BxSx2, question_Bx2) -> np.ndarray:
    """[B, S] bool the tokens inside each row's question (not the template's, not
    padding, not an empty-range special token)."""
    offs, q = offsets_BxSx2, question_Bx2
    return ((offs[..., 0] >= q[:, None, 0]) & (offs[..., 1] <= q[:, None, 1])
            & (offs[..., 1] > offs[..., 0]))  # fmt: skip


def answer_ids(tokenizer, answers) -> np.ndarray:
    """[3, 2] int32 the first token id of each relation's (first, second) answer words
    `answers` (`data.inputs.pictures.ANSWERS` ...). Raises ValueError when a relation's two
    words begin with the same token: their logits could not tell the answers apart."""
    ids = [[tokenizer.encode(w, add_special_tokens=False).ids[0] for w in pair]
           for pair in answers]  # fmt: skip
    for rel, (a, b) in enumerate(ids[:2]):
        if a == b:
            raise ValueError(f"tokenizer.json: {answers[rel][0]!r} and {answers[rel][1]!r} begin "
                             f"with the same token {a}, so their logits cannot tell the "
                             "answers apart")  # fmt: skip
    return np.asarray(ids, np.int32)


def read_tokenizer(folder: str):
    """(the checkpoint folder's tokenizer.json as a `tokenizers.Tokenizer`, its path);
    ValueError naming the folder where it has none."""
    from tokenizers import Tokenizer

    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint = {folder!r}: no tokenizer.json")
    return Tokenizer.from_file(path), path


def check_token_id(tokenizer, path: str, token: str, want: int, field: str,
                   optional: bool = False) -> None:  # fmt: skip
    """`token`'s id in `tokenizer` (read from `path`) is config.json's `field` = `want`,
    or (`optional`) the tokenizer has no such token; ValueError naming both."""
    got = tokenizer.token_to_id(token)
    if got != want and not (optional and got is None):
        raise ValueError(f"{path}: {token} has id {got}, config.json says {field} = {want}")
