"""What drafts that are never accepted may cost (issue 47, "never slower"): the engine's speculation
driven without a model, over plain step times whose shape changes cost what llama.cpp's do (a new
token count rebuilds the graph; ggml-cuda runs the new shape eagerly, then captures it), and plain
acceptance counts. At acceptance 0 drafting stops after one probe, the probes back off exponentially,
their measured cost (the settle steps after them included) stays within the budget; drafts that pay
go on every step."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pflash_plugin.engine.request import Request, SamplingParams, TokenOutput
from pflash_plugin.engine.speculation.budget import DraftBudget
from pflash_plugin.engine.speculation.drafting import Speculation
from pflash_plugin.engine.speculation.policy import SpeculationPolicy
from pflash_plugin.engine.steps import BatchItem, Step
from test_speculation_policy import Untouched


class Clock:
    """Seconds the test advances by hand: a step takes what its shape costs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Lookup:
    """A proposer that drafts a run of token 7 (the target's choice is 7 where drafts are accepted, 9
    where not); `cheap`: a lookup (shadow drafts measure acceptance), else as a draft model (the
    budget's measured costs alone)."""

    reads_media = True

    def __init__(self, cheap: bool = False) -> None:
        self.cheap, self.calls, self.rows = cheap, 0, 0

    def propose(self, rows):
        self.calls += 1
        self.rows = max(self.rows, len(rows))
        return [[7] * row.k for row in rows]

    def forget(self, key):
        pass

    def draft_cost(self):
        return 0.0

    def close(self):
        pass


@dataclass
class Device:
    """A step's seconds: a fixed part and a part per token (the H200's 8B at one row: 6 ms, verify of
    1-8 drafts 8.6-10 ms), plus a graph rebuild where the token count changed and a capture on the
    second step of a new count (llama-context.cpp graph reuse; ggml-cuda's CUDA graph warmup)."""

    base: float = 0.0058
    per_token: float = 0.0002
    rebuild: float = 0.004
    capture: float = 0.003
    shapes: list[int] = field(default_factory=list)  # the last two steps' token counts (none: warmed up)

    def seconds(self, tokens: int) -> float:
        before, last = self.shapes[-2:] if self.shapes else (tokens, tokens)
        extra = self.rebuild if tokens != last else self.capture if tokens != before else 0.0
        self.shapes = [last, tokens]
        return self.base + self.per_token * tokens + extra


def run(spec: Speculation, steps: int, rows: int = 1, accept: float = 0.0, renew: int = 256,
        device: Device | None = None) -> tuple[list[int], float]:
    """`steps` decode steps of `rows` requests (replaced by new ones every `renew` steps), each draft
    token accepted at rate `accept`; the draft tokens of each step and all the steps' seconds."""
    device, clock = device or Device(), spec.clock
    assert isinstance(clock, Clock)
    requests: list[Request] = []
    drafted: list[int] = []
    for at in range(steps):
        if at % renew == 0:
            requests = [Request([1, 2, 3], SamplingParams(max_tokens=10**6)) for _ in range(rows)]
            for request in requests:
                request.output_tokens = [4]
        drafts = spec.drafts(requests, requests, room=10**6)
        step = Step([BatchItem(r, [4, *drafts.get(r.request_id, [])], 0, True, len(drafts.get(r.request_id, [])))
                     for r in requests])
        spec.started(step)
        clock.now += device.seconds(step.n_tokens)
        spec.verified(step, {r.request_id: TokenOutput(7 if accept == 1.0 else 9, accepted=tuple(
            drafts.get(r.request_id, []))[:int(accept * len(drafts.get(r.request_id, [])))]) for r in requests})
        drafted.append(step.n_tokens - rows)
    return drafted, clock.now


def speculation(policy: SpeculationPolicy | None = None, cheap: bool = False) -> Speculation:
    return Speculation(Lookup(cheap), policy or SpeculationPolicy(max_draft=8), lambda r: True,
                       max_step_drafts=128, clock=Clock())


def test_one_row_at_acceptance_zero_probes_exponentially_rarely_within_the_budget():
    """One client, random weights, a proposer without shadow drafts (as a draft model): before, the
    shared rate drifted back to the prior every 64 steps and each new request drafted again (6-25
    draft tokens a run on the H200, 2-7% slower). Now the first probe's measured loss (its step and
    the two plain steps after it, slowed by the rebuilds) backs the next off 16, 32, 64, ... steps,
    and the unpaid time stays within `fraction` (1%) of the decode time."""
    spec = speculation()
    drafted, total = run(spec, 20_000)
    probes = [at for at, n in enumerate(drafted) if n]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert 1 <= len(probes) <= 12  # log2(20,000 / 16) + 1: without the budget, hundreds
    backoff = spec.policy.budget.backoff
    assert all(gap >= backoff << i for i, gap in enumerate(gaps)), gaps  # 16, 32, 64, ... steps at least
    counts = spec.policy.budget.counts
    assert counts.probes == len(probes) and counts.draft_steps == len(probes)
    assert 0 < counts.unpaid_seconds <= spec.policy.budget.fraction * total
    assert counts.settle_steps == 2 * len(probes) and counts.settle_seconds > 2 * len(probes) * Device().base


def test_the_steps_after_a_probe_are_charged_to_it():
    """A drafted step as fast as a plain one (no cost per token, no rebuild) still loses where a plain
    step after it pays the capture of the shape it returns to: its episode closes unpaid, by that
    step's excess, and the next requests (one every 6 steps) wait for the budget."""
    spec = speculation(SpeculationPolicy(max_draft=1, max_misses=1))  # a request drafts once
    device = Device(per_token=0.0, rebuild=0.0, capture=0.005)
    drafted, _ = run(spec, 40, renew=6, device=device)
    probes = [at for at, n in enumerate(drafted) if n]
    counts = spec.policy.budget.counts
    assert counts.unpaid_seconds > 0.004 and counts.excess_seconds > 0.004
    assert probes == [spec.policy.budget.min_plain]  # charged nothing (free drafts): a probe each request


def test_the_budget_alone_bounds_the_spend():
    """Without the backoff (0 steps) the budget is the bound: unpaid time at most `fraction` (1%) of
    all the steps' time plus `grace` episodes' losses, at 1 and at 16 rows."""
    for rows in (1, 16):
        spec = speculation(SpeculationPolicy(max_draft=8, max_misses=10**6, budget=DraftBudget(backoff=0)))
        drafted, total = run(spec, 5_000, rows=rows)
        counts = spec.policy.budget.counts
        loss = counts.unpaid_seconds / counts.probes
        fraction = spec.policy.budget.fraction
        grace = spec.policy.budget.grace
        assert counts.probes > 3 and counts.unpaid_seconds <= fraction * total + (grace + 1) * loss, (rows, counts)
        assert sum(map(bool, drafted)) < 0.05 * len(drafted)


def test_drafts_that_pay_go_on_every_step():
    """A copy-heavy row (every draft accepted): after the plain steps that measure a plain step at
    its row count, it drafts each step, one episode, nothing unpaid; the probe is a token, each
    paid step doubles it up to the policy's."""
    spec = speculation()
    drafted, _ = run(spec, 200, accept=1.0, renew=10**6)
    first = next(at for at, n in enumerate(drafted) if n)
    assert first == spec.policy.budget.min_plain and all(drafted[first:])
    assert drafted[first:first + 5] == [1, 2, 4, 8, 8]
    assert spec.policy.budget.counts.probes == 1 and spec.policy.budget.counts.unpaid_seconds == 0.0


def test_a_row_that_never_had_a_draft_accepted_stops_after_max_misses():
    """The per-request cap, with the budget out of the way: a row drafts `max_misses` times with
    nothing accepted, then no more; one that had a draft accepted once is not capped."""
    free = DraftBudget(fraction=1e9, backoff=0, min_plain=0, probe=1 << 20)
    # every row back at the shared rate each step, which stays 1.0: only the cap stops a row
    policy = SpeculationPolicy(max_draft=4, prior=1.0, drift=1.0, shared_alpha=0.0, budget=free)
    drafts = []
    for _ in range(10):
        drafts.append(policy.draft_tokens(1, rows=1))
        policy.drafted(1, drafts[-1], 0)
        policy.drafted(2, 4, 1 if policy.draft_tokens(2, rows=1) else 0)
        policy.stepped(True)
    assert drafts == [4] * policy.max_misses + [0] * (10 - policy.max_misses)
    assert policy.draft_tokens(2, rows=1) > 0
    policy.forget(1)
    assert policy.draft_tokens(1, rows=1) > 0  # a new request of the same id starts afresh


def test_a_step_with_prefill_or_refused_by_the_budget_asks_the_proposer_nothing():
    """A step with prefill chunks carries no drafts (its time says nothing of theirs); one the budget
    refuses (a row count without plain steps measured) costs no proposer call; /status's counts."""
    spec = speculation()
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=100))]
    requests[0].output_tokens = [4]
    assert spec.drafts(requests, requests, room=100) == {} and spec.proposer.calls == 0  # no plain step yet
    run(spec, 4, accept=1.0)
    assert spec.drafts(requests, requests, room=100, prefill=True) == {}
    stats = spec.stats().as_dict()
    assert (stats["plain_steps"], stats["draft_steps"], stats["probes"]) == (3, 1, 1)
    assert stats["draft_step_seconds"] > 0 and stats["unpaid_seconds"] == 0.0


def test_a_step_without_drafts_makes_no_pass_over_its_rows():
    """16 rows the budget keeps from drafting (acceptance 0): the step's rows are not visited (before,
    each row's rate was moved towards the shared rate every step, ~50 us a step at 16 rows on the
    CPU); a row's drift is applied when its rate is read, as many steps' worth as went by."""
    spec = speculation()
    run(spec, 3_000, rows=16)
    requests = [Request([1], SamplingParams(max_tokens=100)) for _ in range(16)]
    for request in requests:
        request.output_tokens = [4]
    decode = Untouched(requests)
    assert spec.drafts(requests, decode, room=100) == {} and decode.visits == 0
    step = Step(Untouched(BatchItem(r, [4], 0, True) for r in requests))
    spec.started(step)
    spec.verified(step, {r.request_id: TokenOutput(9) for r in requests})
    assert step.items.visits == 0
    policy = SpeculationPolicy(max_misses=10**6)
    policy.drafted(1, 4, 0)
    low = policy.rate(1)
    for _ in range(10):
        policy.stepped(False)
    assert policy.rate(1) - policy.shared == pytest.approx((low - policy.shared) * (1 - policy.drift) ** 10)


def test_a_lookup_at_acceptance_zero_never_pays_for_a_probe():
    """A cheap proposer (prompt lookup) is asked, in steps that do not draft, for a token for one
    row (each in turn), checked against the target's choice: where none would be accepted (random
    weights) no step ever drafts, at 1 row or 16."""
    for rows in (1, 16):
        spec = speculation(cheap=True)
        drafted, _ = run(spec, 5_000, rows=rows)
        assert not any(drafted) and spec.policy.budget.counts.probes == 0
        assert spec.proposer.calls > 4_000 and spec.proposer.rows == 1


def test_a_lookup_whose_shadow_drafts_match_drafts_within_a_few_steps():
    """Where the shadow drafts are what the target chooses (a copy), drafting starts a few steps
    after the plain steps that measure a plain step, and goes on every step."""
    spec = speculation(cheap=True)
    drafted, _ = run(spec, 100, accept=1.0, renew=10**6)
    first = next(at for at, n in enumerate(drafted) if n)
    assert first <= spec.policy.budget.min_plain + 4 and all(drafted[first:])


def test_an_accepted_probe_ramps_up_before_its_net_counts():
    """A probe whose drafts are mostly accepted (here half, below `sure`) goes on to 2, 4, 8 tokens
    though a 1-token draft costs more than the token it yields (a rebuild of 20 ms on a 6 ms step; on
    the CPU the demo model's output layer makes a draft token 0.75 of a step); after `ramp` steps
    its net counts, and here it has not paid: no more drafts."""
    budget = DraftBudget()
    for _ in range(15):
        budget.observe(1, 0.006)
    allowed = []
    for k, kept in ((1, 1), (2, 1), (4, 2), (8, 4)):
        allowed.append(budget.allows(1))
        budget.observe(1, 0.006 + 0.02 + 0.0002 * k, drafted=k, accepted=kept)
    assert allowed == [1, 2, 4, 8] and budget.allows(1) == 0


def test_a_loss_within_the_plain_steps_spread_is_not_charged():
    """On a loaded CPU plain steps vary by half their time: a probe 2 ms over a plain step whose
    steps vary by 3 ms is noise, not charged and not backed off; on steady steps it is a loss."""
    for times, charged in (([0.006, 0.0075, 0.009] * 6, False), ([0.0075] * 18, True)):
        budget = DraftBudget()
        for seconds in times:
            budget.observe(1, seconds)
        plain = budget.plain(1)
        assert budget.allows(1) == 1
        budget.observe(1, plain + 0.002, drafted=1, accepted=0)
        budget.observe(1, plain)
        budget.observe(1, plain)
        assert (budget.counts.unpaid_seconds > 0) is charged and (budget.allows(1) == 0) is charged


def test_a_spike_of_other_work_is_charged_at_most_clip_plain_steps():
    """A settle step that other work on the machine held up for 50 plain steps is charged as `clip`
    plain steps (on 2 loaded cores one such step kept a copy, every draft accepted, from drafting for
    good): the copy's episode stays paid."""
    budget = DraftBudget()
    for _ in range(15):
        budget.observe(1, 0.010)
    for k in (1, 2, 4, 8):
        budget.observe(1, 0.010 + 0.004 * k, drafted=k, accepted=k)
    budget.observe(1, 0.500)  # a settle step held up by other work
    budget.observe(1, 0.010)
    assert budget.counts.unpaid_seconds == 0.0 and budget.allows(1) == 1


def test_with_shadow_drafts_even_the_first_probe_waits_for_their_evidence():
    """A cheap proposer's budget needs shadow acceptance from the start: a row whose lookup finds
    nothing in its first steps does not probe unmeasured once it finds something."""
    assert speculation(cheap=True).policy.budget._shadow == 0.0
    budget = DraftBudget()
    budget.shadowing()
    for _ in range(5):
        budget.observe(1, 0.006)
    assert budget.allows(1) == 0
    for _ in range(4):
        budget.shadowed(1, 1)
    assert budget.allows(1) == 1


def test_a_copy_goes_on_whatever_its_measured_net():
    """Drafts accepted at `sure` or more go on even where the measured net reads as a loss after the
    ramp (here each new shape costs 30 ms: 1, 2, 4, 8 tokens, all accepted, read as unpaid; on 2
    loaded cores a copy's ramp read so and drafting stopped after 15 tokens)."""
    spec = speculation()
    drafted, _ = run(spec, 40, accept=1.0, renew=10**6, device=Device(rebuild=0.03))
    first = next(at for at, n in enumerate(drafted) if n)
    assert all(drafted[first:]) and spec.policy.budget.counts.unpaid_seconds == 0.0
