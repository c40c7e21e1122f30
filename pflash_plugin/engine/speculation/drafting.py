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
        if proposer.cheap:
            policy.budget.shadowing()
        self._keys: set[int] = set()  # requests the proposer or the policy may hold state for
        self._plan = (0, 0)  # the composed step's decode rows and its tokens (theirs and their drafts')
        self._proposing = 0.0  # seconds the proposer took for the composed step's drafts
        self._shadows: dict[int, int] = {}  # request id -> the token a cheap proposer would have drafted
        self._turn = 0  # the row whose shadow token the next refused step asks for (one row a step, in turn)
        self._step: tuple[float, bool] | None = None  # the step's start, and whether it only decodes

    def drafts(self, running: Sequence[Request], decode: Sequence[Request], room: int,
               prefill: bool = False) -> dict[int, list[int]]:
        """Per request id, the draft tokens its decode row carries this step (none: not listed);
        `room`: tokens the step may still take; `prefill`: the step carries prefill chunks too (no
        drafts: such a step's time says nothing of what drafts cost, DraftBudget could not judge
        them). A step the policy leaves inactive (more rows than `max_rows`) costs no work per row: no
        proposer call, no bookkeeping; one the budget refuses asks a cheap proposer for a shadow token
        for one row (`_shadow`)."""
        if self._keys:
            self._forget_departed(running)
        rows = len(decode)
        self._plan = (rows, rows)
        self._proposing = 0.0
        if self._shadows:
            self._shadows = {}
        if prefill or not self.policy.active(rows):
            return {}
        most = self.policy.budget.allows(rows)
        if not most:
            if self.proposer.cheap:
                self._shadow(decode)
            return {}
        drafts = self._wanted(decode, min(room, self.max_step_drafts), most)
        self._plan = (rows, rows + sum(map(len, drafts.values())))
        return drafts

    def _wanted(self, decode: Sequence[Request], room: int, most: int) -> dict[int, list[int]]:
        """The proposer's drafts for the rows the policy lets draft, `most` tokens a row and `room`
        in all at most."""
        rows = len(decode)
        self.policy.drafting = self.proposer.draft_cost()
        price = self.policy.price(rows)
        wanted: list[DraftRow] = []
        for request in decode:
            k = min(self.policy.draft_tokens(request.request_id, rows, price), most, room,
                    request.params.max_tokens - len(request.output_tokens) - 1)
            if k > 0 and self._may_draft(request):
                wanted.append(DraftRow(request.request_id, Joined(request.prefill_tokens, request.output_tokens), k))
                self._keys.add(request.request_id)
                room -= k
        if not wanted:
            return {}
        start = self.clock()
        proposed = self.proposer.propose(wanted)
        self._proposing = self.clock() - start
        return {row.key: list(draft[:row.k]) for row, draft in zip(wanted, proposed) if draft}

    def _shadow(self, decode: Sequence[Request]) -> None:
        """A step that does not draft: a cheap proposer's next token for one of its rows (each in
        turn; a lookup is ~8 us a row, 4 rows a step cost 35 us at 16 rows), checked against the
        target's choice in `verified` (DraftBudget.shadowed): whether drafts would be accepted,
        measured at no cost to the step (where nothing would be, as with random weights, no probe
        is ever paid for)."""
        if not decode:
            return
        request = decode[self._turn % len(decode)]
        self._turn += 1
        if not self._may_draft(request):
            return
        draft = self.proposer.propose([DraftRow(request.request_id,
                                                Joined(request.prefill_tokens, request.output_tokens), 1)])[0]
        self._keys.add(request.request_id)
        if draft:
            self._shadows[request.request_id] = draft[0]

    def _may_draft(self, request: Request) -> bool:
        """The request allows drafts, its sampling path verifies them, and the proposer can read
        its tokens (a draft model cannot decode media pseudo-tokens: Proposer.reads_media)."""
        return (request.params.speculative and request.thinking is None and self.eligible(request)
                and (self.proposer.reads_media or not request.media))

    def started(self, step: Step) -> None:
        """The step is about to run: timed (the budget counts every step's time; one that only
        decodes also feeds the policy's step cost); the plan of `drafts` says whether it only
        decodes (every item a decode row) without a pass over the rows."""
        rows, _ = self._plan
        self._step = (self.clock(), bool(rows) and len(step.items) == rows)

    def verified(self, step: Step, outputs: Mapping[int, TokenOutput | Exception]) -> None:
        """The step's rows were sampled: acceptance and the step's cost measured."""
        seconds, decoding = self._timed()
        counts, (rows, tokens) = self.counts, self._plan
        if decoding:
            self.policy.cost.observe(tokens, seconds)
        if tokens == rows:  # no row drafted: the counts alone, no pass over the rows (128, or 16 refused)
            active = self.policy.active(rows)
            if active:
                self.policy.stepped(False)
            self.policy.budget.observe(rows, seconds, track=decoding and active)
            if self._shadows:
                hits = sum(isinstance(out := outputs.get(key), TokenOutput) and out.token == token
                           for key, token in self._shadows.items())
                self.policy.budget.shadowed(hits, len(self._shadows))
            counts.rows += rows
            counts.tokens += rows
            return
        accepted = self._count(step, outputs)
        self.policy.budget.observe(rows, seconds + self._proposing, tokens - rows, accepted, track=decoding)

    def _timed(self) -> tuple[float, bool]:
        """The step's seconds since `started` and whether it only decoded ((0, False) untimed)."""
        if self._step is None:
            return 0.0, False
        start, decoding = self._step
        self._step = None
        return self.clock() - start, decoding

    def _count(self, step: Step, outputs: Mapping[int, TokenOutput | Exception]) -> int:
        """Each row's acceptance into the policy and the counts; the step's accepted draft tokens."""
        counts, drafted, total, first = self.counts, False, 0, 0
        before = counts.speculating
        for item in step.items:
            if not item.request.output_tokens:
                continue
            out = outputs.get(item.request.request_id)
            accepted = len(out.accepted) if isinstance(out, TokenOutput) else 0
            self._keys.add(item.request.request_id)
            self.policy.drafted(item.request.request_id, item.drafts, accepted)
            counts.rows += 1
            counts.tokens += 1 + accepted
            if item.drafts:
                drafted = True
                counts.speculating += 1
                counts.drafted += item.drafts
                counts.accepted += accepted
                total += accepted
                first += accepted > 0
        if self.proposer.cheap and counts.speculating > before:  # the drafts' first tokens, as the shadows'
            self.policy.budget.shadowed(first, counts.speculating - before)
        self.policy.stepped(drafted)
        return total

    def close(self) -> None:
        """Free the proposer's state (a draft model's context and weights); the engine has stopped."""
        self.proposer.close()

    def stats(self) -> SpeculationStats:
        c, b = self.counts, self.policy.budget.counts
        return SpeculationStats(c.drafted, c.accepted, c.rows, c.tokens, c.speculating, b.draft_steps,
                                b.draft_seconds, b.settle_steps, b.settle_seconds, b.plain_steps, b.plain_seconds,
                                b.probes, b.excess_seconds, b.unpaid_seconds)

    def _forget_departed(self, running: Sequence[Request]) -> None:
        live = {r.request_id for r in running}
        for key in self._keys - live:
            self.proposer.forget(key)
            self.policy.forget(key)
        self._keys &= live
