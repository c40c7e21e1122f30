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
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "KeepCurve",
    "Segment",
    "Selection",
    "budget_for",
    "fixed_segments",
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


def segment_tokens(pieces: list[str], min_len: int = 16, max_len: int = 128) -> list[Segment]:
    """Cut tokens into segments ending at line breaks or sentence ends.

    ``pieces[i]`` is the text of token i. A segment closes at the first
    boundary once it has ``min_len`` tokens and is force-cut at ``max_len``,
    so segments are neither too fine to score meaningfully nor so coarse that
    one keep/drop decision costs a large part of the budget.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    segments: list[Segment] = []
    start = 0
    for i, piece in enumerate(pieces):
        length = i + 1 - start
        if length >= max_len or (length >= min_len and _is_boundary(piece)):
            segments.append(Segment(start, i + 1))
            start = i + 1
    if start < len(pieces):
        tail = Segment(start, len(pieces))
        if len(tail) < min_len and segments and tail.end - segments[-1].start <= max_len:
            tail = Segment(segments.pop().start, tail.end)
        segments.append(tail)
    return segments


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
        return [i for segment in self.kept for i in range(segment.start, segment.end)]


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


def _uncovered(segment: Segment, covered: list[Segment]) -> list[Segment]:
    """Parts of ``segment`` outside the merged, sorted ranges ``covered``."""
    parts: list[Segment] = []
    position = segment.start
    for span in covered:
        if span.end <= position:
            continue
        if span.start >= segment.end:
            break
        if span.start > position:
            parts.append(Segment(position, span.start))
        position = max(position, span.end)
        if position >= segment.end:
            break
    if position < segment.end:
        parts.append(Segment(position, segment.end))
    return parts


def select(
    mass: Sequence[float],
    segments: list[Segment],
    budget: int,
    mandatory: list[Segment],
    score: str = "sum",
) -> Selection | None:
    """Keep the mandatory spans plus the highest-scoring segments that fit in ``budget`` tokens.

    ``segments`` must tile the prompt [0, n) in order. ``mass[i]`` scores token
    i; tokens past the end of ``mass`` score 0 (they are normally inside a
    mandatory span, e.g. the query). A segment partly covered by mandatory
    spans competes with its uncovered parts, each as its own candidate.
    Candidates are ranked by ``score`` ("sum" or "density" = mean mass), ties
    to the earlier one, and taken greedily, skipping any that no longer fit:
    the budget is never exceeded. Returns None when the mandatory spans alone
    exceed the budget, meaning the prompt should not be compressed.
    """
    if score not in ("sum", "density"):
        raise ValueError(f"score must be 'sum' or 'density', got {score!r}")
    if budget <= 0:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if not segments:
        raise ValueError("empty prompt: no segments to select from")
    position = 0
    for segment in segments:
        if segment.start != position or segment.end <= segment.start:
            raise ValueError(
                "segments must be non-empty, contiguous and start at 0; "
                f"{segment} follows position {position}"
            )
        position = segment.end
    n_tokens = position

    values = [float(x) for x in (mass.tolist() if hasattr(mass, "tolist") else mass)]
    if len(values) > n_tokens:
        raise ValueError(f"mass has {len(values)} entries but the prompt has {n_tokens} tokens")
    if not all(math.isfinite(x) for x in values):
        raise ValueError("mass contains NaN or Inf; refusing to select on non-finite scores")
    prefix = [0.0]
    for x in values:
        prefix.append(prefix[-1] + x)

    def segment_mass(segment: Segment) -> float:
        end = min(segment.end, len(values))
        return prefix[end] - prefix[segment.start] if end > segment.start else 0.0

    for span in mandatory:
        if not 0 <= span.start < span.end <= n_tokens:
            raise ValueError(f"mandatory span {span} is empty or outside the prompt [0, {n_tokens})")
    covered = _merge(list(mandatory))
    mandatory_tokens = sum(len(span) for span in covered)
    if mandatory_tokens > budget:
        return None

    candidates = [part for segment in segments for part in _uncovered(segment, covered)]

    def rank_key(candidate: Segment) -> tuple[float, int]:
        value = segment_mass(candidate)
        if score == "density":
            value /= len(candidate)
        return (-value, candidate.start)

    remaining = budget - mandatory_tokens
    chosen: list[Segment] = []
    for candidate in sorted(candidates, key=rank_key):
        if len(candidate) <= remaining:
            chosen.append(candidate)
            remaining -= len(candidate)

    kept = _merge(covered + chosen)
    return Selection(
        kept=kept,
        kept_tokens=sum(len(span) for span in kept),
        segments_total=len(candidates) + len(mandatory),
        segments_kept=len(chosen) + len(mandatory),
    )
