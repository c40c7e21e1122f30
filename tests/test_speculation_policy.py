"""Speculation's pure parts without a model (issue 47): prompt lookup's drafts and its incremental
index, the adaptive policy (acceptance and the step's cost at the batch size), and the engine side's
row choice, stats and forgetting on plain requests."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pflash_plugin.engine.request import Request, SamplingParams, TokenOutput
from pflash_plugin.engine.speculation.budget import DraftBudget
from pflash_plugin.engine.speculation.drafting import Joined, Speculation
from pflash_plugin.engine.speculation.ngram import NgramProposer
from pflash_plugin.engine.speculation.policy import SpeculationPolicy, StepCost
from pflash_plugin.engine.speculation.proposer import DraftRow
from pflash_plugin.engine.steps import BatchItem, Step


def draft(proposer: NgramProposer, tokens: list[int], k: int = 10, key: int = 1) -> list[int]:
    return proposer.propose([DraftRow(key, tokens, k)])[0]


def test_prompt_lookup_drafts_what_followed_the_last_bigram_then_the_last_token():
    p = NgramProposer(max_ngram_size=2, num_pred_tokens=4)
    assert draft(p, [1, 2, 3, 4, 5, 6, 9, 1, 2]) == [3, 4, 5, 6]  # the bigram (1, 2) matched
    assert draft(p, [7, 8, 9, 5, 3, 7], key=2) == [8, 9, 5, 3]  # no bigram (3, 7): the unigram 7
    assert draft(p, [1, 2, 3], key=3) == []  # nothing seen before
    assert draft(p, [1, 2, 3, 4, 5, 6, 9, 1, 2], k=2, key=4) == [3, 4]  # at most k
    assert draft(p, [4, 4, 4], key=5) == [4]  # the latest earlier occurrence, up to the end


def test_prompt_lookup_takes_the_latest_occurrence_and_extends_its_index_incrementally():
    """As a row's tokens grow, only the new ones are indexed, and a later occurrence of the n-gram
    takes over from an earlier one (a copy in progress continues where it is)."""
    p = NgramProposer(2, 3)
    tokens = [5, 6, 1, 5, 6, 2, 9]
    assert draft(p, tokens + [5, 6]) == [2, 9, 5]
    index = p._indexes[1]
    before = dict(index.ends)
    grown = tokens + [5, 6, 7, 8]
    assert draft(p, grown + [5, 6]) == [7, 8, 5]
    assert index.indexed == len(grown) + 1 and set(before) <= set(index.ends)
    p.forget(1)
    assert 1 not in p._indexes


def test_prompt_lookup_over_a_joined_prompt_and_output():
    """The engine hands the prompt and the output joined without copying (drafting.Joined)."""
    prompt, output = [1, 2, 3, 4, 5], [9, 1, 2]
    joined = Joined(prompt, output)
    assert list(joined) == prompt + output and joined[-1] == 2 and joined[3:7] == [4, 5, 9, 1]
    assert draft(NgramProposer(2, 10), joined) == [3, 4, 5, 9, 1, 2]


def test_step_cost_fits_the_line_and_prices_a_token_by_the_batch_size():
    cost = StepCost()
    assert cost.price(1) == pytest.approx(cost.prior_slope / (1 + cost.prior_slope))  # before any step
    for tokens in (1, 11, 6, 3) * 3:
        cost.observe(tokens, 0.017 + 0.007 * tokens)  # the demo model on 2 cores: 17 ms + 7 ms a token
    base, slope = cost.line()
    assert base == pytest.approx(0.017) and slope == pytest.approx(0.007)
    assert cost.price(1) == pytest.approx(0.007 / 0.024)
    assert cost.price(128) > 0.95  # a large batch: a token costs nearly what it yields
    cost.observe(11, 1.5)  # a step that other work on the machine stalled: the fastest recent one counts
    assert cost.line() == pytest.approx((base, slope))
    fitted = cost.price(1)
    for _ in range(cost.horizon + 1):  # only one-token steps since: the drafts' sizes are forgotten,
        cost.observe(1, 0.017 + 0.007)  # the last fit's ratio of a token's cost to the step's stays
    assert len(cost._seen) == 1 and cost.price(1) == pytest.approx(fitted)
    for _ in range(4 * cost.horizon):  # drafting stayed off: the ratio halves towards the prior
        cost.observe(1, 0.017 + 0.007)
    prior = cost.prior_slope / (1 + cost.prior_slope)
    assert prior < cost.price(1) < prior + (fitted - prior) / 8


def test_policy_drafts_longer_the_more_is_accepted_and_stops_at_a_large_batch():
    policy = SpeculationPolicy(max_draft=10, max_rows=16, max_misses=1000)  # the row cap: its own test
    for tokens in (1, 11) * 3:
        policy.cost.observe(tokens, 0.017 + 0.007 * tokens)
    new = policy.draft_tokens(1, rows=1)
    assert 0 < new < 10  # the prior's acceptance
    for _ in range(10):
        policy.drafted(1, 10, 10)
    assert policy.draft_tokens(1, rows=1) == 10  # everything accepted: the longest drafts
    assert policy.draft_tokens(1, rows=17) == 0  # beyond max_rows: off
    for _ in range(10):
        policy.drafted(2, 10, 0)
    assert policy.draft_tokens(2, rows=1) == 0  # nothing accepted: off for that row alone
    for _ in range(200):
        policy.stepped(False)  # steps without drafts drift back towards the rows' shared rate: it tries again
    assert policy.rate(2) == pytest.approx(policy.shared, rel=1e-3)
    assert policy.draft_tokens(2, rows=1) == policy.draft_tokens(3, rows=1)  # a new row starts there
    policy.cost = StepCost()
    for tokens in (8, 88) * 3:  # a compute-bound step (no fixed cost): no draft pays
        policy.cost.observe(tokens, 0.001 * tokens)
    assert policy.draft_tokens(1, rows=8) == 0


def test_where_nothing_is_accepted_new_rows_do_not_draft_and_probes_are_rare():
    """The shared rate: rows that accept nothing teach the policy that a new row would not either
    (at the prior's 0.6 each new request drafted its first steps); without drafts it moves halfway
    back to the prior every `recover` steps, so a probe comes every few dozen steps, not each ~10."""
    policy = SpeculationPolicy(max_draft=10, max_rows=16)
    for tokens in (8, 18) * 3:  # 8 rows: 20 ms + 0.5 ms a token, a draft token is priced ~0.17
        policy.cost.observe(tokens, 0.020 + 0.0005 * tokens)
    assert policy.draft_tokens(1, rows=8) > 0  # the prior's 0.6 pays
    while any(policy.draft_tokens(key, rows=8) for key in range(8)):  # 8 rows drafting, nothing accepted
        for key in range(8):
            policy.drafted(key, policy.draft_tokens(key, rows=8), 0)
        policy.stepped(True)
    assert policy.shared < 0.1 and policy.draft_tokens(100, rows=8) == 0  # a newcomer does not draft
    steps = 0
    while all(policy.draft_tokens(key, rows=8) == 0 for key in range(8)):
        for key in range(8):
            policy.drafted(key, 0, 0)
        policy.stepped(False)
        steps += 1
    assert steps >= policy.recover  # without the shared rate: 10 steps at the prior's drift
    assert all(policy.draft_tokens(key, rows=8) <= 2 for key in range(8))  # a probe is short


def free() -> DraftBudget:
    """A budget that lets every step draft (the row choice under test, not the budget: test_draft_budget.py)."""
    return DraftBudget(fraction=1e9, backoff=0, min_plain=0, probe=1 << 20)


def make_request(prompt: list[int], output: list[int], **params) -> Request:
    request = Request(prompt, SamplingParams(max_tokens=params.pop("max_tokens", 50), **params))
    request.output_tokens = list(output)
    return request


class Recorder:
    """A proposer that drafts a fixed run and records what it was asked and told to forget."""

    reads_media = True
    cheap = False  # no shadow drafts (test_speculation_budget.py has those)

    def __init__(self, run: list[int]) -> None:
        self.run, self.asked, self.forgot = run, [], []

    def propose(self, rows):
        self.asked.append([(row.key, list(row.tokens), row.k) for row in rows])
        return [self.run[:row.k] for row in rows]

    def forget(self, key):
        self.forgot.append(key)

    def draft_cost(self):
        return 0.0

    def close(self):
        pass


def test_speculation_picks_rows_caps_drafts_counts_and_forgets():
    """Rows turned off, not eligible, or a token short of max_tokens get no drafts; the step's room
    caps the total; stats count what the verification kept; a request that left is forgotten."""
    clock = iter(range(100)).__next__
    source = Recorder([7, 7, 7, 7])
    spec = Speculation(source, SpeculationPolicy(max_draft=4, prior=1.0, budget=free()), lambda r: r.params.top_k != 1,
                       max_step_drafts=6, clock=lambda: float(clock()))
    a, b = make_request([1, 2], [3]), make_request([4], [5])
    off, ineligible = make_request([1], [2], speculative=False), make_request([1], [2], top_k=1)
    last = make_request([1], [2], max_tokens=2)
    rows = [a, b, off, ineligible, last]
    drafts = spec.drafts(rows, rows, room=100)
    assert drafts == {a.request_id: [7, 7, 7, 7], b.request_id: [7, 7]}  # 6 draft tokens a step at most
    assert source.asked[0][0] == (a.request_id, [1, 2, 3], 4)
    step = Step([BatchItem(r, [r.output_tokens[-1], *drafts.get(r.request_id, [])], 0, True,
                           len(drafts.get(r.request_id, []))) for r in rows])
    spec.started(step)
    outputs = {a.request_id: TokenOutput(9, accepted=(7, 7)), b.request_id: TokenOutput(9)}
    spec.verified(step, outputs)
    stats = spec.stats()
    assert (stats.drafted, stats.accepted, stats.speculating_rows, stats.rows, stats.tokens) == (6, 2, 2, 5, 7)
    assert spec.policy.rate(b.request_id) < spec.policy.rate(a.request_id) < 1.0
    assert spec.drafts([a], [a], room=3) == {a.request_id: [7, 7, 7]}
    assert sorted(source.forgot) == sorted(r.request_id for r in rows[1:])


def test_a_token_output_unrolls_its_accepted_drafts_first():
    out = TokenOutput(9, logprob=-0.5, accepted=(3, 4))
    assert [(o.token, o.accepted) for o in out.unrolled()] == [(3, ()), (4, ()), (9, ())]
    assert out.unrolled()[-1] == replace(out, accepted=())


class Untouched(list):
    """A step's rows that count every visit to them (iteration or indexing), so that a test sees
    whether speculation made a pass over them; their length is free."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.visits = 0

    def __iter__(self):
        self.visits += 1
        return super().__iter__()

    def __getitem__(self, at):
        self.visits += 1
        return super().__getitem__(at)


def test_a_step_beyond_max_rows_costs_no_work_per_row():
    """At 64-128 clients no row drafts (max_rows): the step's rows are not visited at all (before,
    the policy was asked for each row and each was counted in a pass over the step), only the
    counts kept; the step is still timed for the policy's cost line. A request that drafted while
    the batch was small is forgotten when it leaves, whatever the batch's size then."""
    clock = iter(range(100)).__next__
    source = Recorder([7])
    spec = Speculation(source, SpeculationPolicy(max_draft=1, max_rows=2, prior=1.0, budget=free()), lambda r: True,
                       max_step_drafts=10, clock=lambda: float(clock()))
    small = make_request([1], [2])
    assert spec.drafts([small], [small], room=10) == {small.request_id: [7]}
    spec.verified(Step([BatchItem(small, [2, 7], 0, True, 1)]), {small.request_id: TokenOutput(9)})
    many = [make_request([1], [2]) for _ in range(3)]
    decode = Untouched(many)
    assert spec.drafts(many, decode, room=10) == {} and decode.visits == 0
    step = Step(Untouched(BatchItem(r, [2], 0, True) for r in many))
    spec.started(step)
    spec.verified(step, {r.request_id: TokenOutput(9) for r in many})
    assert step.items.visits == 0 and len(source.asked) == 1
    assert spec.policy.cost._steps == 1  # timed: 3 decode rows, 3 tokens
    assert (spec.stats().rows, spec.stats().tokens) == (4, 4)
    assert source.forgot == [small.request_id]  # it left (not among the running): forgotten


class CountingTokens(list):
    """A row's tokens that count the reads of them (an index or a slice each)."""

    reads = 0

    def __getitem__(self, at):
        self.reads += 1
        return super().__getitem__(at)


def test_prompt_lookup_reads_a_long_row_in_one_slice():
    """The index is extended from one slice of the new tokens (a slice per position and n-gram
    size cost a list each: 2 x 4,000 for a 4,000-token prompt), and a later call reads only
    what came since."""
    p = NgramProposer(2, 4)
    tokens = CountingTokens(list(range(4000)) + [10, 11])
    assert draft(p, tokens) == [12, 13, 14, 15]
    assert tokens.reads <= 4
    tokens.extend([12, 13])
    tokens.reads = 0
    assert draft(p, tokens) == [14, 15, 16, 17] and tokens.reads <= 4
