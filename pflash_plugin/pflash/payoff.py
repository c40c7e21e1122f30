"""Whether compression pays on this model: decided from a start-up measurement, not assumed.

On a small model or a fast GPU a full prefill can cost as little as drafting the prompt (the demo
model on an H200: 0.9 s for 32K tokens either way); there `--pflash auto` should not compress.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    """Time to first token of one prompt of `tokens` tokens, prefilled in full and with PFlash."""

    tokens: int
    full_s: float
    pflash_s: float

    @property
    def speedup(self) -> float:
        return self.full_s / self.pflash_s

    def describe(self) -> str:
        return (f"at {self.tokens:,} tokens PFlash took {self.pflash_s:.2f} s against {self.full_s:.2f} s "
                f"for a full prefill ({self.speedup:.2f}x)")


def effective_threshold(threshold: int, calibration: Calibration | None, min_speedup: float) -> int:
    """The prompt length above which `auto` compresses. Where PFlash did not win by `min_speedup` at
    the measured length, it is not used up to that length (longer prompts, whose full prefill grows
    faster than their draft, keep it)."""
    if calibration is None or calibration.speedup >= min_speedup:
        return threshold
    return max(threshold, calibration.tokens)
