"""Which queued request waits for whose prefill, so that a prompt is prefilled once.

The n choices of one prompt, requests sent together with one document or system prompt, the n
samples of one PFlash kept prompt: each would prefill the same tokens beside the others, where the
prefix cache (prefix_cache.py) could give them the first one's cells once they are written (shared
in place in one KV pool, a whole stream copied across per-slot streams). So a queued request whose
prefix a running request is still prefilling waits for that prefill, then takes a slot and reuses
the prefix from it (vLLM's parallel sampling and llama-server's `n_cmpl` prefill once too).

It waits only where that saves enough: at least `min_tokens` more than the KV holds for it
outside the slots still prefilling, and at least half of what it would prefill alone (a short
request that shares a few tokens with a long prompt starts at once, shortest first beside it). A
leader that ends early (finished, cancelled, failed), or goes back to the queue (it lent its slot),
is no longer prefilling: whoever waited for it proceeds on its own, reusing what it left cached.

Pure Python over the requests and the prefix cache, apart from the Scheduler's mechanism
(admission asks it before it places or lends a slot to a queued request).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

from .prefix_cache import PrefixCache
from .prefixes import reusable
from .request import Request, RequestStatus


class PrefillSharing:
    """The rule over the scheduler's prefix cache, with its threshold (SchedulerConfig.share_prefill_tokens;
    None: off)."""

    def __init__(self, cache: PrefixCache, min_tokens: int | None = 64) -> None:
        self.cache, self.min_tokens = cache, min_tokens

    def leader(self, request: Request, running: Sequence[Request]) -> Request | None:
        """The running request whose prefill `request` waits for: of those still prefilling a prefix
        of `request`'s prompt, the one that will hold the longest; None to start now. The gain is
        counted over what the KV holds outside the slots still prefilling, so the answer does not
        change as the leader's prefill advances."""
        if self.min_tokens is None:
            return None
        tokens = request.prefill_tokens
        best, shared = None, 0
        for other in running:
            if other.status is RequestStatus.PREFILLING:
                n = reusable(other.prefill_tokens, tokens)
                if n > max(shared, other.n_prefilled):
                    best, shared = other, n
        if best is None:
            return None
        now = self.cache.cached_prefix(tokens, settled=True)
        gain = shared - now
        return best if gain >= self.min_tokens and 2 * gain >= len(tokens) - now else None

    def waits(self, request: Request, running: Sequence[Request]) -> bool:
        return self.leader(request, running) is not None

    def first(self, running: Sequence[Request],
              entries: Iterable[tuple[deque[Request], int]]) -> tuple[deque[Request], int] | None:
        """The first queued request, in admission order (`entries`: RequestQueue.entries), that waits
        for no other's prefill, as its queue and place there; None if there is none."""
        for queue, at in entries:
            if not self.waits(queue[at], running):
                return queue, at
        return None
