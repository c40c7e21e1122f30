"""When speculation pays, per row and per step: a pure rule over measured numbers, with nothing of
llama.cpp in it, so a test drives it with plain values.

A draft token costs every row of the step its share of the step's extra time, and gains only if the
target accepts it. Adding one token to a step of B rows that takes T seconds costs `slope` seconds
(the step's time per token); at the step's rate of B / T tokens a second that time would have
produced slope * B / T tokens. The j-th draft token of a row is accepted with probability about
a^j (a: the row's acceptance per drafted token), so a row drafts the k tokens whose a^j beats that
price. On a CPU or a GPU at one row the fixed cost of a step (reading the weights) dwarfs a token's,
the price is small and long drafts pay; at a large batch a step's time is mostly its tokens', the
price nears 1 and nothing pays: speculation turns itself off (and beyond `max_rows` it is off
outright, so a full batch is never slowed down by a wrong estimate).

Acceptance is measured per row (an exponentially weighted mean of accepted / drafted); a row that
stopped drafting drifts back towards the prior, so it tries again later. The step's cost is a
least-squares line through the decode steps' (tokens, seconds), exponentially forgotten; until the
steps vary enough in size to fit one, `prior_slope` (the cost of a token as a fraction of a
one-row step) stands in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepCost:
    """A line seconds = base + slope * tokens through the decode steps seen, older ones forgotten."""

    decay: float = 0.95
    prior_slope: float = 0.05  # a token's cost as a fraction of the base, before a fit
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(base, slope), or None before any step."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 0.25:  # the steps' sizes barely varied: no slope to fit; the prior's
            base = my / (1 + self.prior_slope * mx)
            return base, self.prior_slope * base
        slope = max((self._xy / self._w - mx * my) / var, 0.0)
        return max(my - slope * mx, 0.0), slope

    def price(self, rows: int) -> float:
        """Tokens a draft token must be expected to yield to pay at `rows` rows (0..1)."""
        fit = self.line()
        base, slope = fit if fit is not None else (1.0, self.prior_slope)
        step = base + slope * rows
        return 1.0 if step <= 0 else min(slope * rows / step, 1.0)


@dataclass
class SpeculationPolicy:
    """How many draft tokens each row may take this step."""

    max_draft: int = 10  # --draft_model_num_pred_tokens
    max_rows: int = 16  # rows decoding beyond this: no speculation at all
    prior: float = 0.6  # a new row's assumed acceptance per drafted token
    alpha: float = 0.3  # weight of the newest measurement in a row's acceptance
    drift: float = 0.05  # a row not drafting moves this much of the way back to the prior each step
    cost: StepCost = field(default_factory=StepCost)
    _rates: dict[int, float] = field(default_factory=dict)

    def draft_tokens(self, key: int, rows: int) -> int:
        """Draft tokens for row `key` in a step of `rows` decoding rows (0: do not speculate)."""
        if rows > self.max_rows or self.max_draft <= 0:
            return 0
        rate, price = self._rates.get(key, self.prior), self.cost.price(rows)
        if rate <= price or rate <= 0.0:
            return 0
        if rate >= 1.0:
            return self.max_draft
        return min(self.max_draft, int(math.log(max(price, 1e-9)) / math.log(rate)))

    def drafted(self, key: int, drafted: int, accepted: int) -> None:
        """A row's verified draft (drafted 0: it did not draft this step; its rate drifts to the prior)."""
        rate = self._rates.get(key, self.prior)
        if drafted:
            rate += self.alpha * (accepted / drafted - rate)
        else:
            rate += self.drift * (self.prior - rate)
        self._rates[key] = rate

    def forget(self, key: int) -> None:
        self._rates.pop(key, None)

    def rate(self, key: int) -> float:
        return self._rates.get(key, self.prior)
