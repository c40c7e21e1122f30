"""Where the question sits in a prompt: the tokens that score, and the spans that must survive."""
from __future__ import annotations

from dataclasses import dataclass

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
        kept = set()
        for span in self.mandatory(n_tokens):
            kept.update(range(span.start, span.end))
        return len(kept) <= budget


def locate_text(pieces: list[bytes], text: str, before: int | None = None) -> tuple[int, int] | None:
    """Token range covering the last occurrence of `text` in the detokenized prompt."""
    needle = text.encode("utf-8")
    if not needle:
        return None
    joined = b"".join(pieces)
    at = joined.rfind(needle, 0, before if before is not None else len(joined))
    if at < 0:
        return None
    end_byte = at + len(needle)
    start = end = None
    offset = 0
    for i, piece in enumerate(pieces):
        if start is None and offset + len(piece) > at:
            start = i
        offset += len(piece)
        if offset >= end_byte:
            end = i + 1
            break
    return (start, end) if start is not None and end is not None else None


def plan_query(
    pieces: list[bytes],
    n_query: int,
    *,
    last_user: str | None = None,
    system: str | None = None,
    explicit: list[int] | None = None,
    min_head: int = 1,
) -> QueryPlan:
    """The query is the last `n_query` tokens of the final user message when it can be found in
    the rendered prompt (chat), else of the prompt itself (completions); an explicit query is
    appended after the prompt instead. The head is the system prompt when found, else `min_head`
    tokens (the BOS and the prompt's first words)."""
    n = len(pieces)
    head_end = min(min_head, n)
    if system:
        span = locate_text(pieces, system)
        if span:
            head_end = max(head_end, span[1])
    if explicit:
        return QueryPlan(n, n + len(explicit), head_end, tuple(explicit))
    end = n
    if last_user:
        span = locate_text(pieces, last_user.rstrip())
        if span:
            end = span[1]
    start = max(head_end, end - n_query, 1)
    return QueryPlan(start, max(end, start + 1), head_end)
