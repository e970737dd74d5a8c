"""Prompts as token rows, for every checkpoint family: a batch of prompt texts tokenized
with each token's character offsets and left-padded to one length (`token_rows`), and
where a word of a question lands (`word_range`, `last_subtoken`: the authors read an
object word's last sub-token)."""

from __future__ import annotations

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
