"""Where the question sits in a prompt: the tokens that score, and the spans that must survive."""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

from .selection import Segment


@dataclass(frozen=True)
class QueryPlan:
    """Token ranges of a prompt for PFlash.

    `query` scores everything before it. `head` (system prompt, template prefix) and everything
    from `query.start` on are kept whatever their score.
    """

    query_start: int
    query_end: int
    head_end: int
    extra_query: tuple[int, ...] = ()  # query tokens appended after the prompt (explicit query)

    def mandatory(self, n_tokens: int) -> list[Segment]:
        """The spans kept whatever their score: the head, and the query with all after it (none
        when the query is appended after the prompt)."""
        spans = [Segment(0, min(self.head_end, n_tokens)), Segment(min(self.query_start, n_tokens), n_tokens)]
        return [s for s in spans if len(s)]

    def fits(self, n_tokens: int, budget: int) -> bool:
        """Whether compressing can help: the mandatory spans alone must fit in the budget."""
        kept: set[int] = set()
        for span in self.mandatory(n_tokens):
            kept.update(range(span.start, span.end))
        return len(kept) <= budget


class PromptBytes:
    """The detokenized prompt, joined in blocks of tokens whose byte ends are kept: a token's byte
    offset is then a bisection over blocks and a scan of one block, not a Python step per token of
    the prompt (12-16 ms at 128K tokens)."""

    BLOCK = 256

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        blocks = [b"".join(pieces[i : i + self.BLOCK]) for i in range(0, len(pieces), self.BLOCK)]
        self.joined = b"".join(blocks)
        self.block_ends = list(accumulate(map(len, blocks)))

    def locate(self, text: str) -> tuple[int, int] | None:
        """Token range covering the last occurrence of `text`: from the first token ending past
        the match's first byte through the first reaching its last."""
        needle = text.encode("utf-8")
        at = self.joined.rfind(needle) if needle else -1
        if at < 0:
            return None
        return self._token_ending(at, bisect_right), self._token_ending(at + len(needle), bisect_left) + 1

    def _token_ending(self, byte: int, bisect: Callable[[list[int], int], int]) -> int:
        """The first token whose end is past `byte` (bisect_right) or at or past it (bisect_left)."""
        block = bisect(self.block_ends, byte)
        first = block * self.BLOCK
        before = self.block_ends[block - 1] if block else 0
        ends = list(accumulate(map(len, self.pieces[first : first + self.BLOCK]), initial=before))
        return first + bisect(ends, byte) - 1


def plan_query(
    n: int,
    n_query: int,
    *,
    pieces: list[bytes] | None = None,
    last_user: str | None = None,
    system: str | None = None,
    explicit: list[int] | None = None,
    min_head: int = 1,
) -> QueryPlan:
    """The query is the last `n_query` tokens of the final user message when it can be found in
    the rendered prompt (chat), else of the prompt itself (completions); an explicit query is
    appended after the prompt instead. The head is the system prompt when found, else `min_head`
    tokens (the BOS and the prompt's first words). `pieces`, the bytes of the prompt's `n` tokens,
    are read only to find the system prompt and the last user message: a completion's plan needs
    none (reading them is ~1 ms a 22K-token prompt on the request's thread)."""
    if pieces is not None and len(pieces) != n:
        raise ValueError(f"{len(pieces)} pieces for a prompt of {n} tokens")
    head_end = min(min_head, n)
    text = PromptBytes(pieces) if pieces is not None and (system or last_user) else None
    if system and text:
        span = text.locate(system)
        if span:
            head_end = max(head_end, span[1])
    if explicit:
        return QueryPlan(n, n + len(explicit), head_end, tuple(explicit))
    end = n
    if last_user and text:
        span = text.locate(last_user.rstrip())
        if span:
            end = span[1]
    start = max(head_end, end - n_query, 1)
    return QueryPlan(start, max(end, start + 1), head_end)
