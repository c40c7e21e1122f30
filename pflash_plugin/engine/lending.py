"""Slot lending: which queued request may take the slot of a running prompt that has not prefilled
into it yet, a rule apart from the scheduler's mechanism (which says which running prompts could give
their slot back at no loss, then moves the two).

Where no slot is free, a queued request may take the slot of a prompt at least twice as long that has
held it through a step without prefilling into it, even behind a longer one queued ahead of it (which
could not take that slot): little is lost, and a short chat sent with long prompts need not wait
behind all of them (long prompts prefill one at a time, so those that arrived a round ahead of a
short chat sit in slots they have not used yet). Of the possible lenders, the one with the most
prefill left that reuses there no more cached tokens than the borrower has (the borrower may drop
them: at most what it prefills itself is lost) lends; each prompt lends once, and never to a request
the admission policy ranks below it (admission.py). The scheduler lends only where each slot has its
own KV stream: a slot then fits any admissible request, so the lending is never in vain.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from .request import Request

Entry = tuple[deque[Request], int]  # a queued request as its queue and place there (RequestQueue.entries)


class SlotLending:
    """The rule, with the requests that have lent already (once each) and the admission policy's
    rank (lower goes first)."""

    def __init__(self, rank: Callable[[Request], int] = lambda request: 0) -> None:
        self.rank = rank
        self._lent: set[int] = set()

    def loan(self, idle: Iterable[Request], queued: Iterable[Entry],
             waits: Callable[[Request], bool]) -> tuple[deque[Request], int, Request] | None:
        """The first queued request (in admission order) that a running prompt lends its slot to, as
        its queue and place there, and that prompt; None if there is none. `idle`: the running
        prompts that could give their slot back at no loss (nothing prefilled into it, through a
        step); `waits`: a queued request that waits for another's prefill takes no slot."""
        lenders = [r for r in idle if r.request_id not in self._lent]
        if not lenders:
            return None
        most_left = max((r.prefill_left for r in lenders), default=0)
        for queue, at in queued:
            borrower = queue[at]
            n = len(borrower.prefill_tokens)
            if 2 * n > most_left or waits(borrower):
                continue
            lender = max((r for r in lenders if r.cached_tokens <= n and r.prefill_left >= 2 * n
                          and self.rank(r) >= self.rank(borrower)),
                         key=lambda r: r.prefill_left, default=None)
            if lender is not None:
                return queue, at, lender
        return None

    def lent(self, request: Request) -> None:
        """`request` gave its slot away: it lends no more."""
        self._lent.add(request.request_id)

    def forget(self, request: Request) -> None:
        """`request` ended."""
        self._lent.discard(request.request_id)
