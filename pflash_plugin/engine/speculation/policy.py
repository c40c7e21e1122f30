"""When speculation pays, per row and per step: a pure rule over measured numbers, with nothing of
llama.cpp in it, so a test drives it with plain values.

A draft token costs every row of the step its share of the step's extra time, and gains only if the
target accepts it. Adding one token to a step of B rows that takes T seconds costs `slope` seconds
(the step's time per token); at the step's rate of B / T tokens a second that time would have
produced slope * B / T tokens. The j-th draft token of a row is accepted with probability about
a^j (a: the row's acceptance per drafted token), so a row drafts the k tokens whose a^j beats that
price (with a draft model, the seconds its decodes take a draft token, Proposer.draft_cost, add to
`slope`). On a CPU or a GPU at one row the fixed cost of a step (reading the weights) dwarfs a token's,
the price is small and long drafts pay; at a large batch a step's time is mostly its tokens', the
price nears 1 and nothing pays: speculation turns itself off (and beyond `max_rows` it is off
outright, so a full batch is never slowed down by a wrong estimate).

Acceptance is measured per row (an exponentially weighted mean of accepted / drafted) and across
rows (`shared`, the same mean over every row's drafts): a new row starts from the shared rate, and
a row that stopped drafting drifts back towards it, so it tries again later. The shared rate moves
halfway back to the prior every `recover` steps in which no row drafted: where nothing is accepted
(a model that never repeats, random weights) new requests do not draft at all and the rows probe
with a token or two only every few dozen steps, rather than every request drafting its first steps
and every row re-trying each ~10 steps at the prior's rate (at 16 rows, each probe is 16 verified
rows of the host's work). The step's cost is a
least-squares line through the decode steps' (tokens, seconds), each size by its fastest recent
step (on 2 cores shared with other work a step's time doubles at random: the minimum is what the
step costs), a size not seen for `horizon` steps forgotten (a price measured under a load that has
gone would keep drafting off for good). With one size alone the last fit's ratio of a token's cost
to the fixed cost stands in (before any fit, `prior_slope`), moving halfway back to the prior every
`horizon` steps that drafting stays off, so a request tries again now and then, not every 64 steps
(on 2 cores, probes at the prior's price made SmolLM2 0.81x as fast as without speculation).

Two caps bound what drafts that are never accepted cost: the step-level DraftBudget (budget.py: a
step drafts only where the measured cost of drafted steps, graph rebuilds included, was paid back,
within 1% of the decode time (`DraftBudget.fraction`), and probes back off exponentially), and per
row `max_misses` drafted steps that accepted nothing, after which a row that never had a draft
accepted drafts no more.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .budget import DraftBudget


@dataclass
class StepCost:
    """A line seconds = base + slope * tokens through the decode steps seen: per step size, the
    fastest of its last `window` steps (other work on the machine only ever adds time, and a slow
    step must not turn speculation off for good), then least squares over those minima."""

    window: int = 16
    min_seen: int = 3  # a size counts once it ran this many times (one slow step says nothing)
    horizon: int = 64  # steps after which a size not seen since is forgotten (the load changed since)
    prior_slope: float = 0.05  # a token's cost as a fraction of the base, before two sizes are seen
    _seen: dict[int, deque[float]] = field(default_factory=dict)
    _last: dict[int, int] = field(default_factory=dict)  # size -> the step it was last seen
    _steps: int = 0
    _ratio: float | None = None  # slope / base of the last fit: what one size alone is read with

    def observe(self, tokens: int, seconds: float) -> None:
        self._steps += 1
        self._seen.setdefault(tokens, deque(maxlen=self.window)).append(seconds)
        self._last[tokens] = self._steps
        for size in [n for n, at in self._last.items() if at < self._steps - self.horizon]:
            del self._seen[size], self._last[size]
        if len(self._seen) == 1 and self._ratio is not None and self._steps % self.horizon == 0:
            self._ratio = (self._ratio + self.prior_slope) / 2  # drafting stayed off: back towards trying

    def line(self) -> tuple[float, float] | None:
        """(base, slope), or None before any size ran `min_seen` times."""
        points = [(n, min(times)) for n, times in self._seen.items() if len(times) >= self.min_seen]
        if not points:
            return None
        mx = sum(n for n, _ in points) / len(points)
        my = sum(t for _, t in points) / len(points)
        var = sum((n - mx) ** 2 for n, _ in points)
        if var == 0:  # one size seen: no slope to fit; the last fit's ratio, else the prior's
            ratio = self.prior_slope if self._ratio is None else self._ratio
            base = my / (1 + ratio * mx)
            return base, ratio * base
        slope = max(sum((n - mx) * (t - my) for n, t in points) / var, 0.0)
        base = max(my - slope * mx, 0.0)
        self._ratio = min(slope / base, 100.0) if base > 0 else 100.0
        return base, slope

    def price(self, rows: int, drafting: float = 0.0) -> float:
        """Tokens a draft token must be expected to yield to pay at `rows` rows (0..1); `drafting`:
        the seconds a draft token costs its proposer besides (a draft model's decodes)."""
        fit = self.line()
        base, slope = fit if fit is not None else (1.0, self.prior_slope)
        step = base + slope * rows
        return 1.0 if step <= 0 else min((slope + drafting) * rows / step, 1.0)


@dataclass
class SpeculationPolicy:
    """How many draft tokens each row may take this step."""

    max_draft: int = 10  # --draft_model_num_pred_tokens
    max_rows: int = 16  # rows decoding beyond this: no speculation at all
    prior: float = 0.6  # a new row's assumed acceptance per drafted token
    alpha: float = 0.3  # weight of the newest measurement in a row's acceptance
    drift: float = 0.05  # a row not drafting moves this much of the way back to the prior each step
    cost: StepCost = field(default_factory=StepCost)
    drafting: float = 0.0  # seconds a draft token costs the proposer (Proposer.draft_cost), set each step
    shared_alpha: float = 0.1  # weight of a row's newest measurement in the shared rate
    recover: int = 64  # steps without any draft after which the shared rate moves halfway to the prior
    max_misses: int = 4  # drafted steps a request may have with nothing accepted, before any acceptance
    budget: DraftBudget = field(default_factory=DraftBudget)  # whether a step may draft at all (budget.py)
    _rates: dict[int, tuple[float, int]] = field(default_factory=dict)  # row -> its rate, the step it was set
    _misses: dict[int, int] = field(default_factory=dict)  # row -> its drafts' misses (-1: it accepted some)
    _shared: float | None = None  # acceptance across rows (None: the prior)
    _idle: int = 0  # steps since a row last drafted
    _steps: int = 0  # steps verified (`stepped`): a row's drift is applied when its rate is read

    def active(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows may speculate at all: beyond `max_rows` the engine
        does no per-row work for speculation (no proposer, no bookkeeping)."""
        return rows <= self.max_rows and self.max_draft > 0

    @property
    def shared(self) -> float:
        """The acceptance a new row starts from and an idle row drifts back to."""
        return self.prior if self._shared is None else self._shared

    def price(self, rows: int) -> float:
        """What a draft token must yield at `rows` rows (StepCost.price, the proposer's cost added)."""
        return self.cost.price(rows, self.drafting)

    def draft_tokens(self, key: int, rows: int, price: float | None = None) -> int:
        """Draft tokens for row `key` in a step of `rows` decoding rows (0: do not speculate);
        `price`: the step's `price(rows)`, where the caller asks for many rows (one fit a step)."""
        if not self.active(rows) or self._misses.get(key, 0) >= self.max_misses:
            return 0
        rate = self.rate(key)
        price = self.price(rows) if price is None else price
        if rate <= price or rate <= 0.0:
            return 0
        if rate >= 1.0:
            return self.max_draft
        return min(self.max_draft, int(math.log(max(price, 1e-9)) / math.log(rate)))

    def drafted(self, key: int, drafted: int, accepted: int) -> None:
        """A row's verified draft (drafted 0: nothing to learn; a row not drafting drifts towards the
        shared rate by `drift` a step, applied when its rate is read, so a step without drafts needs
        no pass over its rows)."""
        if not drafted:
            return
        shared, rate = self.shared, self.rate(key)
        misses = self._misses.get(key, 0)
        self._misses[key] = -1 if accepted or misses < 0 else misses + 1
        self._rates[key] = (rate + self.alpha * (accepted / drafted - rate), self._steps)
        self._shared = shared + self.shared_alpha * (accepted / drafted - shared)

    def stepped(self, drafted: bool) -> None:
        """A step of at most `max_rows` rows was verified (`drafted`: some row carried drafts)."""
        self._steps += 1
        self._idle = 0 if drafted else self._idle + 1
        if self._idle and self._idle % self.recover == 0:
            self._shared = (self.shared + self.prior) / 2  # nothing drafted for a while: back towards trying

    def forget(self, key: int) -> None:
        self._rates.pop(key, None)
        self._misses.pop(key, None)

    def rate(self, key: int) -> float:
        """Row `key`'s acceptance: its last measured rate, drifted towards the shared rate by `drift`
        for each step since (the shared rate for a row that never drafted)."""
        shared = self.shared
        if key not in self._rates:
            return shared
        rate, at = self._rates[key]
        return shared + (rate - shared) * (1.0 - self.drift) ** (self._steps - at)
