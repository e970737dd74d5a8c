"""Image and text token vocabularies (separate, as in SPEC).

Image tokens: `0` background, `1..n_labels` objects, `n_labels + 1` the CLS token.
Text tokens: `0` PAD, `1..n_labels` label words (same number as the image label, so
label `k` is text token `k`), then the words `is on the left right of`, then BOS, EOT.
The 2D task appends the words `above below` after `of` (`WORDS_2D`; BOS and EOT move up
by two); every other task keeps the 1D vocabulary, ids unchanged (`data.tasks.task_vocab`). EOT is always
the last text id (the text tower finds its readout by it).
"""

from __future__ import annotations

import dataclasses

WORDS = ("is", "on", "the", "left", "right", "of")
WORDS_2D = WORDS + ("above", "below")
CAPTION_LEN = 9  # BOS X is on the left of Y EOT


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Token ids for a task with `n_labels` object labels and the text words `words`."""

    n_labels: int
    words: tuple[str, ...] = WORDS

    # image side
    @property
    def background(self) -> int:
        return 0

    @property
    def cls(self) -> int:
        return self.n_labels + 1

    @property
    def image_vocab_size(self) -> int:
        return self.n_labels + 2

    # text side
    @property
    def pad(self) -> int:
        return 0

    def word(self, w: str) -> int:
        return self.n_labels + 1 + self.words.index(w)

    @property
    def bos(self) -> int:
        return self.n_labels + 1 + len(self.words)

    @property
    def eot(self) -> int:
        return self.bos + 1

    @property
    def text_vocab_size(self) -> int:
        return self.eot + 1

    def encode(self, words: list[str | int]) -> list[int]:
        """Tokens of `BOS words... EOT`, padded to CAPTION_LEN; ints are labels."""
        ids = [self.bos] + [w if isinstance(w, int) else self.word(w) for w in words]
        ids.append(self.eot)
        if len(ids) > CAPTION_LEN:
            raise ValueError(f"caption {words!r} is longer than {CAPTION_LEN} tokens")
        return ids + [self.pad] * (CAPTION_LEN - len(ids))

    def decode(self, ids) -> str:
        """Human-readable caption (labels as numbers, no BOS/EOT/PAD)."""
        out = []
        for t in ids:
            t = int(t)
            if 1 <= t <= self.n_labels:
                out.append(str(t))
            elif self.n_labels < t < self.bos:
                out.append(self.words[t - self.n_labels - 1])
        return " ".join(out)
