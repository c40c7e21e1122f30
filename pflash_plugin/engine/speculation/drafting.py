"""The engine's side of speculation: which decode rows draft how many tokens this step (policy.py),
the drafts from the proposer, and what the verification said, measured (stats, the policy's
acceptance and step cost). Steps (engine/steps.py) asks it for each step's drafts; the runner's
sampling verifies them (engine/sampling.py); the scheduler takes the accepted tokens.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, overload

from ..request import Request, TokenOutput
from ..stats import SpeculationStats
from .policy import SpeculationPolicy
from .proposer import DraftRow, Proposer


class Item(Protocol):
    """A step's row as speculation reads it (steps.BatchItem; steps imports this package, not back)."""

    @property
    def request(self) -> Request: ...
    @property
    def wants_logits(self) -> bool: ...
    @property
    def drafts(self) -> int: ...


class Step(Protocol):
    """A step as speculation reads it (steps.Step)."""

    @property
    def items(self) -> Sequence[Item]: ...
    @property
    def n_tokens(self) -> int: ...


class Joined(Sequence[int]):
    """A request's prompt as prefilled then its output, without copying either (a 32K prompt
    would be copied every step)."""

    def __init__(self, head: Sequence[int], tail: Sequence[int]) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    @overload
    def __getitem__(self, at: int) -> int: ...
    @overload
    def __getitem__(self, at: slice) -> list[int]: ...
    def __getitem__(self, at: int | slice) -> int | list[int]:
        n = len(self.head)
        if isinstance(at, slice):
            start, stop, step = at.indices(len(self))
            assert step == 1, "contiguous slices only"
            return [*self.head[start:min(stop, n)], *self.tail[max(start - n, 0):max(stop - n, 0)]]
        at = at + len(self) if at < 0 else at
        return self.head[at] if at < n else self.tail[at - n]

    def __iter__(self) -> Iterator[int]:
        yield from self.head
        yield from self.tail


@dataclass
class _Counts:
    drafted: int = 0
    accepted: int = 0
    rows: int = 0  # decode rows verified (speculating or not)
    tokens: int = 0  # tokens those rows took (1 + accepted each)
    speculating: int = 0  # rows that carried drafts


class Speculation:
    """Drafts for a step's decode rows, where they pay (SpeculationPolicy) and the row may speculate
    (`eligible`: the runner's sampling path verifies it; the request did not turn it off)."""

    def __init__(self, proposer: Proposer, policy: SpeculationPolicy, eligible: Callable[[Request], bool],
                 max_step_drafts: int, clock: Callable[[], float] = time.perf_counter) -> None:
        """`max_step_drafts`: draft tokens in one step at most (the context's spare output rows)."""
        self.proposer, self.policy, self.eligible = proposer, policy, eligible
        self.max_step_drafts, self.clock = max_step_drafts, clock
        self.counts = _Counts()
        self._keys: set[int] = set()
        self._step: tuple[float, int] | None = None  # a decode-only step's start and tokens

    def drafts(self, running: Sequence[Request], decode: Sequence[Request], room: int) -> dict[int, list[int]]:
        """Per request id, the draft tokens its decode row carries this step (none: not listed);
        `room`: tokens the step may still take."""
        self._forget_departed(running)
        room, rows = min(room, self.max_step_drafts), len(decode)
        self.policy.drafting = self.proposer.draft_cost()
        wanted: list[DraftRow] = []
        for request in decode:
            k = min(self.policy.draft_tokens(request.request_id, rows), room,
                    request.params.max_tokens - len(request.output_tokens) - 1)
            if k > 0 and self._may_draft(request):
                wanted.append(DraftRow(request.request_id, Joined(request.prefill_tokens, request.output_tokens), k))
                self._keys.add(request.request_id)
                room -= k
        proposed = self.proposer.propose(wanted) if wanted else []
        return {row.key: list(draft[:row.k]) for row, draft in zip(wanted, proposed) if draft}

    def _may_draft(self, request: Request) -> bool:
        """The request allows drafts, its sampling path verifies them, and the proposer can read
        its tokens (a draft model cannot decode media pseudo-tokens: Proposer.reads_media)."""
        return (request.params.speculative and request.thinking is None and self.eligible(request)
                and (self.proposer.reads_media or not request.media))

    def started(self, step: Step) -> None:
        """The step is about to run: timed if it only decodes (the policy's step cost)."""
        only_decode = all(item.request.output_tokens and item.wants_logits for item in step.items)
        self._step = (self.clock(), step.n_tokens) if step.items and only_decode else None

    def verified(self, step: Step, outputs: Mapping[int, TokenOutput | Exception]) -> None:
        """The step's rows were sampled: acceptance and the step's cost measured."""
        if self._step is not None:
            start, tokens = self._step
            self.policy.cost.observe(tokens, self.clock() - start)
            self._step = None
        counts = self.counts
        decoding = [item for item in step.items if item.request.output_tokens]
        learn = len(decoding) <= self.policy.max_rows  # beyond, no row drafts: 128 rows cost no bookkeeping
        for item in decoding:
            out = outputs.get(item.request.request_id)
            accepted = len(out.accepted) if isinstance(out, TokenOutput) else 0
            if learn:
                self._keys.add(item.request.request_id)
                self.policy.drafted(item.request.request_id, item.drafts, accepted)
            counts.rows += 1
            counts.tokens += 1 + accepted
            if item.drafts:
                counts.speculating += 1
                counts.drafted += item.drafts
                counts.accepted += accepted

    def close(self) -> None:
        """Free the proposer's state (a draft model's context and weights); the engine has stopped."""
        self.proposer.close()

    def stats(self) -> SpeculationStats:
        c = self.counts
        return SpeculationStats(c.drafted, c.accepted, c.rows, c.tokens, c.speculating)

    def _forget_departed(self, running: Sequence[Request]) -> None:
        live = {r.request_id for r in running}
        for key in self._keys - live:
            self.proposer.forget(key)
            self.policy.forget(key)
        self._keys &= live
