"""Scheduler driven step by step over a mock runner that simulates llama.cpp's KV cells.

After every admission and every step, `check_scheduler` (tests/mock_runner.py) verifies that each
slot's KV sequence holds exactly `slot.tokens`, that the page refcounts match the slots holding
them, and that no page stands for more than page_size distinct cells, so the page accounting
never undercounts the cells in use. The mock KV has exactly the pool's cells, so an undercount
also shows up as DecodeError(1).
"""
from __future__ import annotations

import random

import pytest

from pflash_plugin.engine.request import ErrorEvent, ErrorKind, FinishEvent, RequestStatus, TextEvent
from pflash_plugin.engine.prefixes import common_prefix
from pflash_plugin.engine.scheduler import AdmissionError

from mock_runner import (
        EOG,
        check_scheduler,
        default_piece,
        idle_pages,
        make_request,
        make_scheduler,
        run_until_idle,
        sink_of,
        step_once,
    )


def run_alone(sched, runner, prompt, max_tokens=4, **kw):
    request = make_request(prompt, max_tokens, **kw)
    sched.check(request)
    sched.add(request)
    run_until_idle(sched, runner)
    return request


# ---- check() --------------------------------------------------------------------------------
def test_check_rejects_empty_prompt():
    sched, _ = make_scheduler()
    with pytest.raises(AdmissionError) as info:
        sched.check(make_request([], 4))
    assert info.value.kind is ErrorKind.INVALID


def test_check_rejects_prompt_plus_max_tokens_over_max_ctx_naming_both():
    sched, _ = make_scheduler(n_pages=64, max_ctx=80)
    sched.check(make_request(list(range(37)), 43))  # exactly max_ctx is fine
    with pytest.raises(AdmissionError) as info:
        sched.check(make_request(list(range(37)), 44))
    error = info.value
    assert error.kind is ErrorKind.TOO_LONG
    assert "37" in error.message and "44" in error.message and "80" in error.message


def test_check_rejects_request_larger_than_the_pool():
    sched, _ = make_scheduler(n_pages=4, page_size=4, max_ctx=1000)  # pool holds 16 tokens
    sched.check(make_request(list(range(10)), 6))  # 16 tokens: fits exactly
    with pytest.raises(AdmissionError) as info:
        sched.check(make_request(list(range(10)), 7))
    assert info.value.kind is ErrorKind.TOO_LONG
    assert "17" in info.value.message and "16" in info.value.message


def test_more_choices_than_slots_plus_queue_can_never_be_served():
    sched, _ = make_scheduler(n_slots=2, max_queue=4)
    sched.check(*[make_request([1, 2], 2) for _ in range(6)])  # exactly slots + queue: may wait its turn
    with pytest.raises(AdmissionError) as info:
        sched.check(*[make_request([1, 2], 2) for _ in range(7)])
    assert info.value.kind is ErrorKind.INVALID
    assert "7 choices" in info.value.message and "max_concurrency" in info.value.message


def test_requests_that_fit_free_slots_are_admitted_with_no_queue():
    sched, _ = make_scheduler(n_slots=2, max_queue=0)
    a, b = make_request([1, 2], 2), make_request([3, 4], 2)
    assert sched.submit(a, b) is None
    assert a.status is b.status is RequestStatus.PREFILLING
    late = make_request([5, 6], 2)
    error = sched.submit(late)
    sched.emit()
    assert error is not None and error.kind is ErrorKind.BUSY
    assert late.status is RequestStatus.FINISHED_REJECTED and [e.kind for e in sink_of(late).errors] == [ErrorKind.BUSY]


def test_a_clients_requests_are_admitted_all_or_none():
    sched, _ = make_scheduler(n_slots=2, max_queue=4)
    first = make_request([1, 2], 2)
    assert sched.submit(first) is None
    group = [make_request([10 + i, 11 + i], 2) for i in range(6)]  # 1 + 6 > 2 + 4
    assert sched.submit(*group).kind is ErrorKind.BUSY
    assert all(r.status is RequestStatus.FINISHED_REJECTED for r in group)
    assert sched.running == [first] and not sched.waiting  # none of them holds a slot or a place
    assert sched.submit(*[make_request([20 + i, 21 + i], 2) for i in range(5)]) is None
    assert len(sched.running) == 2 and len(sched.waiting) == 4


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


# ---- batching ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_decoding", [1, 3])
def test_long_prefill_never_stalls_decoding(n_decoding):
    budget = 8
    sched, runner = make_scheduler(
        n_slots=n_decoding + 1, n_pages=64, page_size=4, max_batch_tokens=budget, max_ctx=128
    )
    decoders = [make_request([10 * (i + 1), 10 * (i + 1) + 1], max_tokens=60) for i in range(n_decoding)]
    for request in decoders:
        sched.add(request)
    step_once(sched, runner)
    assert all(len(r.output_tokens) == 1 for r in decoders)

    long = make_request(list(range(100, 130)), max_tokens=2)  # 30 tokens > max_batch_tokens
    sched.add(long)
    chunks = []
    while long.prefill_left:
        produced = [len(r.output_tokens) for r in decoders]
        step_once(sched, runner)
        record = runner.steps[-1]
        for request in decoders:
            item = record.for_request(request.request_id)
            assert item is not None, "a running decode was left out of the step"
            assert len(item.tokens) == 1 and item.wants_logits
        assert [len(r.output_tokens) for r in decoders] == [n + 1 for n in produced]
        chunk = record.for_request(long.request_id)
        assert chunk is not None
        chunks.append(chunk)
        if long.prefill_left:
            assert long.output_tokens == []
            assert sum(len(i.tokens) for i in record.items) == budget, "the chunk must fill the budget"

    size = budget - n_decoding
    expected = [size] * (30 // size) + ([30 % size] if 30 % size else [])
    assert [len(c.tokens) for c in chunks] == expected
    assert [c.start_pos for c in chunks] == [sum(expected[:i]) for i in range(len(expected))]
    assert [t for c in chunks for t in c.tokens] == long.prompt_tokens
    assert [c.wants_logits for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(long.output_tokens) == 1
    run_until_idle(sched, runner)


def test_chunked_prefill_positions_contiguous_and_first_token_after_last_chunk():
    sched, runner = make_scheduler(max_batch_tokens=8)
    request = make_request(list(range(1, 21)), max_tokens=3)
    sched.add(request)
    for start, length, last in [(0, 8, False), (8, 8, False), (16, 4, True)]:
        step_once(sched, runner)
        (item,) = runner.steps[-1].items
        assert (item.start_pos, len(item.tokens), item.wants_logits) == (start, length, last)
        assert list(item.tokens) == request.prompt_tokens[start : start + length]
        if not last:
            assert request.output_tokens == []
            assert request.timings.first_token is None and request.timings.prefill_done is None
            assert request.status is RequestStatus.PREFILLING
    assert len(request.output_tokens) == 1
    assert request.timings.first_token is not None and request.timings.prefill_done is not None
    assert request.status is RequestStatus.DECODING
    run_until_idle(sched, runner)
    items = runner.items_of(request.request_id)
    assert [i.start_pos for i in items] == [0, 8, 16, 20, 21]
    assert [i.tokens for i in items[3:]] == [(t,) for t in request.output_tokens[:2]]
    assert sink_of(request).finish.reason == "length"


def test_shortest_remaining_prefill_goes_first():
    sched, runner = make_scheduler(n_slots=2, n_pages=32, max_batch_tokens=8, max_ctx=64)
    long = make_request(list(range(100, 130)), max_tokens=2)
    sched.add(long)
    step_once(sched, runner)  # 8 of 30 prefilled
    short = make_request([1, 2, 3], max_tokens=2)
    sched.add(short)
    step_once(sched, runner)
    items = runner.steps[-1].items
    # the short prompt finishes its prefill this step; no long chunk rides along to delay it
    assert [i.request_id for i in items] == [short.request_id]
    assert (len(items[0].tokens), items[0].wants_logits) == (3, True)
    assert len(short.output_tokens) == 1
    step_once(sched, runner)
    items = runner.steps[-1].items
    assert [i.request_id for i in items] == [long.request_id, short.request_id]  # in slot order
    assert (items[0].start_pos, len(items[0].tokens)) == (8, 7)  # the long one resumes beside its decode
    run_until_idle(sched, runner)


@pytest.mark.parametrize("aging", [1, 8])
def test_aging_lets_a_long_prompt_through_a_steady_stream_of_short_ones(aging):
    sched, runner = make_scheduler(n_slots=3, n_pages=64, max_batch_tokens=8, max_ctx=64, prefill_chunk=4, aging=aging)
    long = make_request(list(range(100, 140)), max_tokens=1)
    sched.add(long)
    steps = 0
    while not long.status.finished:
        # every step a short prompt arrives that can finish its prefill in that step
        sched.add(make_request([500 + steps % 400, 1], max_tokens=1))
        step_once(sched, runner)
        steps += 1
        assert steps < 200, f"the long prompt starved: {long.n_prefilled} of 40 prefilled"
    # it waited at most until its age made up for its length, then took a capped chunk a step
    assert steps <= 40 // aging + 40 // 4 + 2
    assert sink_of(long).finish.reason == "length"


def test_prefill_chunk_caps_a_prompt_only_while_others_are_active():
    sched, runner = make_scheduler(
        n_slots=2, n_pages=32, max_batch_tokens=16, max_ctx=64, prefill_chunk=4
    )
    alone = make_request(list(range(100, 120)), max_tokens=20)
    sched.add(alone)
    step_once(sched, runner)
    assert [len(i.tokens) for i in runner.steps[-1].items] == [16], "alone, a prompt takes the budget"
    step_once(sched, runner)
    other = make_request(list(range(200, 212)), max_tokens=2)
    sched.add(other)
    while other.prefill_left:
        step_once(sched, runner)
        record = runner.steps[-1]
        assert record.for_request(alone.request_id) is not None
    chunks = [len(i.tokens) for i in runner.items_of(other.request_id)]
    assert chunks == [4, 4, 4]
    run_until_idle(sched, runner)


# ---- prefix reuse ----------------------------------------------------------------------------
P = list(range(10, 20))


@pytest.mark.parametrize(
    "prompt, cached",
    [
        (P[:7] + [90, 91, 92], 7),
        (P, 9),  # identical prompt: the last token must still run
        (P[:5], 4),  # a prefix of the cache: at most len - 1
        (P[:1], 0),
    ],
)
def test_prefix_reuse_in_place(prompt, cached):
    sched, runner = make_scheduler(n_slots=2, max_batch_tokens=16)
    first = run_alone(sched, runner, P, max_tokens=3)
    slot = sched.slots[first.slot]
    assert slot.tokens == P + first.output_tokens[:2]
    second = make_request(prompt, max_tokens=2)
    sched.add(second)
    step_once(sched, runner)
    assert second.cached_tokens == cached
    if cached:
        assert second.slot == first.slot
        assert ("seq_rm", first.slot, cached) in runner.ops
    assert runner.ops_of("seq_cp") == []
    (item,) = runner.items_of(second.request_id)
    assert item.start_pos == cached
    assert list(item.tokens) == prompt[cached:]
    run_until_idle(sched, runner)
    usage = sink_of(second).finish.usage
    assert usage.cached_tokens == cached
    assert usage.prompt_tokens == len(prompt)


def test_prefix_reuse_includes_generated_tokens():
    sched, runner = make_scheduler(n_slots=2, max_batch_tokens=16)
    first = run_alone(sched, runner, P, max_tokens=4)
    follow_up = P + first.output_tokens[:3] + [700, 701]  # a chat turn continuing the answer
    second = make_request(follow_up, max_tokens=2)
    sched.add(second)
    step_once(sched, runner)
    assert second.cached_tokens == len(P) + 3
    assert list(runner.items_of(second.request_id)[0].tokens) == [700, 701]
    run_until_idle(sched, runner)


def test_prefix_reuse_skips_the_slot_without_the_prefix():
    sched, runner = make_scheduler(n_slots=3, max_batch_tokens=16)
    a = run_alone(sched, runner, [1, 2, 3, 4, 5, 6], max_tokens=2)
    b = run_alone(sched, runner, P, max_tokens=2)
    assert a.slot != b.slot
    c = make_request(P[:8] + [99], max_tokens=2)
    sched.add(c)
    step_once(sched, runner)
    assert (c.slot, c.cached_tokens) == (b.slot, 8)
    assert sched.slots[a.slot].tokens[:6] == a.prompt_tokens, "an unrelated cache was destroyed"


@pytest.mark.parametrize("reuse", [5, 8, 9])
def test_prefix_reuse_from_busy_slot_through_seq_cp(reuse):
    sched, runner = make_scheduler(n_slots=2, n_pages=32, page_size=4, max_batch_tokens=16, max_ctx=64)
    pool = sched.cache.pools[0]
    a = make_request(P, max_tokens=20)  # 30 tokens: 8 pages
    sched.add(a)
    step_once(sched, runner)
    step_once(sched, runner)
    assert a.slot == 0 and a.status is RequestStatus.DECODING
    used = pool.used_pages
    b = make_request(P[:reuse] + [500, 501], max_tokens=5)
    sched.add(b)
    step_once(sched, runner)
    assert b.slot == 1 and b.cached_tokens == reuse
    assert runner.ops_of("seq_cp") == [("seq_cp", 0, 1, reuse)]
    s0, s1 = sched.slots
    n_shared = reuse // 4
    assert s1.pages[:n_shared] == s0.pages[:n_shared]
    assert all(pool.shared(p) for p in s0.pages[:n_shared])
    assert not set(s1.pages[n_shared:]) & set(s0.pages), "only whole pages may be shared"
    assert not any(pool.shared(p) for p in s0.pages[n_shared:])
    assert pool.used_pages == used + pool.pages_for(b.reserve_tokens) - n_shared
    item = runner.steps[-1].for_request(b.request_id)
    assert (item.start_pos, list(item.tokens)) == (reuse, [500, 501])
    assert runner.steps[-1].for_request(a.request_id) is not None, "the source kept decoding"
    run_until_idle(sched, runner)
    assert sink_of(a).finish.reason == sink_of(b).finish.reason == "length"
    assert pool.used_pages == idle_pages(sched)


def test_copy_on_write_of_a_shared_partial_page():
    sched, runner = make_scheduler(n_slots=2, n_pages=32, page_size=4, max_batch_tokens=16, max_ctx=64)
    pool = sched.cache.pools[0]
    a = make_request(P, max_tokens=20)
    sched.add(a)
    step_once(sched, runner)
    step_once(sched, runner)
    b = make_request(P[:9] + [500, 501], max_tokens=5)
    sched.add(b)
    run_until_idle(sched, runner)
    s0, s1 = sched.slots
    assert s0.pages[:2] == s1.pages[:2] and all(pool.shared(p) for p in s0.pages[:2])

    # 6 tokens of reuse end inside page 1, which both caches share: it must not be written into
    c = make_request(P[:6] + [700, 701], max_tokens=2)
    sched.add(c)
    step_once(sched, runner)
    assert c.cached_tokens == 6
    dst = sched.slots[c.slot]
    other = sched.slots[1 - c.slot]
    assert dst.pages[0] == other.pages[0] and pool.shared(other.pages[0])
    assert other.pages[1] not in dst.pages, "the shared partial page was kept for writing"
    assert not pool.shared(other.pages[1])
    assert runner.ops_of("seq_cp") == [("seq_cp", 0, 1, 9)]
    run_until_idle(sched, runner)
    assert sink_of(c).finish.reason == "length"
    assert pool.used_pages == idle_pages(sched)


def test_in_place_reuse_keeps_an_unshared_partial_page():
    sched, runner = make_scheduler(n_slots=1, page_size=4, max_batch_tokens=16)
    run_alone(sched, runner, P, max_tokens=3)
    before = list(sched.slots[0].pages)
    b = make_request(P[:6] + [700], max_tokens=2)
    sched.add(b)
    step_once(sched, runner)
    assert b.cached_tokens == 6
    assert sched.slots[0].pages[:2] == before[:2]
    assert sched.cache.used_pages == sched.cache.pages_for(b.reserve_tokens)
    run_until_idle(sched, runner)


# ---- pool pressure ---------------------------------------------------------------------------
def test_full_pool_queues_and_admits_as_pages_free():
    sched, runner = make_scheduler(n_slots=4, n_pages=6, page_size=4, max_batch_tokens=16, max_ctx=32)
    requests = [make_request([100 * i + k for k in range(6)], max_tokens=6) for i in range(1, 7)]
    for request in requests:  # each reserves 12 tokens = 3 pages: two fit at a time
        sched.check(request)
        sched.add(request)
    most = 0
    while sched.has_work:
        step = step_once(sched, runner)
        assert step.items
        most = max(most, len(sched.running))
        assert sched.cache.used_pages <= 6
    assert most == 2
    assert runner.started == [r.request_id for r in requests], "admission must stay FIFO"
    for request in requests:
        sink = sink_of(request)
        assert sink.errors == []
        assert sink.finish.reason == "length" and len(request.output_tokens) == 6


def _three_caches():
    sched, runner = make_scheduler(n_slots=3, n_pages=10, page_size=4, max_batch_tokens=16, max_ctx=40)
    a = run_alone(sched, runner, list(range(1, 9)))
    b = run_alone(sched, runner, list(range(101, 109)))
    c = run_alone(sched, runner, list(range(201, 209)))
    assert (a.slot, b.slot, c.slot) == (0, 1, 2)
    assert sched.cache.used_pages == 9  # 11 tokens each
    a2 = run_alone(sched, runner, a.prompt_tokens)  # A is now the most recently used cache
    assert (a2.slot, a2.cached_tokens) == (0, 7)
    assert sched.cache.used_pages == 9
    return sched, runner, a, b, c


def test_lru_eviction_spares_the_most_recently_used_cache():
    sched, runner, a, b, c = _three_caches()
    d = make_request(c.prompt_tokens + [900, 901, 902, 903], max_tokens=8)  # 5 pages, 2 reused
    sched.add(d)
    runner.ops.clear()
    step_once(sched, runner)
    assert (d.slot, d.cached_tokens) == (2, 8)
    assert ("seq_rm", 1, 0) in runner.ops
    assert sched.slots[1].tokens == [] and sched.slots[1].pages == []
    assert runner.seq_tokens(1) == []
    assert sched.slots[0].tokens[:8] == a.prompt_tokens, "the most recently used cache was evicted"
    assert runner.seq_tokens(0) == sched.slots[0].tokens
    run_until_idle(sched, runner)


def test_lru_eviction_evicts_in_order_until_enough():
    sched, runner, a, b, c = _three_caches()
    d = make_request(c.prompt_tokens + [900, 901, 902, 903], max_tokens=20)  # 8 pages, 2 reused
    sched.add(d)
    runner.ops.clear()
    step_once(sched, runner)
    assert d.slot == 2 and d.cached_tokens == 8
    evictions = [op for op in runner.ops if op[0] == "seq_rm" and op[2] == 0]
    assert evictions == [("seq_rm", 1, 0), ("seq_rm", 0, 0)]
    run_until_idle(sched, runner)


def test_reuse_kept_for_a_request_that_needs_the_whole_pool():
    sched, runner = make_scheduler(n_slots=2, n_pages=6, page_size=4, max_batch_tokens=32, max_ctx=24)
    run_alone(sched, runner, list(range(1, 13)), max_tokens=4)  # cache: 15 tokens, 4 pages
    other = run_alone(sched, runner, [300, 301], max_tokens=2)  # a second cache: 1 page
    # shares 8 tokens with the first cache and needs all 6 pages: the other cache is evicted
    b = make_request(list(range(1, 9)) + [500] * 8, max_tokens=8)
    sched.add(b)
    step_once(sched, runner)
    assert b.status.running
    assert b.cached_tokens == 8
    assert sched.slots[other.slot].tokens == []
    assert sched.cache.used_pages == 6
    run_until_idle(sched, runner)
    assert sink_of(b).finish.reason == "length"


# ---- cancel / fail -----------------------------------------------------------------------------
def test_cancel_waiting_request():
    sched, runner = make_scheduler(n_slots=1)
    a = make_request([1, 2, 3], max_tokens=10)
    b = make_request([4, 5, 6], max_tokens=3)
    sched.add(a)
    sched.add(b)
    step_once(sched, runner)
    assert b in sched.waiting and b.slot is None
    used = sched.cache.used_pages
    sched.finish(b, RequestStatus.FINISHED_CANCELLED)
    sched.emit()
    assert b not in sched.waiting
    assert (b.status, b.finish_reason) == (RequestStatus.FINISHED_CANCELLED, "cancelled")
    assert [type(e) for e in sink_of(b).events] == [FinishEvent]
    assert sink_of(b).finish.reason == "cancelled"
    assert sink_of(b).finish.usage.completion_tokens == 0
    assert sched.cache.used_pages == used
    sched.finish(b, RequestStatus.FINISHED_CANCELLED)  # a second cancel is a no-op
    sched.emit()
    assert len(sink_of(b).events) == 1
    run_until_idle(sched, runner)
    assert b.request_id not in runner.started


def test_cancel_running_request_frees_its_reservation():
    sched, runner = make_scheduler(n_slots=2, n_pages=16, page_size=4, max_batch_tokens=8)
    pool = sched.cache.pools[0]
    a = make_request(list(range(1, 11)), max_tokens=30)  # reserves 40 tokens = 10 pages
    sched.add(a)
    for _ in range(3):
        step_once(sched, runner)
    assert len(a.output_tokens) == 2 and pool.used_pages == 10
    sched.finish(a, RequestStatus.FINISHED_CANCELLED)
    sched.emit()
    slot = sched.slots[a.slot]
    assert slot.request is None and a not in sched.running
    assert slot.tokens == a.prompt_tokens + a.output_tokens[:1]
    assert pool.used_pages == pool.pages_for(11) == idle_pages(sched)
    assert ("end", a.slot) in runner.ops
    sink = sink_of(a)
    assert isinstance(sink.events[-1], FinishEvent) and sink.events[-1].reason == "cancelled"
    assert sink.events[-1].usage.completion_tokens == 2
    assert sink.text == "".join(default_piece(t).decode() for t in a.output_tokens)
    check_scheduler(sched, runner)
    # what was written stays a usable prefix cache
    b = make_request(a.prompt_tokens, max_tokens=2)
    sched.add(b)
    step_once(sched, runner)
    assert (b.slot, b.cached_tokens) == (a.slot, 9)
    run_until_idle(sched, runner)


def test_cancel_during_prefill_keeps_only_the_written_chunks():
    sched, runner = make_scheduler(n_slots=1, n_pages=16, page_size=4, max_batch_tokens=8)
    a = make_request(list(range(1, 21)), max_tokens=10)
    sched.add(a)
    step_once(sched, runner)
    sched.finish(a, RequestStatus.FINISHED_CANCELLED)
    sched.emit()
    assert sched.slots[0].tokens == a.prompt_tokens[:8]
    assert sched.cache.used_pages == 2
    assert sink_of(a).finish.reason == "cancelled"
    assert sink_of(a).text == ""
    check_scheduler(sched, runner)
    assert not sched.has_work


def test_fail_running_request_emits_error_and_frees():
    sched, runner = make_scheduler()
    a = make_request([1, 2, 3, 4, 5], max_tokens=20)
    sched.add(a)
    step_once(sched, runner)
    step_once(sched, runner)
    sched.fail(a, RuntimeError("boom"), "testing")
    sched.emit()
    sink = sink_of(a)
    assert sink.finish is None, "an error is not followed by a finish"
    assert [e.kind for e in sink.errors] == [ErrorKind.FAILED]
    assert sink.errors[0].message == f"request {a.request_id}: testing failed: RuntimeError: boom"
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED_ERROR, "error")
    assert a not in sched.running and sched.slots[a.slot].request is None
    assert sched.cache.used_pages == idle_pages(sched) == sched.cache.pages_for(6)
    check_scheduler(sched, runner)


def test_fail_waiting_request():
    sched, runner = make_scheduler(n_slots=1)
    a = make_request([1, 2], max_tokens=5)
    b = make_request([3, 4], max_tokens=5)
    sched.add(a)
    sched.add(b)
    step_once(sched, runner)
    sched.fail(b, RuntimeError("nope"), "testing")
    sched.emit()
    assert b not in sched.waiting
    assert [type(e) for e in sink_of(b).events] == [ErrorEvent]
    run_until_idle(sched, runner)
    assert b.request_id not in runner.started


@pytest.mark.parametrize("cached_prefix", [False, True])
def test_start_request_value_error_fails_only_that_request(cached_prefix):
    sched, runner = make_scheduler(n_slots=1, max_batch_tokens=16)
    if cached_prefix:
        run_alone(sched, runner, P, max_tokens=2)
    bad = make_request(P + [1], max_tokens=3, grammar="bad")
    good = make_request(P + [2], max_tokens=3)
    sched.add(bad)
    sched.add(good)
    step_once(sched, runner)
    errors = sink_of(bad).errors
    assert [e.kind for e in errors] == [ErrorKind.INVALID]
    assert "grammar" in errors[0].message
    assert sink_of(bad).finish is None
    assert (bad.status, bad.finish_reason) == (RequestStatus.FINISHED_REJECTED, "rejected")
    assert bad not in sched.waiting and bad not in sched.running
    assert good.status.running and good.slot == 0
    assert good.cached_tokens == (len(P) if cached_prefix else 0)
    run_until_idle(sched, runner)
    assert sink_of(good).finish.reason == "length"
    assert sched.cache.used_pages == idle_pages(sched)


# ---- stop conditions ---------------------------------------------------------------------------
PIECES = {10: b"Hello", 11: b" wo", 12: b"rld", 13: b"!", 20: b"a", 21: b"b", 22: b"cX"}


def piece(token: int) -> bytes:
    return PIECES.get(token, default_piece(token))


def scripted(tokens, max_tokens=10, stop=None, prompt=(1, 2, 3)):
    sched, runner = make_scheduler(piece=piece)
    request = make_request(list(prompt), max_tokens, stop=stop)
    runner.scripts[request.request_id] = list(tokens)
    sched.add(request)
    run_until_idle(sched, runner)
    return sched, runner, request, sink_of(request)


def test_eog_stops_without_emitting_its_text():
    sched, runner, request, sink = scripted([20, 21, EOG, 22])
    assert sink.text == "ab"
    assert "<EOS>" not in sink.text
    assert sink.finish.reason == "stop"
    assert request.output_tokens == [20, 21]  # like llama-cpp-python: the EOG is not a completion token
    assert sink.text_tokens == [20, 21]
    usage = sink.finish.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, 2)
    assert sched.slots[0].tokens == [1, 2, 3, 20, 21], "the EOG token is never decoded"


def test_eog_releases_text_held_for_a_stop_prefix():
    _, _, _, sink = scripted([22, EOG], stop=["XYZ"])
    assert sink.text == "cX"
    assert sink.finish.reason == "stop"


def test_stop_string_spanning_tokens_cuts_the_text():
    sched, runner, request, sink = scripted([10, 11, 12, 13], stop=["world"])
    assert sink.text == "Hello "
    assert sink.finish.reason == "stop"
    assert request.output_tokens == [10, 11, 12]
    assert sink.finish.usage.completion_tokens == 3
    assert [type(e) for e in sink.events][-1] is FinishEvent


def test_stop_string_drops_an_incomplete_character_after_it():
    PIECES[14] = b"rld\xe2\x82"  # the stop completes mid-token, a partial "€" follows
    try:
        _, _, request, sink = scripted([10, 11, 14, 13], stop=["world"])
    finally:
        del PIECES[14]
    assert sink.text == "Hello "
    assert sink.finish.reason == "stop"


def test_max_tokens_finishes_with_length_and_flushes_held_text():
    sched, runner, request, sink = scripted([20, 21, 22, 13], max_tokens=3, stop=["XYZ"])
    assert sink.finish.reason == "length"
    assert request.output_tokens == [20, 21, 22]
    assert sink.text == "abcX"
    assert sink.text_tokens == [20, 21, 22], "every token is reported with the text it produced"
    usage = sink.finish.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, 3)
    assert sched.slots[0].tokens == [1, 2, 3, 20, 21]


def test_text_events_carry_their_tokens_across_utf8_splits():
    euro = "€".encode()
    pieces = {30: euro[:1], 31: euro[1:2], 32: euro[2:], 33: b"!"}
    sched, runner = make_scheduler(piece=lambda t: pieces.get(t, default_piece(t)))
    request = make_request([1, 2], max_tokens=4)
    runner.scripts[request.request_id] = [30, 31, 32, 33]
    sched.add(request)
    run_until_idle(sched, runner)
    texts = [(e.text, [t.token for t in e.tokens]) for e in sink_of(request).events if isinstance(e, TextEvent)]
    assert texts == [("€", [30, 31, 32]), ("!", [33])]


def test_usage_counts_the_client_prompt_not_the_compressed_prefill():
    sched, runner = make_scheduler()
    request = make_request(list(range(1, 11)), max_tokens=2, prefill=[1, 2, 9, 10])
    sched.add(request)
    run_until_idle(sched, runner)
    usage = sink_of(request).finish.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (10, 2)
    assert sched.slots[0].tokens[:4] == [1, 2, 9, 10]


# ---- misc -------------------------------------------------------------------------------------
def test_status_reports_slots_and_pages():
    sched, runner = make_scheduler(n_slots=3, max_batch_tokens=4)
    a = run_alone(sched, runner, [1, 2, 3], max_tokens=2)  # idle cache of 4 tokens
    b = make_request([50, 51], max_tokens=5)
    c = make_request(list(range(60, 70)), max_tokens=5)
    sched.add(b)
    sched.add(c)
    step_once(sched, runner)
    stats = sched.stats()
    states = {s.request_id: s.state for s in stats.slots}
    assert states[b.request_id] == "decode" and states[c.request_id] == "prefill"
    assert states[None] == "idle"
    assert stats.running == 2 and stats.waiting == 0
    assert stats.cache.kv_pages_used == sched.cache.used_pages
    assert stats.cache.prefix_cache_tokens == len(a.prompt_tokens) + 1


# ---- random load ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, page_size, per_slot", [(1, 4, False), (2, 3, False), (3, 1, False), (4, 16, False),
                                                      (5, 4, True), (6, 3, True), (7, 16, True)])
def test_random_mixed_load_returns_to_idle(seed, page_size, per_slot):
    """Every invariant of check_scheduler after every step, unified or with a KV stream per slot
    (where each slot's cells must stay in its own stream and prefixes are copied whole-stream)."""
    rng = random.Random(seed)
    n_pages = (48 if per_slot else 96) // page_size
    sched, runner = make_scheduler(
        n_slots=4,
        n_pages=n_pages,
        page_size=page_size,
        max_batch_tokens=rng.choice([4, 8, 16]),
        max_ctx=48,
        max_queue=8,
        per_slot=per_slot,
        min_copy_tokens=4 if per_slot else 0,
    )
    bases = [[rng.randrange(1, 200) for _ in range(24)] for _ in range(4)]
    requests = []
    outcome: dict[int, str] = {}
    target = 250
    steps = 0
    while len(requests) < target or sched.has_work:
        if len(requests) < target and rng.random() < 0.5:
            prompt = rng.choice(bases)[: rng.randint(0, 24)] + [
                rng.randrange(200, 400) for _ in range(rng.randint(0, 6))
            ]
            request = make_request(
                prompt or [1],
                rng.randint(1, 16),
                stop=["<7>"] if rng.random() < 0.1 else None,
                grammar="bad" if rng.random() < 0.03 else None,
            )
            if rng.random() < 0.1:
                runner.scripts[request.request_id] = [rng.randrange(50) for _ in range(rng.randint(0, 3))] + [EOG]
            try:
                sched.check(request)
            except AdmissionError as error:
                assert error.kind is ErrorKind.BUSY
            else:
                sched.add(request)
                requests.append(request)
        live = [r for r in requests if not r.status.finished]
        roll = rng.random()
        if live and roll < 0.06:
            victim = rng.choice(live)
            outcome[victim.request_id] = "cancelled"
            sched.finish(victim, RequestStatus.FINISHED_CANCELLED)
        elif live and roll < 0.08:
            victim = rng.choice(live)
            outcome[victim.request_id] = "failed"
            sched.fail(victim, RuntimeError("random failure"), "testing")
        step = step_once(sched, runner)
        assert step.items or not sched.has_work, "work left but nothing scheduled"
        steps += 1
        assert steps < 20_000

    for request in requests:
        sink = sink_of(request)
        assert len(sink.terminal) == 1, f"request {request.request_id}: {sink.events}"
        assert request.status.finished
        expected = outcome.get(request.request_id)
        if request.params.grammar == "bad" and expected is None:
            assert sink.errors[0].kind is ErrorKind.INVALID
        elif expected == "failed":
            assert sink.errors and sink.errors[0].kind is ErrorKind.FAILED
        elif expected == "cancelled":
            assert sink.finish.reason == "cancelled"
        else:
            assert sink.finish.reason in ("stop", "length")
            if sink.finish.reason == "length":
                assert len(request.output_tokens) == request.params.max_tokens
            assert sink.finish.usage.completion_tokens == len(request.output_tokens)

    assert not sched.running and not sched.waiting
    check_scheduler(sched, runner)
    for slot in sched.slots:
        assert len(slot.pages) == sched.cache.pages_for(len(slot.tokens))
    assert sched.cache.used_pages == idle_pages(sched)
    assert sum(r.cached_tokens for r in requests) > 0, "the load never reused a prefix"
    assert runner.ops_of("seq_cp"), "the load never copied a prefix between slots"
    caches = sum(1 for s in sched.slots if s.tokens)
    assert caches > 0 and sched.cache.evict_idle() == caches
    assert sched.cache.used_pages == 0 and runner.cells_used == 0
    assert sched.cache.evict_idle() == 0


# ---- regressions found in review -----------------------------------------------------------------
def test_finish_between_schedule_and_update_leaves_no_unaccounted_cells():
    sched, runner = make_scheduler(n_slots=2, n_pages=8, page_size=4, max_batch_tokens=8)
    a = make_request(list(range(1, 21)), max_tokens=4)
    sched.add(a)
    step = sched.schedule()  # first chunk: 8 tokens, no logits
    sched.finish(a, RequestStatus.FINISHED_CANCELLED)  # e.g. a cancel handled while the step is in flight
    runner.require_active = False  # the real runner decodes a no-logits chunk without a sampler
    # between execute and update the cells are ahead of the pages: check only once update ran
    runner.pool, pool, runner.check_every_step = None, runner.pool, False
    outputs = runner.execute(step)
    sched.update(step, outputs)
    runner.pool = pool
    check_scheduler(sched, runner)


def test_new_request_takes_an_empty_slot_before_destroying_a_cache():
    sched, runner = make_scheduler(n_slots=2, n_pages=16, max_batch_tokens=16)
    a = run_alone(sched, runner, P, max_tokens=3)
    assert a.slot == 0
    b = make_request([300, 301, 302], max_tokens=10)
    sched.add(b)
    step_once(sched, runner)
    assert b.slot == 1
    error = ErrorEvent(ErrorKind.FAILED, "llama_decode returned -1")
    sched.finish(b, RequestStatus.FINISHED_ERROR, error, forget_kv=True)  # what Engine._fail_step does
    assert sched.slots[1].tokens == []
    c = make_request([400, 401, 402], max_tokens=2)
    sched.add(c)
    step_once(sched, runner)
    assert sched.slots[0].tokens[: len(P)] == P, "A's cache was destroyed while slot 1 was empty"


def test_each_flush_runs_once_per_step_after_its_sinks_and_a_failing_one_fails_its_requests():
    sched, runner = make_scheduler(n_slots=3, max_batch_tokens=16)
    log: list[str] = []

    def healthy() -> None:
        log.append("flush")

    def broken() -> None:
        raise RuntimeError("event loop is closed")

    a, b, c = (make_request([5, 6, 7], max_tokens=3) for _ in range(3))
    for request, flush in ((a, healthy), (b, healthy), (c, broken)):
        request.flush = flush
        collector = request.sink
        request.sink = lambda event, collector=collector: (log.append("event"), collector(event))
        sched.add(request)
    step_once(sched, runner)
    assert log == ["event"] * 3 + ["flush"]  # two requests share one flush, called once, last
    assert c.status.finished and not a.status.finished and not b.status.finished
    run_until_idle(sched, runner)
    assert a.status.name == b.status.name == "FINISHED_LENGTH" and c.status.name == "FINISHED_ERROR"
    assert log.count("flush") == 3  # one per step that gave a or b an event
    check_scheduler(sched, runner)


# ---- a KV stream per slot ----------------------------------------------------------------------
def test_per_slot_streams_copy_a_busy_slots_prefix_only_when_it_is_long_enough():
    """A prefix in another slot's stream is copied (whole stream, then trimmed) when it beats the
    chosen slot's own reuse by min_copy_tokens; a shorter one is prefilled again. The source
    stream is never touched, and each slot's cells stay in its own stream (check_scheduler)."""
    sched, runner = make_scheduler(n_slots=3, n_pages=16, page_size=4, max_batch_tokens=32, max_ctx=64,
                                   per_slot=True, min_copy_tokens=8)
    base = list(range(100, 120))
    a = make_request(base, max_tokens=30)
    sched.add(a)
    step_once(sched, runner)
    assert a.slot == 0 and a.status is RequestStatus.DECODING
    short = make_request(base[:6] + [900, 901], max_tokens=2)  # shares 6 < 8 tokens: not worth a copy
    sched.add(short)
    step_once(sched, runner)
    assert short.cached_tokens == 0 and not runner.ops_of("seq_cp")
    long = make_request(base[:12] + [700, 701], max_tokens=2)  # shares 12 >= 8 tokens: copied
    sched.add(long)
    step_once(sched, runner)
    assert long.cached_tokens == 12 and runner.ops_of("seq_cp") == [("seq_cp", 0, long.slot, 12)]
    assert runner.seq_tokens(long.slot)[:12] == base[:12]
    assert runner.seq_tokens(0)[:20] == base, "the source stream changed"
    run_until_idle(sched, runner)
    assert all(sink_of(r).finish.reason == "length" for r in (a, short, long))


def test_a_request_fills_a_stream_exactly_and_one_token_more_is_refused_naming_both_sizes():
    sched, runner = make_scheduler(n_slots=2, n_pages=8, page_size=4, max_batch_tokens=16, max_ctx=64, per_slot=True)
    exact = make_request(list(range(1, 25)), max_tokens=8)  # 32 tokens: the 8 pages of one stream
    sched.add(exact)
    run_until_idle(sched, runner)
    assert sink_of(exact).finish.reason == "length"
    over = make_request(list(range(1, 25)), max_tokens=9)
    with pytest.raises(AdmissionError) as refused:
        sched.check(over)
    assert refused.value.kind is ErrorKind.TOO_LONG
    assert "33 KV tokens" in refused.value.message and "a slot's KV stream holds 32" in refused.value.message
    unified, _ = make_scheduler(n_slots=2, n_pages=16, page_size=4, max_ctx=64)  # the same cells, shared
    unified.check(over)


# ---- a slot lent by a prompt that has not begun its prefill ---------------------------------------
def _two_long_prompts(per_slot: bool = True):
    """Two slots taken by 40-token prompts; after one step (8 tokens of budget, shortest first) one
    of them has prefilled, the other holds its slot without having prefilled into it."""
    sched, runner = make_scheduler(n_slots=2, n_pages=16 if per_slot else 32, page_size=4, max_batch_tokens=8,
                                   max_ctx=64, per_slot=per_slot)
    first, second = make_request(list(range(100, 140)), max_tokens=2), make_request(list(range(200, 240)), max_tokens=2)
    assert sched.submit(first, second) is None
    step_once(sched, runner)
    started, unstarted = sorted((first, second), key=lambda r: -r.n_prefilled)
    assert started.n_prefilled > 0 and unstarted.n_prefilled == 0
    return sched, runner, started, unstarted


def test_a_short_request_takes_the_slot_of_a_long_prompt_that_has_not_begun_its_prefill():
    sched, runner, started, unstarted = _two_long_prompts()
    short, lent = make_request([7, 8, 9], max_tokens=2), unstarted.slot
    assert sched.submit(short) is None
    assert short.status is RequestStatus.PREFILLING and short.slot == lent
    assert unstarted.status is RequestStatus.WAITING and unstarted.slot is None
    run_until_idle(sched, runner)
    for request in (started, unstarted, short):
        assert sink_of(request).finish.reason == "length" and len(request.output_tokens) == 2
    first_short = next(r.index for r in runner.steps if r.for_request(short.request_id))
    first_unstarted = next(r.index for r in runner.steps if r.for_request(unstarted.request_id))
    assert first_short < first_unstarted
    check_scheduler(sched, runner)


def test_a_short_request_queued_behind_a_long_one_still_takes_a_lent_slot():
    """The long one queued ahead could not take that slot (not half the lender's tokens); the short
    one need not wait behind it for a slot that frees."""
    sched, runner, started, unstarted = _two_long_prompts()
    long_queued, short = make_request(list(range(300, 340)), max_tokens=2), make_request([7, 8, 9], max_tokens=2)
    lent = unstarted.slot
    assert sched.submit(long_queued) is None and long_queued.status is RequestStatus.WAITING
    assert sched.submit(short) is None
    assert short.status is RequestStatus.PREFILLING and short.slot == lent
    assert unstarted.status is RequestStatus.WAITING and long_queued.status is RequestStatus.WAITING
    assert list(sched.waiting) == [unstarted, long_queued]  # the lender back ahead of the equally long one
    run_until_idle(sched, runner)
    for request in (started, unstarted, long_queued, short):
        assert sink_of(request).finish.reason == "length" and len(request.output_tokens) == 2
    check_scheduler(sched, runner)


def test_no_slot_is_lent_once_its_prompt_has_prefilled_or_to_a_prompt_not_half_as_long():
    sched, runner, started, unstarted = _two_long_prompts()
    not_half = make_request(list(range(300, 321)), max_tokens=2)  # 21 tokens: more than half of 40
    assert sched.submit(not_half) is None and not_half.status is RequestStatus.WAITING
    step_once(sched, runner)  # both long prompts have prefilled by now
    assert unstarted.n_prefilled > 0 or started.prefill_left == 0
    short = make_request([7, 8, 9], max_tokens=2)
    assert sched.submit(short) is None and short.status is RequestStatus.WAITING
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_unified_pool_lends_no_slot():
    sched, runner, _, unstarted = _two_long_prompts(per_slot=False)
    short = make_request([7, 8, 9], max_tokens=2)
    assert sched.submit(short) is None
    assert short.status is RequestStatus.WAITING and unstarted.status is RequestStatus.PREFILLING


def test_a_prompt_lends_its_slot_once():
    sched, runner, started, unstarted = _two_long_prompts()
    short = make_request([7, 8, 9], max_tokens=2)
    sched.submit(short)
    while unstarted.status is RequestStatus.WAITING:  # until the short one ends and gives the slot back
        step_once(sched, runner)
    assert unstarted.n_prefilled == 0  # the other long prompt took the step's budget again
    again = make_request([4, 5, 6], max_tokens=2)
    assert sched.submit(again) is None and again.status is RequestStatus.WAITING
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_prompt_that_reuses_a_cached_prefix_longer_than_the_newcomer_lends_no_slot():
    """Its slot holds the 40 tokens it reuses: a 3-token borrower would drop those cells."""
    sched, runner = make_scheduler(n_slots=2, n_pages=16, page_size=4, max_batch_tokens=8, max_ctx=64, per_slot=True)
    history = list(range(100, 140))
    assert sched.submit(make_request(history, max_tokens=1)) is None
    run_until_idle(sched, runner)
    extended, other = make_request(history + list(range(500, 520)), max_tokens=2), make_request(list(range(300, 310)))
    assert sched.submit(extended, other) is None
    step_once(sched, runner)  # the shorter prefill (10 tokens) takes the budget, the extended one waits in its slot
    assert extended.cached_tokens >= 40 and extended.n_prefilled == extended.cached_tokens
    short = make_request([7, 8, 9], max_tokens=2)
    assert sched.submit(short) is None
    assert short.status is RequestStatus.WAITING and extended.status is RequestStatus.PREFILLING
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_request_started_in_the_same_admission_lends_no_slot():
    """It has not held its slot through a step: lending it on would only rebind its sampler."""
    sched, runner, _, unstarted = _two_long_prompts()
    first, second = make_request(list(range(300, 320)), max_tokens=2), make_request(list(range(400, 410)), max_tokens=2)
    sched.add(first)
    sched.add(second)
    sched.admit()
    assert unstarted.status is RequestStatus.WAITING
    assert first.status is RequestStatus.PREFILLING and second.status is RequestStatus.WAITING
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_failed_finish_changes_nothing_so_the_failure_path_frees_the_slot():
    """The text of a request's last token is released when it finishes (a cancel while its token
    waits for the next decode's overlap): a piece that raises leaves it running, and `fail` ends it."""
    broken = 45

    def piece(token: int) -> bytes:
        if token == broken:
            raise RuntimeError("no piece")
        return default_piece(token)

    sched, runner = make_scheduler(piece=piece)
    request = make_request([40, 41, 42], max_tokens=8)
    assert sched.submit(request) is None
    while broken not in request.output_tokens:
        step = sched.schedule()
        sched.update(step, runner.execute(step), release=False)
        if broken not in request.output_tokens:
            sched.release_text()
    with pytest.raises(RuntimeError):
        sched.finish(request, RequestStatus.FINISHED_CANCELLED)
    assert request.status.running
    sched.fail(request, RuntimeError("no piece"), "cancelling")
    sched.emit()
    assert request.status is RequestStatus.FINISHED_ERROR and sink_of(request).errors
    assert not sched.running and all(slot.request is None for slot in sched.slots)
    check_scheduler(sched, runner)


def test_a_prompt_that_reuses_no_more_than_the_newcomer_has_lends_its_slot():
    """A shared first token cached in its slot does not keep it: the 3-token newcomer reuses it."""
    sched, runner = make_scheduler(n_slots=2, n_pages=16, page_size=4, max_batch_tokens=8, max_ctx=64, per_slot=True)
    assert sched.submit(make_request([2, 5, 6], max_tokens=1)) is None
    run_until_idle(sched, runner)
    cached, shorter = make_request([2] + list(range(100, 139)), max_tokens=2), make_request(list(range(300, 330)))
    assert sched.submit(cached) is None and sched.submit(shorter) is None
    step_once(sched, runner)  # the shorter prefill takes the budget
    assert cached.cached_tokens == cached.n_prefilled == 1
    short = make_request([2, 7, 8], max_tokens=2)
    assert sched.submit(short) is None
    assert short.status is RequestStatus.PREFILLING and short.cached_tokens == 1
    assert cached.status is RequestStatus.WAITING
    run_until_idle(sched, runner)
    assert len(cached.output_tokens) == 2
    check_scheduler(sched, runner)


# ---- where a request's slot is, with a KV stream per slot --------------------------------------------
def _slots_cached_in_order(finish_order: list[int], per_slot: bool, **scheduler_kw):
    """A scheduler whose idle slots all hold caches, last used in `finish_order` (the first least
    recently), no prompt sharing a token with another."""
    n = len(finish_order)
    sched, runner = make_scheduler(n_slots=n, n_pages=8 if per_slot else 8 * n, page_size=4, max_batch_tokens=64,
                                   max_ctx=32, per_slot=per_slot, **scheduler_kw)
    warm = [make_request([100 * (i + 1) + k for k in range(3)], max_tokens=1 + finish_order.index(i)) for i in range(n)]
    for request in warm:
        sched.add(request)
    run_until_idle(sched, runner)
    assert [r.slot for r in warm] == list(range(n))
    return sched, runner


def _place(sched, runner, n: int, base: int = 5000) -> list[int]:
    requests = [make_request([base + 10 * i + k for k in range(3)], max_tokens=4) for i in range(n)]
    for request in requests:
        sched.add(request)
    step_once(sched, runner)
    return [r.slot for r in requests]


def test_per_slot_streams_place_requests_beside_running_ones_so_a_step_is_one_ubatch():
    """llama.cpp decodes one ubatch per run of consecutive sequences when each slot has a stream:
    the least recently used caches (slots 5, 0, 3) would make three runs; beside one another the
    three requests make one."""
    sched, runner = _slots_cached_in_order([5, 0, 3, 1, 4, 2], per_slot=True)
    assert _place(sched, runner, 3) == [5, 4, 3]
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_slot_beside_a_run_is_taken_before_an_older_cache():
    sched, runner = _slots_cached_in_order([5, 2, 0, 1, 3, 4], per_slot=True)
    running = _place(sched, runner, 2, base=6000)  # the two least recently used: 5, then beside it 4
    assert running == [5, 4]
    assert _place(sched, runner, 1, base=7000) == [3]  # beside 4, though 2 and 0 are older caches
    assert _place(sched, runner, 2, base=8000) == [2, 1]
    check_scheduler(sched, runner)


def test_a_unified_pool_still_takes_the_least_recently_used_cache():
    """One stream for all slots: any order is one ubatch, so no cache is given up for adjacency."""
    sched, runner = _slots_cached_in_order([5, 0, 3, 1, 4, 2], per_slot=False)
    assert _place(sched, runner, 3) == [5, 0, 3]


def test_a_slot_between_two_runs_is_taken_before_one_beside_a_single_run():
    """Slots 0 and 2 run, 1 is idle between them: a newcomer there joins the two runs into one
    ubatch, where slot 3 (beside one run, and an older cache) would leave two."""
    sched, runner = _slots_cached_in_order([0, 3, 4, 5, 1, 2], per_slot=True)
    a, b, c = (make_request([6000 + 10 * i, 6001 + 10 * i], max_tokens=n) for i, n in enumerate((20, 1, 20)))
    for request in (a, b, c):
        sched.add(request)
    step_once(sched, runner)
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    while not b.status.finished:
        step_once(sched, runner)
    assert _place(sched, runner, 1) == [1]
    check_scheduler(sched, runner)


def test_a_prefix_copied_from_a_busy_stream_goes_beside_running_slots():
    """The copy's destination follows the same rule: beside slot 1, not the least recently used 3."""
    sched, runner = _slots_cached_in_order([1, 3, 0, 2], per_slot=True, min_copy_tokens=8)
    base = list(range(500, 514))
    a = make_request(base, max_tokens=8)
    sched.add(a)
    step_once(sched, runner)
    assert a.slot == 1
    b = make_request(base[:12] + [900, 901], max_tokens=2)
    sched.add(b)
    step_once(sched, runner)
    assert b.cached_tokens == 12 and runner.ops_of("seq_cp") == [("seq_cp", 1, b.slot, 12)]
    assert b.slot == 0
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_cached_prefix_in_a_lone_slot_is_copied_beside_the_running_ones():
    """A chat's next turn whose cache sits in slot 4, away from the requests running in 0 and 1:
    in place it would decode as a ubatch of its own, so its prefix is copied into slot 2, beside
    them, and slot 4 keeps its cache. With nothing running, it stays in place."""
    sched, runner = _slots_cached_in_order([0, 1, 2, 3, 4, 5], per_slot=True)
    turn = sched.cache.slots[4].tokens + [999]
    alone = make_request(list(turn), max_tokens=1)
    sched.add(alone)
    step_once(sched, runner)
    assert alone.slot == 4 and runner.ops_of("seq_cp") == []
    run_until_idle(sched, runner)
    running = _place(sched, runner, 2, base=6000)
    assert running == [0, 1]
    turn = sched.cache.slots[4].tokens + [998]
    chat = make_request(list(turn), max_tokens=2)
    sched.add(chat)
    step_once(sched, runner)
    n = len(turn) - 1
    assert chat.slot == 2 and chat.cached_tokens == n
    assert runner.ops_of("seq_cp") == [("seq_cp", 4, 2, n)]
    assert sched.cache.slots[4].tokens == turn[:-1]
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_moved_prefixs_old_slot_is_the_first_cache_given_up():
    """A chat's turn moved from slot 6 beside the running slots leaves slot 6 a copy of what its new
    slot holds (and that slot holds the turn too once it ends): with everything done, a new prompt
    takes slot 6, where it would take the least recently used cache (slot 3) otherwise."""
    sched, runner = _slots_cached_in_order([0, 1, 2, 3, 4, 5, 6, 7], per_slot=True)
    assert _place(sched, runner, 2, base=6000) == [0, 1]
    turn = sched.cache.slots[6].tokens + [998]
    chat = make_request(list(turn), max_tokens=2)
    sched.add(chat)
    step_once(sched, runner)
    assert chat.slot == 2 and runner.ops_of("seq_cp") == [("seq_cp", 6, 2, len(turn) - 1)]
    run_until_idle(sched, runner)
    assert _place(sched, runner, 1, base=7000) == [6]
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)


def test_a_lone_slots_prefix_too_short_for_a_stream_copy_is_prefilled_beside_the_running_ones():
    """A stream copy moves the whole stream: a prefix shorter than min_copy_tokens in a lone slot
    is not copied, and the request prefills in a slot beside the running ones instead."""
    sched, runner = _slots_cached_in_order([0, 1, 2, 3, 4, 5], per_slot=True, min_copy_tokens=8)
    running = _place(sched, runner, 2, base=6000)
    assert running == [0, 1]
    short = make_request(sched.cache.slots[4].tokens[:2] + [997, 998], max_tokens=2)
    sched.add(short)
    step_once(sched, runner)
    assert short.slot == 2 and short.cached_tokens == 0 and runner.ops_of("seq_cp") == []
    run_until_idle(sched, runner)
    check_scheduler(sched, runner)
