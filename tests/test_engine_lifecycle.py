"""One request lifecycle on the engine thread (mock runner): isolation of per-request failures,
the queue limit, cancels, which messages preempt a solo long prefill, health and shutdown."""
from __future__ import annotations

import threading
import time

import pytest

from pflash_plugin.engine.request import ErrorKind, FinishEvent, RequestStatus
from pflash_plugin.engine.scheduler import AdmissionError
from pflash_plugin.llama import DecodeError

from mock_runner import (
    EngineHarness,
    FakeCompressor,
    check_scheduler,
    compressed_request,
    idle_pages,
    make_request,
    sink_of,
    wait_done,
)

TIMEOUT = 5.0


@pytest.fixture
def build():
    harness = EngineHarness()
    yield harness
    harness.stop()


# ---- isolation ---------------------------------------------------------------------------------
def run_four_with_one_fault(build, fault) -> tuple[list, object]:
    """Five requests on four slots, `fault(bad, runner)` breaking the fifth, which waits for the
    slot of the first (max_tokens 1) and starts inside a step; all run to the end."""
    engine, sched, runner = build(start=False, n_slots=4, n_pages=64, max_batch_tokens=16, max_ctx=64)
    requests = [make_request([10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=5 if i else 1) for i in range(5)]
    bad = requests[4]
    fault(bad, runner)
    engine.submit(*requests)
    engine.start()
    wait_done(*[r for r in requests if r is not bad])
    engine.stop()
    for request in requests:
        if request is not bad:
            assert sink_of(request).errors == [] and sink_of(request).finish.reason == "length"
            assert len(request.output_tokens) == request.params.max_tokens
    assert bad.status is RequestStatus.FINISHED_ERROR and bad.slot == requests[0].slot
    assert not sched.running and sched.cache.used_pages == idle_pages(sched)
    check_scheduler(sched, runner)
    return requests, bad


def test_raising_start_request_on_one_of_four_slots_fails_only_that_request(build):
    def fault(bad, runner):
        runner.start_error = lambda r: RuntimeError("llama_sampler_init failed") if r is bad else None

    _, bad = run_four_with_one_fault(build, fault)
    errors = sink_of(bad).errors
    assert [e.kind for e in errors] == [ErrorKind.FAILED] and sink_of(bad).finish is None
    assert f"request {bad.request_id}" in errors[0].message and "llama_sampler_init failed" in errors[0].message


def test_raising_sampler_fails_only_that_request(build):
    def fault(bad, runner):
        runner.sample_error = lambda r: ValueError("no token left") if r is bad and r.output_tokens else None

    _, bad = run_four_with_one_fault(build, fault)
    errors = sink_of(bad).errors
    assert [e.kind for e in errors] == [ErrorKind.FAILED] and f"request {bad.request_id}" in errors[0].message
    assert len(bad.output_tokens) == 1


def test_raising_sink_fails_only_that_request(build):
    seen = []

    def fault(bad, runner):
        def closed_loop(event) -> None:  # the client's event loop is gone
            seen.append(event)
            raise RuntimeError("Event loop is closed")

        bad.sink = closed_loop

    run_four_with_one_fault(build, fault)
    assert len(seen) == 1, "a sink that raised gets nothing more"


def test_failing_message_handler_costs_only_its_request(build):
    engine, sched, runner = build(compressor=FakeCompressor(), n_slots=2, n_pages=64, max_batch_tokens=16, max_ctx=128)
    fake = engine.compressor
    long = compressed_request(list(range(1, 41)))
    engine.submit(long)
    assert fake.submitted.acquire(timeout=TIMEOUT)
    sched.resume = lambda *a: 1 / 0  # applying this compression result is broken
    fake.deliver(0, [1, 2, 40])
    wait_done(long)
    assert [e.kind for e in sink_of(long).errors] == [ErrorKind.FAILED]
    assert "ZeroDivisionError" in sink_of(long).errors[0].message
    other = make_request([5, 6], max_tokens=3)
    engine.submit(other)
    wait_done(other)
    assert sink_of(other).finish.reason == "length"


# ---- queue limit ---------------------------------------------------------------------------------
def test_a_flood_on_idle_slots_admits_exactly_slots_plus_max_queue(build):
    engine, sched, runner = build(start=False, n_slots=4, max_queue=6, n_pages=128, max_batch_tokens=16, max_ctx=64)
    flood = [make_request([i + 1, i + 2], max_tokens=2) for i in range(30)]
    for request in flood:  # 30 clients at once: all pass the caller-side check, none is admitted yet
        engine.submit(request)
    engine.start()
    wait_done(*flood)
    served = [r for r in flood if sink_of(r).finish is not None]
    refused = [r for r in flood if sink_of(r).errors]
    assert len(served) == 4 + 6
    assert len(refused) == 20 and {e.kind for r in refused for e in sink_of(r).errors} == {ErrorKind.BUSY}
    assert all(r.status is RequestStatus.FINISHED_REJECTED for r in refused)


# ---- cancellation --------------------------------------------------------------------------------
def test_a_cancel_frees_the_pages_before_the_next_step(build):
    engine, sched, runner = build(n_slots=2, n_pages=64, max_batch_tokens=16, max_ctx=64)
    a = make_request([1, 2, 3], max_tokens=40)
    b = make_request([7, 8, 9], max_tokens=40)
    in_step, release, next_step = threading.Event(), threading.Event(), threading.Event()
    seen_next: list = []

    def hook(index, step):
        if index == 3:
            in_step.set()
            assert release.wait(TIMEOUT)
        elif index == 4:
            seen_next.append(({i.request.request_id for i in step.items}, sched.cache.used_pages, idle_pages(sched)))
            next_step.set()

    runner.hook = hook
    engine.submit(a, b)
    assert in_step.wait(TIMEOUT)
    engine.cancel(a)
    release.set()
    wait_done(a)
    assert sink_of(a).finish.reason == "cancelled" and a.status is RequestStatus.FINISHED_CANCELLED
    assert next_step.wait(TIMEOUT)
    items, used, idle = seen_next[0]
    assert items == {b.request_id}, "the cancelled request ran another step"
    assert used == idle + sched.cache.pages_for(b.reserve_tokens), "its reservation was not released"


def test_the_status_a_finished_client_reads_no_longer_holds_its_request(build):
    engine, sched, runner = build(n_slots=2)
    request = make_request([1, 2, 3], max_tokens=3)
    collector, seen = request.sink, []

    def sink(event) -> None:  # what /status says the moment the answer is complete
        if isinstance(event, FinishEvent):
            seen.append(engine.stats())
        collector(event)

    request.sink = sink
    engine.submit(request)
    assert collector.done.wait(TIMEOUT)
    assert seen[0].running == seen[0].waiting == 0
    assert all(slot.request_id is None for slot in seen[0].slots)


# ---- preemption ----------------------------------------------------------------------------------
def test_only_an_arrival_preempts_a_solo_long_prefill(build):
    fake = FakeCompressor()
    engine, sched, runner = build(start=False, compressor=fake, n_slots=2, n_pages=64, max_batch_tokens=32, max_ctx=128,
                                  prefill_chunk=4, preempt_chunk=4)
    polls: list = []
    runner.set_abort = polls.append
    engine.__init__(sched, runner, name="test", compressor=fake)  # wire the abort callback
    engine.start()
    scored = compressed_request(list(range(200, 240)))
    engine.submit(scored)
    assert fake.submitted.acquire(timeout=TIMEOUT)
    long = make_request(list(range(100, 160)), max_tokens=2)
    newcomer = make_request([1, 2, 3], max_tokens=1)
    answers: dict[str, bool] = {}
    original = runner.execute

    def execute(step):
        if not answers and any(i.request is long and len(i.tokens) == 32 for i in step.items):
            should_abort = polls[0]
            answers["start"] = should_abort()
            fake.deliver(0, [200, 201, 239])  # a compression result arrives
            answers["compressed"] = should_abort()
            engine.cancel(scored)  # and a cancel
            answers["cancel"] = should_abort()
            engine.submit(newcomer)  # a new request does preempt
            answers["arrival"] = should_abort()
            raise DecodeError(2)
        return original(step)

    runner.execute = execute
    engine.submit(long)
    wait_done(long, newcomer, scored)
    assert answers == {"start": False, "compressed": False, "cancel": False, "arrival": True}
    assert sink_of(long).finish.reason == "length"


# ---- health and shutdown -------------------------------------------------------------------------
def test_shutdown_finishes_what_it_can_within_the_grace_and_cancels_the_rest(build):
    fake = FakeCompressor()
    engine, sched, runner = build(compressor=fake, n_slots=2, n_pages=64, page_size=16, max_batch_tokens=16,
                                  max_ctx=1000)
    short = make_request([1, 2, 3], max_tokens=3)
    endless = make_request([4, 5, 6], max_tokens=900)  # still running when the grace is over
    scored = compressed_request(list(range(200, 240)))  # never delivered
    draining = threading.Event()

    def hook(index, step) -> None:
        if index == 1:
            assert draining.wait(TIMEOUT)  # nothing runs before the drain has begun
        if sink_of(short).done.is_set():  # then the step in flight outlasts the grace
            threading.Event().wait(max(0.0, engine._deadline - time.monotonic()))

    runner.hook = hook
    engine.submit(short, endless, scored)
    assert fake.submitted.acquire(timeout=TIMEOUT)
    assert engine.health().ok
    stopper = threading.Thread(target=engine.shutdown, args=(1.0,))
    stopper.start()
    while engine.health().state != "draining":
        assert stopper.is_alive()
        time.sleep(0.001)
    with pytest.raises(AdmissionError) as info:
        engine.submit(make_request([9, 9], max_tokens=2))
    assert info.value.kind is ErrorKind.UNAVAILABLE
    draining.set()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive() and not engine._thread.is_alive()
    assert sink_of(short).finish.reason == "length"
    assert sink_of(endless).finish.reason == "cancelled" and 0 < len(endless.output_tokens) < 900
    assert sink_of(scored).finish.reason == "cancelled" and scored.compression.cancelled.is_set()
    assert engine.health().state == "stopped" and not engine.health().ok
    assert not sched.running and sched.cache.used_pages == idle_pages(sched)
    check_scheduler(sched, runner)


def test_shutdown_of_an_idle_engine_returns_at_once(build):
    engine, sched, runner = build()
    with pytest.raises(RuntimeError, match="shut it down"):
        engine.close()  # never free a context a step may be using
    stopper = threading.Thread(target=engine.shutdown, args=(3600.0,))  # a grace it must not wait for
    stopper.start()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive() and not engine._thread.is_alive()


def test_a_llama_cpp_compute_failure_marks_the_model_failed(build):
    engine, sched, runner = build(start=False, n_slots=2)
    runner.fail_steps[2] = (DecodeError(-3), False)
    a = make_request([1, 2, 3], max_tokens=8)
    waiting = make_request([4, 5, 6], max_tokens=8)
    engine.submit(a)
    engine.start()
    wait_done(a)
    health = engine.health()
    assert not health.ok and health.state == "failed" and "-3" in health.reason
    assert [e.kind for e in sink_of(a).errors] == [ErrorKind.MODEL_FAILED]
    with pytest.raises(AdmissionError) as info:
        engine.submit(waiting)
    assert info.value.kind is ErrorKind.UNAVAILABLE and "-3" in info.value.message
    assert engine._thread.is_alive()


def test_a_decode_error_of_one_step_does_not_fail_the_model(build):
    engine, sched, runner = build(n_slots=2)
    runner.fail_steps[1] = (DecodeError(-1), False)
    a = make_request([1, 2, 3], max_tokens=3)
    engine.submit(a)
    wait_done(a)
    assert [e.kind for e in sink_of(a).errors] == [ErrorKind.FAILED]
    assert engine.health().ok


# ---- a step that never returns -------------------------------------------------------------------
def wait_for(condition, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_step_past_max_step_s_marks_the_engine_stalled_until_it_returns(build):
    engine, sched, runner = build(n_slots=2, max_step_s=0.05)
    in_step, release = threading.Event(), threading.Event()

    def hook(index, step):  # the first step hangs, as llama_decode did on a hung GPU
        if index == 1:
            in_step.set()
            assert release.wait(TIMEOUT)

    runner.hook = hook
    request = make_request([1, 2, 3], max_tokens=2)
    engine.submit(request)
    assert in_step.wait(TIMEOUT)
    assert wait_for(lambda: engine.health().state == "stalled")
    assert "max_step_s" in engine.health().reason
    with pytest.raises(AdmissionError) as refused:
        engine.submit(make_request([4, 5], max_tokens=1))
    assert refused.value.kind is ErrorKind.UNAVAILABLE and "stalled" in refused.value.message
    release.set()
    wait_done(request)
    assert engine.health().ok and sink_of(request).finish.reason == "length"


def test_host_work_past_max_step_s_marks_the_engine_stalled_too(build):
    """The watchdog times the round, not only the decode: a step's host work (sampling, stop
    strings: issue 22's 1.4 s pushes) that hangs is a stall as well."""
    engine, sched, runner = build(n_slots=2, max_step_s=0.05)
    in_update, release = threading.Event(), threading.Event()
    update = sched.update

    def slow_update(step, outputs, **kw):  # the host work after the first decode hangs
        if not in_update.is_set():
            in_update.set()
            assert release.wait(TIMEOUT)
        update(step, outputs, **kw)

    sched.update = slow_update
    request = make_request([1, 2, 3], max_tokens=2)
    engine.submit(request)
    assert in_update.wait(TIMEOUT)
    assert wait_for(lambda: engine.health().state == "stalled")
    release.set()
    wait_done(request)
    assert engine.health().ok


def test_without_max_step_s_a_long_step_is_no_stall(build):
    engine, sched, runner = build(n_slots=2)
    in_step, release = threading.Event(), threading.Event()
    runner.hook = lambda index, step: index == 1 and (in_step.set(), release.wait(TIMEOUT))
    request = make_request([1, 2, 3], max_tokens=2)
    engine.submit(request)
    assert in_step.wait(TIMEOUT)
    time.sleep(0.1)
    assert engine.health().ok
    release.set()
    wait_done(request)
