"""The scheduler's policy objects without a model: the admission order (engine/admission.py: first
come first served, vLLM's priority, shortest prompt first with its bound on passes), slot lending
(engine/lending.py), each on its own and then driven through the Scheduler over the mock runner."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.admission import Fcfs, Priority, RequestQueue, ShortestFirst
from pflash_plugin.engine.lending import SlotLending
from pflash_plugin.engine.request import Request, RequestStatus
from pflash_plugin.engine.scheduler import SchedulerConfig

from mock_runner import make_request, make_scheduler, run_until_idle, step_once


def _request(n_tokens: int, priority: int = 0, first: int = 0) -> Request:
    request = make_request(list(range(first, first + n_tokens)), max_tokens=2)
    request.priority = priority
    return request


def _order(queue: RequestQueue) -> list[Request]:
    return [q[at] for q, at in queue.entries()]


# ---- admission order -------------------------------------------------------------------------
def test_fcfs_offers_slots_in_arrival_order_with_those_back_from_compression_first():
    queue = RequestQueue(Fcfs())
    a, b, c = _request(30), _request(5), _request(12, priority=-9)  # priority means nothing here
    resumed = _request(40)
    for request in (a, b, c):
        queue.add(request)
    queue.add(resumed, prepared=True)
    assert _order(queue) == [resumed, a, b, c]


def test_priority_offers_slots_lower_value_first_and_ties_in_arrival_order():
    queue = RequestQueue(Priority())
    a, b, urgent, late, urgent2, c = (_request(5, 0), _request(5, 0), _request(5, -1), _request(5, 5),
                                      _request(5, -1), _request(5, 0))
    for request in (a, b, urgent, late, urgent2, c):
        queue.add(request)
    assert _order(queue) == [urgent, urgent2, a, b, c, late]
    assert list(queue.waiting) == [urgent, urgent2, a, b, c, late]  # kept in that order, not sorted per call


def test_priority_ranks_across_tiers_and_keeps_compressed_ones_first_within_a_rank():
    queue = RequestQueue(Priority())
    waiting_urgent, waiting_plain = _request(5, -2), _request(5, 0)
    prepared_plain, prepared_low = _request(5, 0), _request(5, 3)
    queue.add(waiting_plain), queue.add(waiting_urgent)
    queue.add(prepared_low, prepared=True), queue.add(prepared_plain, prepared=True)
    assert _order(queue) == [waiting_urgent, prepared_plain, waiting_plain, prepared_low]


def test_a_lender_goes_back_within_its_priority_ahead_of_the_first_as_long():
    queue = RequestQueue(Priority())
    urgent_long, plain_short, plain_long, low = _request(40, -1), _request(3, 0), _request(40, 0), _request(3, 1)
    for request in (urgent_long, plain_short, plain_long, low):
        queue.add(request)
    lender = _request(40, 0)
    queue.requeue(lender)
    assert _order(queue) == [urgent_long, plain_short, lender, plain_long, low]


def test_shortest_first_orders_by_tokens_to_prefill_and_ties_in_arrival_order():
    queue = RequestQueue(ShortestFirst())
    long, mid, short, mid2 = _request(50), _request(20), _request(4), _request(20)
    for request in (long, mid, short, mid2):
        queue.add(request)
    assert _order(queue) == [short, mid, mid2, long]
    compressed = _request(60)
    compressed.prefill_tokens = compressed.prefill_tokens[:10]  # what it prefills counts, not what was sent
    queue.add(compressed)
    assert _order(queue) == [short, compressed, mid, mid2, long]


def test_shortest_first_passes_a_long_prompt_at_most_max_passes_times():
    """Unbounded, a steady stream of short prompts would hold a long one back for ever: here the
    long one is passed by `max_passes` later arrivals, then the shorter ones queue behind it."""
    queue = RequestQueue(ShortestFirst(max_passes=3))
    long = _request(500)
    queue.add(long)
    shorts = [_request(4, first=10 * k) for k in range(6)]
    for short in shorts:
        queue.add(short)
    assert _order(queue) == [*shorts[:3], long, *shorts[3:]]
    queue.take(queue.waiting, 0)  # the first short one starts: nothing of the bound changes
    assert _order(queue) == [*shorts[1:3], long, *shorts[3:]]


def test_an_unknown_schedule_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="fcfs, priority, shortest"):
        SchedulerConfig(n_slots=1, max_batch_tokens=8, max_ctx=64, max_queue=4, schedule_policy="lifo")


# ---- slot lending ------------------------------------------------------------------------------
def _prefilling(n_tokens: int, priority: int = 0) -> Request:
    request = _request(n_tokens, priority, first=100)
    request.status = RequestStatus.PREFILLING
    return request


def test_lending_gives_the_slot_with_the_most_prefill_left_to_a_prompt_at_most_half_as_long():
    lending = SlotLending()
    queue = RequestQueue()
    too_long, short = _request(31), _request(8)  # 31: more than half of the most left (60)
    queue.add(too_long), queue.add(short)
    forty, sixty = _prefilling(40), _prefilling(60)
    loan = lending.loan([forty, sixty], queue.entries(), lambda r: False)
    assert loan is not None and loan[0][loan[1]] is short and loan[2] is sixty
    lending.lent(sixty)
    loan = lending.loan([forty, sixty], queue.entries(), lambda r: False)
    assert loan is not None and loan[2] is forty  # each lends once
    assert lending.loan([forty, sixty], queue.entries(), lambda r: r is short) is None  # it waits for a prefill


def test_lending_never_takes_a_slot_from_a_request_ranked_ahead_of_the_borrower():
    ranked = SlotLending(Priority().rank)
    urgent_lender, plain_lender = _prefilling(60, priority=-1), _prefilling(40, priority=0)
    queue = RequestQueue(Priority())
    borrower = _request(8, priority=0)
    queue.add(borrower)
    loan = ranked.loan([urgent_lender, plain_lender], queue.entries(), lambda r: False)
    assert loan is not None and loan[2] is plain_lender  # fcfs would take the urgent one's (most left)
    assert ranked.loan([urgent_lender], queue.entries(), lambda r: False) is None
    assert SlotLending().loan([urgent_lender], queue.entries(), lambda r: False) is not None


# ---- through the scheduler, on the mock runner -------------------------------------------------
def _admission_order(policy: str, queued: list[tuple[int, int]]) -> list[int]:
    """One slot held by a decoding request, then requests queued behind it as (prompt tokens,
    priority) in arrival order: the indices of the queued ones in the order they started."""
    sched, runner = make_scheduler(n_slots=1, n_pages=64, max_batch_tokens=16, max_ctx=128,
                                   schedule_policy=policy)
    holder = make_request([1, 2, 3], max_tokens=4)
    assert sched.submit(holder) is None
    step_once(sched, runner)
    requests = []
    for k, (n_tokens, priority) in enumerate(queued):
        request = _request(n_tokens, priority, first=200 + 100 * k)
        assert sched.submit(request) is None and request.status is RequestStatus.WAITING
        requests.append(request)
    run_until_idle(sched, runner)
    ids = [r.request_id for r in requests]
    assert runner.started[0] == holder.request_id
    return [ids.index(i) for i in runner.started[1:]]


def test_the_scheduler_starts_queued_requests_in_each_policys_order():
    queued = [(30, 0), (10, 0), (20, -1), (5, 2)]
    assert _admission_order("fcfs", queued) == [0, 1, 2, 3]
    assert _admission_order("priority", queued) == [2, 0, 1, 3]
    assert _admission_order("shortest", queued) == [3, 1, 2, 0]


def test_under_priority_a_lent_slot_goes_only_to_a_request_the_lender_does_not_outrank():
    """Two slots, each a 40-token prompt; one has not prefilled into its slot. A short request of a
    lower priority does not take that slot from an urgent prompt (under fcfs it does)."""
    def run(policy: str) -> RequestStatus:
        sched, runner = make_scheduler(n_slots=2, n_pages=16, page_size=4, max_batch_tokens=8, max_ctx=64,
                                       per_slot=True, schedule_policy=policy)
        first, second = _request(40, -1, first=100), _request(40, -1, first=200)
        assert sched.submit(first, second) is None
        step_once(sched, runner)
        assert min(first.n_prefilled, second.n_prefilled) == 0
        short = _request(3, 0, first=7)
        assert sched.submit(short) is None
        status = short.status
        run_until_idle(sched, runner)
        return status

    assert run("fcfs") is RequestStatus.PREFILLING
    assert run("priority") is RequestStatus.WAITING
