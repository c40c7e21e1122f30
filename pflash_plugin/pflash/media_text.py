"""PFlash on a prompt with media (issue 46): a media chunk holds its positions with negative
pseudo-token ids (engine/media_prompt.py). The drafter is a text model that cannot read them, so it
drafts the prompt's text alone; the media runs are always kept (mandatory), only text segments are
scored and dropped, and the kept tokens (media runs whole) are prefilled at contiguous positions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .selection import Segment


@dataclass(frozen=True)
class TextView:
    """The text tokens of a prompt of `n` tokens whose `media` runs are pseudo-ids."""

    n: int
    index: np.ndarray  # the prompt index of each text token, ascending
    media: tuple[Segment, ...]

    @classmethod
    def of(cls, tokens: Sequence[int]) -> TextView | None:
        """None for a prompt without media (the common case: nothing changes)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if not ids.size or ids.min() >= 0:
            return None
        is_media = ids < 0
        edges = np.flatnonzero(np.diff(np.concatenate(([0], is_media.astype(np.int8), [0]))))
        runs = tuple(Segment(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))
        return cls(len(ids), np.flatnonzero(~is_media), runs)

    def text(self, tokens: Sequence[int]) -> list[int]:
        return [int(t) for t in np.asarray(tokens, dtype=np.int64)[self.index]]

    def to_text(self, i: int) -> int:
        """A prompt index (or one past it: the appended query's) as an index into `text`."""
        if i >= self.n:
            return len(self.index) + i - self.n
        return int(np.searchsorted(self.index, i))

    def mass(self, text_mass: np.ndarray) -> np.ndarray:
        """The text's scores at their prompt indices; media 0 (they are mandatory anyway)."""
        out = np.zeros(self.n, dtype=np.float64)
        m = min(len(text_mass), len(self.index))
        out[self.index[:m]] = text_mass[:m]
        return out

    def boundaries(self, text_flags: np.ndarray) -> np.ndarray:
        """Where segments may close, at prompt indices: after the text's flagged tokens, and
        before and after each media run (its own segment)."""
        out = np.zeros(self.n, dtype=bool)
        out[self.index] = text_flags
        for run in self.media:
            out[max(run.start - 1, 0)] = out[run.end - 1] = True
        return out
