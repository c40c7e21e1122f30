"""Windowed drafting: which tokens the drafter decodes together, so that its cost grows linearly.

A causal draft attends every token to all before it: its cost, and the KQ mask llama.cpp builds on
the host for each ubatch, grow with the square of the prompt. A windowed draft decodes the prompt
as windows of `window` tokens that attend only to themselves and to a sink: the prompt's first
`sink` tokens, drafted once and kept in the KV. Positions stay the true ones, and every token is
decoded exactly once and in order, so the scorer captures the same rows as in a causal draft; only
the hidden states (hence Q and K) are approximated. Windows are aligned to the end of the draft,
so that the query sits in the last window with as much context before it as a window allows.
"""
from __future__ import annotations

from dataclasses import dataclass

# at ubatch 512 on an H200 (plain llama.cpp, issue 12), 2048 drafted 64K-128K faster than 4096 and 8192;
# the quality gate (docs/pflash_gpu.md) measured this value
DEFAULT_WINDOW = 2048


@dataclass(frozen=True)
class Stage:
    """Tokens [start, end) decoded after the cells of the previous stage are dropped (but the sink)."""

    start: int
    end: int


@dataclass(frozen=True)
class DraftWindows:
    window: int = 0  # tokens per window; 0: every prompt in one causal pass
    sink: int = 64  # first tokens every window attends to
    causal_max: int = 16384  # prompts up to this many tokens are drafted in one causal pass

    @classmethod
    def default(cls, sink: int, causal_max: int, max_tokens: int) -> "DraftWindows":
        """DEFAULT_WINDOW where prompts can be longer than the sink and a window, else causal."""
        return cls(DEFAULT_WINDOW if sink + DEFAULT_WINDOW < max_tokens else 0, sink, causal_max)

    def check(self, n_batch: int, max_tokens: int) -> None:
        """Refuse windows that cannot work with the drafter's chunks and context (at start)."""
        if self.window < 0 or self.sink < 0 or self.causal_max < 0:
            raise ValueError("pflash_drafter_window, pflash_drafter_sink and pflash_drafter_causal_max must be >= 0")
        if self.window == 0:
            return
        if self.sink + self.window < n_batch:  # sink + window in one ubatch is the most a window takes
            raise ValueError(
                f"pflash_drafter_window {self.window} is below the drafter's ubatch ({n_batch} tokens) less the "
                f"sink ({self.sink}): use at least {n_batch - self.sink}, or 0 for one causal pass"
            )
        if self.sink + self.window > max_tokens:
            raise ValueError(
                f"pflash_drafter_sink + pflash_drafter_window ({self.sink} + {self.window}) exceed the longest "
                f"prompt the drafter takes ({max_tokens} tokens): windows would never apply; use 0 for one causal pass"
            )

    def windowed(self, n_tokens: int) -> bool:
        return self.window > 0 and n_tokens > max(self.causal_max, self.sink + self.window)

    def context_tokens(self, max_tokens: int) -> int:
        """KV cells the drafter's context needs for prompts up to `max_tokens`."""
        if self.window == 0:
            return max_tokens
        return min(max_tokens, max(self.causal_max, self.sink + self.window))

    def stages(self, n_tokens: int) -> list[Stage]:
        """The stages of a draft of `n_tokens`: one for a causal draft; else the sink with the first
        (shorter) window, then whole windows ending at `n_tokens`."""
        if not self.windowed(n_tokens):
            return [Stage(0, n_tokens)]
        starts = list(range(n_tokens - self.window, self.sink, -self.window))[::-1]
        bounds = [0, *starts, n_tokens]
        return [Stage(a, b) for a, b in zip(bounds, bounds[1:])]
