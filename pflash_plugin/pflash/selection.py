"""Choosing which prompt tokens to prefill under a token budget.

The prompt is cut into segments at natural boundaries, so kept text stays
readable; spans that must survive (system prompt, the query and what follows
it) are always kept, and the remaining budget goes to the segments the
drafter's attention marked as most important.
"""

from __future__ import annotations

import bisect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

__all__ = [
    "KeepCurve",
    "Segment",
    "Selection",
    "TokenBoundaries",
    "boundary_flags",
    "budget_for",
    "fixed_segments",
    "segment_at_boundaries",
    "segment_tokens",
    "select",
]

_SENTENCE_ENDS = (".", "!", "?", ";")


@dataclass(frozen=True)
class Segment:
    """Half-open token range [start, end)."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def _is_boundary(piece: str) -> bool:
    return "\n" in piece or piece.rstrip().endswith(_SENTENCE_ENDS)


def boundary_flags(pieces: Sequence[str]) -> np.ndarray:
    """Whether each piece ends a line or a sentence (where a segment may close)."""
    return np.fromiter(map(_is_boundary, pieces), dtype=bool, count=len(pieces))


class TokenBoundaries:
    """Boundary flags by token id, each token's piece tested once.

    The flag depends on the token id alone and the vocabulary never changes, while a 128K prompt
    has only some thousands of distinct tokens: decoding every token's piece in Python cost more
    than the rest of the selection together. Not thread-safe: one per compression thread.
    """

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._piece = piece
        self._known = np.zeros(0, dtype=bool)
        self._flags = np.zeros(0, dtype=bool)

    def __call__(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
        if ids.size == 0:
            return np.zeros(0, dtype=bool)
        if ids.min() < 0:
            raise ValueError(f"negative token id {int(ids.min())}")
        top = int(ids.max()) + 1
        if top > self._known.size:
            grow = top - self._known.size
            self._known = np.concatenate([self._known, np.zeros(grow, dtype=bool)])
            self._flags = np.concatenate([self._flags, np.zeros(grow, dtype=bool)])
        present = np.zeros(top, dtype=bool)
        present[ids] = True
        new = np.flatnonzero(present & ~self._known[:top])
        piece = self._piece
        self._flags[new] = [_is_boundary(piece(t).decode("utf-8", errors="replace")) for t in new.tolist()]
        self._known[new] = True
        return self._flags[ids]


def segment_tokens(pieces: list[str], min_len: int = 16, max_len: int = 128) -> list[Segment]:
    """Cut tokens into segments ending at line breaks or sentence ends; ``pieces[i]`` is the
    text of token i (see ``segment_at_boundaries``)."""
    return segment_at_boundaries(boundary_flags(pieces), min_len, max_len)


def segment_at_boundaries(boundary: np.ndarray, min_len: int = 16, max_len: int = 128) -> list[Segment]:
    """Cut tokens into segments, closing after the tokens flagged in ``boundary``.

    A segment closes at the first boundary once it has ``min_len`` tokens and is force-cut at
    ``max_len``, so segments are neither too fine to score meaningfully nor so coarse that one
    keep/drop decision costs a large part of the budget. A short tail joins the segment before
    it where that stays within ``max_len``. One step per segment, not per token.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    n = len(boundary)
    positions = [*np.flatnonzero(boundary).tolist(), sys.maxsize]  # a boundary past any prompt
    ends: list[int] = []
    start = k = 0
    while True:
        k = bisect.bisect_left(positions, start + min_len - 1, k)  # the first boundary at min_len or later
        close = min(positions[k], start + max_len - 1)
        if close >= n:
            break
        ends.append(close + 1)
        start = close + 1
    if start < n:
        if n - start < min_len and ends and n - (ends[-2] if len(ends) > 1 else 0) <= max_len:
            ends.pop()
        ends.append(n)
    return list(map(Segment, [0, *ends[:-1]], ends))


def fixed_segments(n_tokens: int, chunk: int) -> list[Segment]:
    """Equal chunks of ``chunk`` tokens (last one shorter), for when token texts are unavailable."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [Segment(s, min(s + chunk, n_tokens)) for s in range(0, n_tokens, chunk)]


@dataclass(frozen=True)
class KeepCurve:
    """Piecewise-linear keep ratio over prompt length.

    Longer prompts can afford a smaller fraction: the kept token count still
    grows, while prefill cost is what we are cutting.
    """

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("keep curve needs at least one length:ratio point")
        previous = None
        for length, ratio in self.points:
            if length < 1:
                raise ValueError(f"keep curve length must be >= 1, got {length}")
            if not 0.0 < ratio <= 1.0:
                raise ValueError(f"keep curve ratio must be in (0, 1], got {ratio} at length {length}")
            if previous is not None and length <= previous:
                raise ValueError(
                    f"keep curve lengths must be strictly increasing, got {length} after {previous}"
                )
            previous = length

    @classmethod
    def parse(cls, text: str) -> KeepCurve:
        """Parse ``"16000:0.5 40000:0.2"`` (whitespace- or comma-separated length:ratio pairs)."""
        points: list[tuple[int, float]] = []
        for item in re.split(r"[\s,]+", text.strip()):
            if not item:
                continue
            length_text, sep, ratio_text = item.partition(":")
            if not sep:
                raise ValueError(f"keep curve point {item!r} is not of the form length:ratio")
            try:
                length = int(length_text)
                ratio = float(ratio_text)
            except ValueError:
                raise ValueError(
                    f"keep curve point {item!r}: length must be an integer and ratio a number"
                ) from None
            if not math.isfinite(ratio):
                raise ValueError(f"keep curve point {item!r}: ratio must be finite")
            points.append((length, ratio))
        return cls(tuple(points))

    def ratio(self, n_tokens: int) -> float:
        """Keep ratio for a prompt of ``n_tokens``: clamped outside the points, linear between."""
        lengths = [length for length, _ in self.points]
        if n_tokens <= lengths[0]:
            return self.points[0][1]
        if n_tokens >= lengths[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(lengths, n_tokens)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (n_tokens - x0) / (x1 - x0)


def budget_for(n_tokens: int, keep_ratio: float) -> int:
    """Token budget floor(n_tokens * keep_ratio), at least 1 so something is always kept."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    return max(1, math.floor(n_tokens * keep_ratio))


@dataclass(frozen=True)
class Selection:
    """Kept token ranges, in source order, adjacent ranges merged."""

    kept: list[Segment]
    kept_tokens: int
    segments_total: int
    segments_kept: int

    def token_indices(self) -> list[int]:
        """Indices of the kept tokens in source order, i.e. what gets prefilled."""
        return list(chain.from_iterable(range(segment.start, segment.end) for segment in self.kept))

    def take(self, tokens: Sequence[int]) -> list[int]:
        """The kept ``tokens`` in source order (slices, not one Python step per token)."""
        return list(chain.from_iterable(tokens[segment.start : segment.end] for segment in self.kept))


def _merge(ranges: list[Segment]) -> list[Segment]:
    """Sort and merge overlapping or touching ranges."""
    merged: list[Segment] = []
    for segment in sorted(ranges, key=lambda s: (s.start, s.end)):
        if merged and segment.start <= merged[-1].end:
            if segment.end > merged[-1].end:
                merged[-1] = Segment(merged[-1].start, segment.end)
        else:
            merged.append(segment)
    return merged


def _bounds(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends of ``segments``, checked to tile [0, n) in order."""
    if not segments:
        raise ValueError("empty prompt: no segments to select from")
    starts = np.fromiter((s.start for s in segments), dtype=np.int64, count=len(segments))
    ends = np.fromiter((s.end for s in segments), dtype=np.int64, count=len(segments))
    follows = np.concatenate([[0], ends[:-1]])
    bad = np.flatnonzero((starts != follows) | (ends <= starts))
    if bad.size:
        k = int(bad[0])
        raise ValueError(
            "segments must be non-empty, contiguous and start at 0; "
            f"{segments[k]} follows position {int(follows[k])}"
        )
    return starts, ends


def _token_prefix(mass: Sequence[float], n_tokens: int) -> np.ndarray:
    """Prefix sums of the mass over [0, n_tokens] (tokens past the mass score 0), in float64."""
    values = np.asarray(mass, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"mass must be one score per token, got shape {values.shape}")
    if len(values) > n_tokens:
        raise ValueError(f"mass has {len(values)} entries but the prompt has {n_tokens} tokens")
    if not np.isfinite(values).all():
        raise ValueError("mass contains NaN or Inf; refusing to select on non-finite scores")
    prefix = np.zeros(n_tokens + 1)
    np.cumsum(values, out=prefix[1 : len(values) + 1])  # sequential: sums as exact as a loop's
    prefix[len(values) + 1 :] = prefix[len(values)]
    return prefix


def _candidates(starts: np.ndarray, n_tokens: int, covered: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """The parts of the segments outside the merged spans ``covered``, as starts and ends.

    Cutting at every segment start and every covered edge leaves pieces each wholly covered or
    wholly not; since merged spans never touch, no two uncovered pieces of one segment are adjacent.
    """
    span_starts = np.array([span.start for span in covered], dtype=np.int64)
    span_ends = np.array([span.end for span in covered], dtype=np.int64)
    cuts = np.union1d(np.append(starts, n_tokens), np.concatenate([span_starts, span_ends]))
    lo, hi = cuts[:-1], cuts[1:]
    k = np.searchsorted(span_starts, lo, side="right") - 1  # the last span starting at or before lo
    # k = -1 (no such span) reads the appended 0, and lo < 0 never holds
    inside = (k >= 0) & (lo < np.append(span_ends, 0)[k])
    return lo[~inside], hi[~inside]


def select(
    mass: Sequence[float],
    segments: list[Segment],
    budget: int,
    mandatory: list[Segment],
) -> Selection | None:
    """Keep the mandatory spans plus the highest-scoring segments that fit in ``budget`` tokens.

    ``segments`` must tile the prompt [0, n) in order. ``mass[i]`` scores token
    i; tokens past the end of ``mass`` score 0 (they are normally inside a
    mandatory span, e.g. the query). A segment partly covered by mandatory
    spans competes with its uncovered parts, each as its own candidate.
    Candidates are ranked by their mass (the sum over their tokens), ties to
    the earlier one, and taken greedily, skipping any that no longer fit:
    the budget is never exceeded. Returns None when the mandatory spans alone
    exceed the budget, meaning the prompt should not be compressed.
    """
    if budget <= 0:
        raise ValueError(f"budget must be >= 1, got {budget}")
    starts, ends = _bounds(segments)
    n_tokens = int(ends[-1])
    prefix = _token_prefix(mass, n_tokens)
    for span in mandatory:
        if not 0 <= span.start < span.end <= n_tokens:
            raise ValueError(f"mandatory span {span} is empty or outside the prompt [0, {n_tokens})")
    covered = _merge(list(mandatory))
    mandatory_tokens = sum(len(span) for span in covered)
    if mandatory_tokens > budget:
        return None

    lo, hi = _candidates(starts, n_tokens, covered)
    value = prefix[hi] - prefix[lo]
    order = np.lexsort((lo, -value))  # best first, ties to the earlier candidate
    remaining = budget - mandatory_tokens
    chosen: list[int] = []
    for k, length in zip(order.tolist(), (hi - lo)[order].tolist()):
        if length <= remaining:
            chosen.append(k)
            remaining -= length

    kept = _merge(covered + list(map(Segment, lo[chosen].tolist(), hi[chosen].tolist())))
    return Selection(
        kept=kept,
        kept_tokens=sum(len(span) for span in kept),
        segments_total=len(lo) + len(mandatory),
        segments_kept=len(chosen) + len(mandatory),
    )
