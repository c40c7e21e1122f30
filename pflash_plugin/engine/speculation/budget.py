"""Whether a step may carry drafts at all, from what drafted steps were measured to cost: a pure rule
over step wall times and accepted counts (no llama.cpp), so a test drives it with plain values.

Why a step-level gate beside the per-row price (policy.py): a step with drafts has a new shape (more
tokens, more logits rows), and llama.cpp rebuilds its graph for any change of the ubatch's token
count or n_outputs (llama-graph.h `allow_reuse`; llama-context.cpp keeps the one previous graph), so
the plain step after it rebuilds again; ggml-cuda re-keys its CUDA graph on every node's shape and
runs eagerly until two calls agree, then captures (ggml-cuda.cu `warmup_complete`). A rare probe
thus pays for itself and the `settle` plain steps after it, a price the per-token line of StepCost
never sees (it fits steady shapes and forgets sizes not seen for a while). Here the price is
measured: a drafted step's wall time (plus its proposer's) against the median plain step at the same
row count (`window` recent ones, never expiring), plus the settle steps' excess, less the accepted
tokens' worth (a plain step's time per row each). Consecutive drafted steps and their settle steps
form an episode; it goes on while its net is paid (within the plain steps' own spread, `_margin`: a
loaded CPU's steps vary by half their time), and an episode that closes unpaid beyond that adds its
loss to `unpaid` and doubles the wait before the next one (`backoff` steps, then 2x, 4x, ...; reset
by an episode that paid). A new episode also needs the budget: unpaid seconds plus the last loss at
most `fraction` of all the steps' time, plus `grace` losses (the first probe is free). So at
acceptance 0 the drafts' whole cost stays within `fraction` of the decode time plus `grace - 1`
episodes' losses, and probes thin out exponentially. A probe drafts `probe` token(s) a row, and
each step of an episode doubles that (a probe at 10 tokens cost the demo model 3.5 plain steps on
the CPU, at one token 0.75); for its first `ramp` steps an episode whose drafts are mostly accepted
goes on even while its net is not paid yet (on the CPU a 1-token draft costs 0.75 of a step and
yields at most one: the net shows only once drafts are longer), so a losing episode with its drafts
accepted below `sure` costs `ramp` steps; one whose drafts are accepted at
`sure` (a copy) goes on whatever its measured net says (on 2 loaded cores a copy's net read as a loss
after its ramp, all 15 drafts accepted; such acceptance pays wherever a draft token costs less than
0.8 of what it yields, and the per-row price, policy.py, still sizes the drafts). Where the proposer is cheap
(prompt lookup), acceptance is also measured in the shadow (`shadowed`, drafting.py) and a new
episode needs it at `shadow_min`: at acceptance 0 no probe is paid for at all.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median


@dataclass
class BudgetCounts:
    """Where speculation's time went (/status): steps with drafts and the plain steps right after
    them (`settle`, which pay the shape change back), the other plain steps, episodes begun, the
    measured excess of drafted and settle steps over plain ones, and what was not paid back."""

    draft_steps: int = 0
    draft_seconds: float = 0.0
    settle_steps: int = 0
    settle_seconds: float = 0.0
    plain_steps: int = 0
    plain_seconds: float = 0.0
    probes: int = 0
    excess_seconds: float = 0.0
    unpaid_seconds: float = 0.0


@dataclass
class DraftBudget:
    fraction: float = 0.01  # unpaid draft time allowed, of all the steps' time
    settle: int = 2  # plain steps after a drafted one that still pay its shape (graph rebuild, CUDA graph warmup)
    backoff: int = 16  # steps an unpaid episode makes the next one wait; doubled per unpaid episode in a row
    max_backoff: int = 1 << 16
    window: int = 15  # plain steps per row count whose median is a plain step's time there
    min_plain: int = 3  # plain steps at a row count before a step of that many rows may draft
    probe: int = 1  # draft tokens a row may carry in an episode's first step (a probe costs least)
    grace: int = 2  # episodes' losses allowed beyond `fraction` (before the decode time covers a probe)
    ramp: int = 4  # drafted steps an episode whose drafts are accepted (shadow_min) goes on before its net counts
    sure: float = 0.8  # an episode whose drafts are accepted at this rate goes on whatever its measured net
    shadow_min: float = 0.5  # first-draft acceptance a new episode needs, where it is measured (`shadowed`)
    shadow_alpha: float = 0.2  # weight of a step's measurement in it
    # a drafted step is charged at most `clip` x what its tokens cost at a plain step's rate, a settle step
    # `clip` plain steps: on 2 loaded cores one settle step took 1.2 s against a 23 ms median (other work),
    # and that loss kept a copy from drafting for good; the H200's real rebuilds cost well below it
    clip: float = 2.0
    counts: BudgetCounts = field(default_factory=BudgetCounts)
    _plain: dict[int, deque[float]] = field(default_factory=dict)  # rows -> recent clean plain step times
    _steps: int = 0
    _total: float = 0.0  # seconds of every step observed
    _net: float | None = None  # the open episode's cost less its worth (None: no episode open)
    _rows: int = 0  # the open episode's row count
    _length: int = 0  # its drafted steps
    _tokens: int = 0  # its draft tokens
    _kept: int = 0  # and those accepted
    _settling: int = 0  # plain steps since its last drafted step
    _next: int = 0  # the step from which a new episode may begin
    _failures: int = 0  # unpaid episodes in a row
    _last_loss: float = 0.0
    _shadow: float | None = None  # the rows' first draft tokens' acceptance (None: not measured, no condition)

    def allows(self, rows: int) -> int:
        """Draft tokens a row may carry in a step of `rows` decoding rows (0: the step drafts nothing):
        `probe` in an episode's first step, doubled each step it goes on paid."""
        if self._net is not None and rows != self._rows:
            self._close()  # another row count: a new shape (a rebuild) whether it drafts or not
        if self._net is not None:  # an episode goes on while it is paid, or ramps up while its drafts are accepted
            kept = self._kept / self._tokens if self._tokens else 0.0
            going = kept >= self.sure or (kept >= self.shadow_min and self._length < self.ramp)
            return self.probe << min(self._length, 30) if going or self._net <= self._margin() else 0
        if self._steps < self._next or len(self._plain.get(rows, ())) < self.min_plain:
            return 0
        if self._shadow is not None and self._shadow < self.shadow_min:
            return 0
        allowed = self.fraction * self._total + (self.grace - 1) * self._last_loss
        return self.probe if self.counts.unpaid_seconds + self._last_loss <= allowed else 0

    def observe(self, rows: int, seconds: float, drafted: int = 0, accepted: int = 0, track: bool = True) -> None:
        """A step ran: `rows` decoding rows took `seconds` (its proposer's time included), carrying
        `drafted` draft tokens of which `accepted` were kept; `track`: a decode-only step of a row count
        that may draft (its time is a plain step's, for the median); otherwise only counted."""
        self._steps += 1
        self._total += seconds
        if drafted:
            self._drafted(rows, seconds, drafted, accepted)
            return
        if self._net is not None:
            if track and rows == self._rows and self._settling < self.settle:
                self._settle_step(rows, seconds)
                return
            self._close()
        self.counts.plain_steps += 1
        self.counts.plain_seconds += seconds
        if track:
            self._plain.setdefault(rows, deque(maxlen=self.window)).append(seconds)

    def _drafted(self, rows: int, seconds: float, drafted: int, accepted: int) -> None:
        if self._net is not None and rows != self._rows:
            self._close()
        if self._net is None:
            self._net, self._rows, self._length, self._tokens, self._kept = 0.0, rows, 0, 0, 0
            self.counts.probes += 1
        self._length += 1
        self._tokens += drafted
        self._kept += accepted
        plain = self.plain(rows)
        plain = seconds * rows / (rows + drafted) if plain is None else plain  # unmeasured: a token's share
        charged = min(seconds, self.clip * plain * (rows + drafted) / rows)  # a spike of other work: clipped
        self._net += charged - plain - accepted * plain / rows
        self._settling = 0
        self.counts.draft_steps += 1
        self.counts.draft_seconds += seconds
        self.counts.excess_seconds += seconds - plain

    def _settle_step(self, rows: int, seconds: float) -> None:
        assert self._net is not None
        plain = self.plain(rows)
        excess = 0.0 if plain is None else min(seconds, self.clip * plain) - plain
        self._net += excess
        self._settling += 1
        self.counts.settle_steps += 1
        self.counts.settle_seconds += seconds
        self.counts.excess_seconds += excess
        if self._settling == self.settle:
            self._close()

    def _close(self) -> None:
        """The open episode ends: a loss is charged and backs the next one off; a gain resets the wait."""
        loss = self._net or 0.0
        loss = loss if loss > self._margin() else 0.0  # within the plain steps' noise: not judged a loss
        self._net = None
        if loss > 0.0:
            self.counts.unpaid_seconds += loss
            self._last_loss = loss
            self._next = self._steps + min(self.backoff << self._failures, self.max_backoff)
            self._failures = min(self._failures + 1, 62)
        else:
            self._failures = 0

    def _margin(self) -> float:
        """What the open episode's net may be off by from the steps' noise alone: twice the plain
        steps' median absolute deviation at its row count, by the root of its steps (a loaded CPU's
        steps vary by half their time, the H200's by a few percent)."""
        times = self._plain.get(self._rows)
        if not times:
            return 0.0
        mid = median(times)
        return 2.0 * median(abs(t - mid) for t in times) * (self._length + self._settling) ** 0.5

    def shadowing(self) -> None:
        """Acceptance will be measured in the shadow (a cheap proposer): from now a new episode needs
        it, the first probe too."""
        if self._shadow is None:
            self._shadow = 0.0

    def shadowed(self, hits: int, rows: int) -> None:
        """`hits` of `rows` rows' first draft token were the token the target chose (a shadow draft
        of a step that did not draft, or a real one): the acceptance a new episode needs measured
        without paying for a verification."""
        shadow = self._shadow or 0.0
        self._shadow = shadow + self.shadow_alpha * (hits / rows - shadow)

    def plain(self, rows: int) -> float | None:
        """A plain step's time at `rows` rows: the median of the recent ones (None before any)."""
        times = self._plain.get(rows)
        return median(times) if times else None
