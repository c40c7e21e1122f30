"""A reasoning budget (Anthropic's `thinking.budget_tokens`, llama-server's `--reasoning-budget`):
a request whose answer starts inside a thinking block may think for so many tokens; past them,
while the block is still open, the block's closing tag is written for it, one token a step in place
of the token it sampled, and the model answers from there (llama.cpp's common/reasoning-budget.cpp
does the same inside its sampler).

The engine knows nothing of templates: the server says, per request, how many tokens the thinking
may take, the closing tag's text (to see the model close the block itself) and the tokens written
in its place (the tag and what the template puts after it).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .text_stream import StopMatcher


@dataclass(frozen=True)
class ReasoningBudget:
    tokens: int  # the thinking's tokens at most (0: the block is closed at once)
    close: str  # the closing tag, as the model writes it ("</think>")
    close_tokens: tuple[int, ...]  # what is written in its place when the budget runs out


@dataclass
class Thinking:
    """One request's thinking: its budget, whether the block closed, the closing tokens still to write."""

    budget: ReasoningBudget
    matcher: StopMatcher = field(init=False)
    closed: bool = False
    spent: int = 0  # tokens taken while the block was open
    forced: deque[int] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.matcher = StopMatcher(self.budget.close)

    def next_token(self, sampled: int, piece: Callable[[int], bytes]) -> int:
        """The token the request takes: `sampled`, or the closing tag's next token (and what
        follows it) once the thinking has spent its budget with the block still open."""
        if not self.forced and not self.closed and self.spent >= self.budget.tokens:
            self.forced.extend(self.budget.close_tokens)
        token = self.forced.popleft() if self.forced else sampled
        if not self.closed:
            self.spent += 1
            # ASCII tags (</think>, [/THINK]): a piece cut inside a UTF-8 character cannot hold one
            self.closed = self.matcher.feed(piece(token).decode("utf-8", errors="ignore"))
        return token
