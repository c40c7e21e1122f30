"""Prefill once (engine/prefill_sharing.py), driven step by step over the mock runner: a queued
request whose prefix a running request is prefilling waits for that prefill and reuses it, in
both KV layouts; the KV accounting comes back whatever ends the leader."""
from __future__ import annotations

import random

import pytest

from pflash_plugin.engine.request import Request, RequestStatus

from mock_runner import (
    check_scheduler,
    compressed_request,
    idle_pages,
    make_request,
    make_scheduler,
    run_until_idle,
    sink_of,
    step_once,
)

PROMPT = list(range(100, 140))  # 40 tokens
LAYOUTS = pytest.mark.parametrize("per_slot", [False, True], ids=["unified", "per_slot"])


def scheduler(per_slot: bool, n_slots: int = 4, **kw):
    return make_scheduler(n_slots=n_slots, n_pages=32, page_size=4, max_batch_tokens=16, max_ctx=100,
                          per_slot=per_slot, share_prefill_tokens=8, **kw)


def prefilled(runner, *requests: Request) -> int:
    """Prompt tokens the runner decoded for these requests (every decode row after the prompt excluded)."""
    return sum(len(item.tokens) for r in requests for item in runner.items_of(r.request_id)
               if item.start_pos < len(r.prefill_tokens))


def assert_all_back(sched, runner) -> None:
    """Nothing runs, every page is an idle cache's, and clearing the caches frees them all."""
    assert not sched.live and not sched.running
    assert sched.cache.used_pages == idle_pages(sched)
    sched.cache.clear()
    assert sched.cache.used_pages == 0 and runner.cells_used == 0


@LAYOUTS
def test_the_choices_of_one_prompt_prefill_it_once(per_slot):
    sched, runner = scheduler(per_slot)
    choices = [make_request(PROMPT, max_tokens=3) for _ in range(3)]
    assert sched.submit(*choices) is None
    leader, *followers = choices
    assert leader.status is RequestStatus.PREFILLING
    assert all(f.status is RequestStatus.WAITING for f in followers), "free slots, yet they wait for the leader"
    run_until_idle(sched, runner)
    assert prefilled(runner, *choices) == len(PROMPT) + 2  # the prompt once, then each follower's last token
    assert [f.cached_tokens for f in followers] == [len(PROMPT) - 1] * 2
    assert {tuple(c.output_tokens) for c in choices} == {(140, 141, 142)}
    assert all(sink_of(c).finish.reason == "length" for c in choices)
    copies = runner.ops_of("seq_cp")  # cells shared in one pool, a stream copied across streams
    assert len(copies) == 2 and {op[3] for op in copies} == {len(PROMPT) - 1}
    assert_all_back(sched, runner)


@LAYOUTS
def test_a_later_request_with_the_same_prefix_waits_for_the_prefill_under_way(per_slot):
    sched, runner = scheduler(per_slot)
    first = make_request(PROMPT + [1, 2], max_tokens=2)
    sched.submit(first)
    step_once(sched, runner)  # 16 of its 42 tokens
    later = make_request(PROMPT + [7, 8, 9], max_tokens=2)
    sched.submit(later)
    assert later.status is RequestStatus.WAITING and any(s.request is None for s in sched.slots)
    short = make_request(PROMPT[:10] + list(range(1, 12)), max_tokens=2)  # shares 10 of its 21: not worth a wait
    sched.submit(short)
    assert short.status is RequestStatus.PREFILLING
    before = []  # the leader's prefilled tokens before each step, until the later one starts
    while later.status is RequestStatus.WAITING:
        before.append(first.n_prefilled)
        step_once(sched, runner)
    assert max(before[:-1]) < len(PROMPT) <= before[-1]  # it started in the first step after the prefix was written
    assert later.cached_tokens == len(PROMPT)
    run_until_idle(sched, runner)
    assert prefilled(runner, first, later) == len(PROMPT) + 2 + 3
    assert sink_of(short).finish.reason == "length"
    assert_all_back(sched, runner)


@LAYOUTS
@pytest.mark.parametrize("end", ["cancel", "fail"])
def test_when_the_leader_ends_early_the_waiters_go_on_with_what_it_left(per_slot, end):
    sched, runner = scheduler(per_slot)
    choices = [make_request(PROMPT, max_tokens=2) for _ in range(3)]
    sched.submit(*choices)
    leader, *followers = choices
    step_once(sched, runner)
    assert leader.n_prefilled == 16 and all(f.status is RequestStatus.WAITING for f in followers)
    if end == "cancel":
        sched.finish(leader, RequestStatus.FINISHED_CANCELLED)
    else:
        sched.fail(leader, RuntimeError("boom"), "testing")
    sched.emit()
    run_until_idle(sched, runner)
    second, third = followers
    assert second.cached_tokens == 16  # what the leader's slot kept (its cancelled prefill's chunks)
    assert third.cached_tokens == len(PROMPT) - 1  # the second became the third's leader
    assert all(sink_of(f).finish.reason == "length" and f.output_tokens == [140, 141] for f in followers)
    assert prefilled(runner, *choices) == len(PROMPT) + 1
    assert_all_back(sched, runner)


def test_requests_that_wait_for_a_prefill_leave_a_free_slot_to_those_behind_them():
    sched, runner = scheduler(False, n_slots=3)
    choices = [make_request(PROMPT, max_tokens=2) for _ in range(3)]
    other = make_request(list(range(500, 520)), max_tokens=2)
    sched.submit(*choices)
    sched.submit(other)
    assert other.status is RequestStatus.PREFILLING and list(sched.waiting) == choices[1:]
    run_until_idle(sched, runner)
    assert prefilled(runner, *choices) == len(PROMPT) + 2
    assert_all_back(sched, runner)


@LAYOUTS
def test_the_samples_of_one_compressed_prompt_prefill_its_kept_tokens_once(per_slot):
    sched, runner = scheduler(per_slot, can_compress=True)
    samples = [compressed_request(PROMPT + list(range(200, 240)), max_tokens=2) for _ in range(3)]
    job = samples[0].compression
    for sample in samples:
        sample.compression = job  # the n samples of one prompt share its compression
        sched.add(sample)
    sched.admit()
    assert sched.take_handed() == samples
    kept = PROMPT[:30] + list(range(230, 240))
    for sample in samples:
        sched.resume(sample, kept, report=None)  # type: ignore[arg-type]
    run_until_idle(sched, runner)
    assert prefilled(runner, *samples) == len(kept) + 2
    assert [s.cached_tokens for s in samples[1:]] == [len(kept) - 1] * 2
    assert all(len(s.output_tokens) == 2 for s in samples)
    check_scheduler(sched, runner)
    assert_all_back(sched, runner)


def test_a_request_that_waits_for_a_prefill_borrows_no_slot_from_a_prompt_yet_to_start():
    """Per-slot streams: a short request may take the slot of a long prompt that has not begun its
    prefill (Scheduler._loan), but not one that waits to reuse a prefix being prefilled."""
    sched, runner = make_scheduler(n_slots=2, n_pages=16, page_size=4, max_batch_tokens=8, max_ctx=64,
                                   per_slot=True, share_prefill_tokens=8)
    first, second = make_request(PROMPT, max_tokens=2), make_request(list(range(200, 240)), max_tokens=2)
    sched.submit(first, second)
    step_once(sched, runner)
    assert first.n_prefilled == 8 and second.n_prefilled == 0  # second holds its slot, not started
    queued = make_request(list(range(300, 340)), max_tokens=2)  # ahead of it: too long to borrow a slot
    follower = make_request(PROMPT[:18] + [1, 2], max_tokens=2)
    sched.submit(queued)
    sched.submit(follower)
    assert follower.status is RequestStatus.WAITING and second.status is RequestStatus.PREFILLING
    run_until_idle(sched, runner)
    assert all(sink_of(r).finish.reason == "length" for r in (first, second, queued, follower))
    assert_all_back(sched, runner)


@pytest.mark.parametrize("seed, per_slot", [(1, False), (2, False), (3, True), (4, True)])
def test_random_groups_sharing_prefixes_with_leaders_cancelled_return_every_page(seed, per_slot):
    """Groups of choices and requests over a few shared prefixes, some cancelled or failed (leaders
    among them), every invariant of check_scheduler after every step: all end, the pages come back,
    and requests did wait for a prefill with a slot free."""
    rng = random.Random(seed)
    sched, runner = make_scheduler(n_slots=4, n_pages=64 if per_slot else 256, page_size=4, max_batch_tokens=8,
                                   max_ctx=64, max_queue=16, per_slot=per_slot, share_prefill_tokens=4)
    bases = [[rng.randrange(1, 200) for _ in range(40)] for _ in range(3)]
    requests: list[Request] = []
    waited: set[int] = set()  # queued while a slot was free: waiting for another's prefill
    steps = 0
    while len(requests) < 120 or sched.has_work:
        if len(requests) < 120 and rng.random() < 0.3:
            tail = [rng.randrange(200, 400) for _ in range(rng.randint(0, 4))]
            prompt = rng.choice(bases)[: rng.randint(8, 40)] + tail
            group = [make_request(prompt, rng.randint(1, 6)) for _ in range(rng.choice([1, 1, 2, 3]))]
            if sched.submit(*group) is None:
                requests += group
        live = [r for r in requests if not r.status.finished]
        roll = rng.random()
        if live and roll < 0.05:
            sched.finish(rng.choice(live), RequestStatus.FINISHED_CANCELLED)
        elif live and roll < 0.07:
            sched.fail(rng.choice(live), RuntimeError("random failure"), "testing")
        sched.admit()
        if any(s.request is None for s in sched.slots):
            waited |= {r.request_id for r in sched.waiting}
        step = step_once(sched, runner)
        assert step.items or not sched.has_work, "work left but nothing scheduled"
        steps += 1
        assert steps < 20_000
    assert all(len(sink_of(r).terminal) == 1 for r in requests)
    assert len(waited) >= 10, waited
    assert_all_back(sched, runner)
