"""The order in which queued requests are offered a slot: a policy object over the scheduler's queue,
apart from the mechanism that places and starts them (scheduler.py).

The queue has two tiers: requests back from compression (`prepared`: they have waited for their
draft already) ahead of new arrivals (`waiting`). A policy decides where a request goes in its tier
when it is queued, where a request that lent its slot goes back (lending.py), and its rank: lower
ranks go first across both tiers, and lending never takes a slot from a request of a lower rank than
the borrower's. `SCHEDULE_POLICIES` names them (the server's `--schedule_policy`):

- `fcfs` (the default): arrival order. Requests that reach the engine in one round were ordered
  shortest prompt first already (step_policy.arrival_order); a lender goes back behind the queued
  requests with shorter prompts (it lends once, so nothing starves).
- `priority`: vLLM's `priority` field, lower values first, ties first come first served. Strict, as
  vLLM's: a steady stream of more urgent requests holds back a less urgent one for as long as it lasts.
- `shortest`: fewest tokens to prefill first (SGLang's shortest-prompt-first), ties first come first
  served. Unbounded, a steady stream of short prompts would hold back a long one for ever; here a
  request is passed by at most `max_passes` later arrivals, after which none goes ahead of it, so a
  long prompt waits for at most that many short ones beyond those queued when it came.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Iterator, Sequence

from .request import Request


class Fcfs:
    """First come first served, within ranks (here all 0)."""

    name = "fcfs"
    ranked = False  # every request has rank 0: each tier's order is the whole order

    def rank(self, request: Request) -> int:
        """Lower ranks go first, across both tiers."""
        return 0

    def add(self, queue: deque[Request], request: Request) -> None:
        """Queue a new arrival: behind every request of its rank or a lower one."""
        if not queue or self.rank(queue[-1]) <= self.rank(request):
            queue.append(request)  # O(1) where it goes last (always, but for a more urgent rank)
        else:
            queue.insert(self._first(queue, lambda other: self.rank(other) > self.rank(request)), request)

    def requeue(self, queue: deque[Request], request: Request) -> None:
        """Queue again a request that lent its slot: within its rank, ahead of the first request that
        has as many tokens to prefill (it gave way to a shorter one, not to every later arrival)."""
        rank, n = self.rank(request), len(request.prefill_tokens)
        at = self._first(queue, lambda other: self.rank(other) > rank
                         or (self.rank(other) == rank and len(other.prefill_tokens) >= n))
        queue.insert(at, request)

    def forget(self, request: Request) -> None:
        """The request left the queue (admitted, finished)."""

    @staticmethod
    def _first(queue: Sequence[Request], after: Callable[[Request], bool]) -> int:
        return next((at for at, other in enumerate(queue) if after(other)), len(queue))


class Priority(Fcfs):
    """vLLM's priority scheduling: lower `Request.priority` first, ties first come first served."""

    name = "priority"
    ranked = True

    def rank(self, request: Request) -> int:
        return request.priority


class ShortestFirst(Fcfs):
    """Fewest tokens to prefill first, ties first come first served; a request passed by
    `max_passes` later arrivals is passed by no more."""

    name = "shortest"

    def __init__(self, max_passes: int = 16) -> None:
        self.max_passes = max_passes
        self._passes: dict[int, int] = {}  # request_id -> later arrivals queued ahead of it

    def add(self, queue: deque[Request], request: Request) -> None:
        n, passes = len(request.prefill_tokens), self._passes
        # behind the last request passed as often as allowed, then ahead of the first longer one
        ripe = max((k for k, other in enumerate(queue) if passes.get(other.request_id, 0) >= self.max_passes),
                   default=-1)
        at = next((k for k in range(ripe + 1, len(queue)) if len(queue[k].prefill_tokens) > n), len(queue))
        for other in list(queue)[at:]:
            passes[other.request_id] = passes.get(other.request_id, 0) + 1
        queue.insert(at, request)

    def requeue(self, queue: deque[Request], request: Request) -> None:
        self.add(queue, request)

    def forget(self, request: Request) -> None:
        self._passes.pop(request.request_id, None)


AdmissionPolicy = Fcfs  # the interface: a policy is Fcfs or overrides its methods
SCHEDULE_POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    "fcfs": Fcfs, "priority": Priority, "shortest": ShortestFirst}


class RequestQueue:
    """The requests waiting for a slot, in the two tiers, ordered by the policy."""

    def __init__(self, policy: AdmissionPolicy | None = None) -> None:
        self.policy = policy or Fcfs()
        self.prepared: deque[Request] = deque()  # back from compression: ahead of new arrivals of their rank
        self.waiting: deque[Request] = deque()  # new arrivals

    def __len__(self) -> int:
        return len(self.prepared) + len(self.waiting)

    def add(self, request: Request, prepared: bool = False) -> None:
        self.policy.add(self.prepared if prepared else self.waiting, request)

    def requeue(self, request: Request) -> None:
        """A request back from a slot it lent (its tier: prepared if it came back from compression)."""
        self.policy.requeue(self.prepared if request.timings.resumed is not None else self.waiting, request)

    def remove(self, request: Request) -> None:
        for queue in (self.prepared, self.waiting):
            if request in queue:
                queue.remove(request)
                self.policy.forget(request)

    def entries(self) -> Iterator[tuple[deque[Request], int]]:
        """Every queued request as its queue and place there, in the order admission offers slots:
        by rank, then prepared ahead of waiting, then each tier's order."""
        tiers = [_places(self.prepared), _places(self.waiting)]
        if not self.policy.ranked:  # admission asks this at every step
            for tier in tiers:
                yield from tier
            return
        # each tier is kept in rank order: merged lazily (ties: the earlier tier first), admission
        # mostly takes the first
        rank = self.policy.rank
        yield from heapq.merge(*tiers, key=lambda entry: rank(entry[0][entry[1]]))

    def take(self, queue: deque[Request], at: int) -> Request:
        """Remove the request at `at` of `queue` (one `entries` gave) to start it."""
        request = queue[at]
        del queue[at]
        self.policy.forget(request)
        return request


def _places(queue: deque[Request]) -> Iterator[tuple[deque[Request], int]]:
    return ((queue, at) for at in range(len(queue)))
