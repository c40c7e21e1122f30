"""Engine thread over the mock runner: submissions and cancels from other threads, decode errors,
scheduler exceptions. Waits are threading.Event with timeouts; nothing sleeps."""
from __future__ import annotations

import threading

import pytest

from pflash_plugin.engine.engine import Engine
from pflash_plugin.engine.request import ErrorKind, FinishEvent, RequestStatus
from pflash_plugin.engine.scheduler import AdmissionError
from pflash_plugin.llama import DecodeError

from mock_runner import EngineHarness, check_scheduler, idle_pages, make_request, sink_of, wait_done

TIMEOUT = 2.0  # generous upper bound for one request; the mock engine takes milliseconds


@pytest.fixture
def harness():
    h = EngineHarness()
    yield h
    h.stop()


class Gate:
    """Blocks the engine thread inside execute() at chosen step indices until released."""

    def __init__(self, *indices: int) -> None:
        self.reached = {i: threading.Event() for i in indices}
        self.release = {i: threading.Event() for i in indices}

    def __call__(self, index: int, step) -> None:
        if index in self.reached:
            self.reached[index].set()
            assert self.release[index].wait(TIMEOUT), "the test never released the gate"

    def wait(self, index: int) -> None:
        assert self.reached[index].wait(TIMEOUT), f"the engine never reached step {index}"

    def open(self, index: int) -> None:
        self.release[index].set()


def settle(engine: Engine) -> None:
    """Stop the engine so its scheduler can be inspected from the test thread."""
    engine.stop()
    assert not engine._thread.is_alive()


def test_requests_from_many_threads_all_finish(harness):
    engine, sched, runner = harness(n_slots=3, n_pages=64, max_batch_tokens=8, max_ctx=64)
    requests = [make_request([100 + i, 200 + i, 300 + i], max_tokens=3 + i % 4) for i in range(12)]
    barrier = threading.Barrier(4)

    def submit(chunk):
        barrier.wait(TIMEOUT)
        for request in chunk:
            engine.submit(request)

    threads = [threading.Thread(target=submit, args=(requests[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    wait_done(*requests)
    for request in requests:
        sink = sink_of(request)
        assert sink.errors == [], sink.errors
        assert sink.finish.reason == "length"
        assert len(request.output_tokens) == request.params.max_tokens
        assert len(sink.terminal) == 1
    settle(engine)
    assert not sched.has_work
    check_scheduler(sched, runner)
    assert sched.cache.used_pages == idle_pages(sched)
    assert engine.steps == sum(s.ok for s in runner.steps)


def test_submit_rejects_at_once_on_the_calling_thread(harness):
    engine, sched, runner = harness()
    with pytest.raises(AdmissionError) as info:
        engine.submit(make_request([], 4))
    assert info.value.kind is ErrorKind.INVALID


def test_cancel_running_request_from_another_thread(harness):
    engine, sched, runner = harness(n_slots=1, n_pages=32, max_batch_tokens=8, max_ctx=64)
    gate = Gate(3)
    runner.hook = gate
    a = make_request([1, 2, 3], max_tokens=50)
    engine.submit(a)
    gate.wait(3)  # a has produced 2 tokens and the third step is in flight
    canceller = threading.Thread(target=engine.cancel, args=(a,))
    canceller.start()
    canceller.join(TIMEOUT)
    gate.open(3)
    wait_done(a)
    sink = sink_of(a)
    assert sink.finish.reason == "cancelled"
    assert sink.finish.usage.completion_tokens == len(a.output_tokens) == 3
    assert len(sink.terminal) == 1
    b = make_request([1, 2, 3, 4], max_tokens=2)  # the freed slot serves the next request
    engine.submit(b)
    wait_done(b)
    assert sink_of(b).finish.reason == "length"
    assert b.cached_tokens == 3
    settle(engine)
    check_scheduler(sched, runner)
    assert sched.cache.used_pages == idle_pages(sched)


def test_cancel_waiting_requests(harness):
    engine, sched, runner = harness(n_slots=1, n_pages=32, max_batch_tokens=8, max_ctx=64)
    gate = Gate(2, 3)
    runner.hook = gate
    a = make_request([1, 2, 3], max_tokens=6)
    engine.submit(a)
    gate.wait(2)
    queued = make_request([7, 8], max_tokens=3)  # admitted to the queue, then cancelled
    early = make_request([9, 10], max_tokens=3)  # cancelled before the engine even saw it
    engine.submit(queued)
    engine.submit(early)
    engine.cancel(early)
    gate.open(2)
    gate.wait(3)
    assert queued in sched.waiting  # the engine thread is parked in execute: safe to read
    engine.cancel(queued)
    gate.open(3)
    wait_done(a, queued, early)
    for request in (queued, early):
        sink = sink_of(request)
        assert [type(e) for e in sink.events] == [FinishEvent]
        assert sink.finish.reason == "cancelled"
        assert request.request_id not in runner.started
    assert sink_of(a).finish.reason == "length"
    settle(engine)
    assert not sched.waiting
    check_scheduler(sched, runner)


def test_decode_error_no_cells_evicts_idle_caches_and_retries(harness):
    # the KV has fewer cells than the pool accounts for: only evicting the idle cache makes room
    engine, sched, runner = harness(n_slots=2, n_pages=8, page_size=4, n_ctx=16, max_batch_tokens=16, max_ctx=32)
    a = make_request(list(range(1, 9)), max_tokens=4)
    engine.submit(a)
    wait_done(a)
    b = make_request(list(range(50, 58)), max_tokens=4)
    engine.submit(b)
    wait_done(b)
    sink = sink_of(b)
    assert sink.errors == [], sink.errors
    assert sink.finish.reason == "length" and len(b.output_tokens) == 4
    failed = [s for s in runner.steps if not s.ok]
    assert len(failed) == 1 and isinstance(failed[0].error, DecodeError) and failed[0].error.code == 1
    retried = runner.steps[failed[0].index]  # the next execute call
    assert retried.ok and retried.items == failed[0].items, "the same work must be retried"
    assert ("seq_rm", a.slot, 0) in runner.ops
    settle(engine)
    assert sched.slots[a.slot].tokens == []
    check_scheduler(sched, runner)


def test_decode_error_no_cells_without_idle_caches_fails_503_and_serves_on(harness):
    engine, sched, runner = harness(n_slots=2)
    runner.fail_steps[1] = (DecodeError(1), False)
    a = make_request([1, 2, 3], max_tokens=4)
    engine.submit(a)
    wait_done(a)
    assert [e.kind for e in sink_of(a).errors] == [ErrorKind.MODEL_FAILED]
    assert sink_of(a).finish is None
    b = make_request([4, 5, 6], max_tokens=2)
    engine.submit(b)
    wait_done(b)
    assert sink_of(b).finish.reason == "length"


def test_decode_error_fails_only_the_requests_in_the_step(harness):
    # budget 2: two decoders fill every step, so c's prefill is not in the failing step
    engine, sched, runner = harness(start=False, n_slots=3, max_batch_tokens=2, max_ctx=32)
    a = make_request([1], max_tokens=8)
    b = make_request([2], max_tokens=8)
    c = make_request([3, 4, 5], max_tokens=3)
    for request in (a, b, c):
        sched.add(request)  # before the thread starts: the first steps are deterministic
    runner.fail_steps[2] = (DecodeError(-1), True)  # fails after writing part of the batch
    engine.start()
    wait_done(a, b, c)
    failed = runner.steps[1]
    assert not failed.ok and {i.request_id for i in failed.items} == {a.request_id, b.request_id}
    for request in (a, b):
        sink = sink_of(request)
        assert [e.kind for e in sink.errors] == [ErrorKind.FAILED]
        assert "-1" in sink.errors[0].message
        assert sink.finish is None
        assert request.status is RequestStatus.FINISHED_ERROR
    assert sink_of(c).errors == [] and sink_of(c).finish.reason == "length"
    d = make_request([1, 6], max_tokens=2)
    engine.submit(d)
    wait_done(d)
    assert sink_of(d).finish.reason == "length"
    assert d.cached_tokens == 0, "a slot whose KV was in an unknown state must not be reused"
    settle(engine)
    check_scheduler(sched, runner)  # the partial writes of the failed step were dropped


def test_runner_exception_fails_the_step_and_serves_on(harness):
    engine, sched, runner = harness()
    runner.fail_steps[1] = (RuntimeError("sampler exploded"), False)
    a = make_request([1, 2], max_tokens=3)
    engine.submit(a)
    wait_done(a)
    assert [e.kind for e in sink_of(a).errors] == [ErrorKind.FAILED]
    b = make_request([3, 4], max_tokens=3)
    engine.submit(b)
    wait_done(b)
    assert sink_of(b).finish.reason == "length"


def test_exception_in_schedule_does_not_kill_the_thread(harness):
    engine, sched, runner = harness(start=False)
    schedule = sched.schedule
    broken = threading.Event()

    def schedule_once_broken():
        if not broken.is_set():
            broken.set()
            raise RuntimeError("scheduler bug")
        return schedule()

    sched.schedule = schedule_once_broken
    engine.start()
    a = make_request([1, 2, 3], max_tokens=3)
    engine.submit(a)
    wait_done(a)
    assert [e.kind for e in sink_of(a).errors] == [ErrorKind.FAILED]
    assert engine._thread.is_alive()
    b = make_request([4, 5, 6], max_tokens=3)
    engine.submit(b)
    wait_done(b)
    assert sink_of(b).finish.reason == "length"
    assert engine._thread.is_alive()


def test_status_is_published(harness):
    engine, sched, runner = harness()
    a = make_request([1, 2, 3], max_tokens=3)
    engine.submit(a)
    wait_done(a)
    b = make_request([1, 2, 3, 4], max_tokens=1)  # one more iteration publishes a's idle cache
    engine.submit(b)
    wait_done(b)
    stats = engine.stats()
    assert stats.steps >= 4
    assert stats.cache.kv_pages_total == sched.cache.n_pages


def test_unexpected_start_request_error_does_not_leak_the_slot(harness):
    engine, sched, runner = harness(n_slots=1)
    runner.start_error = lambda request: (RuntimeError("llama_sampler_init failed") if request.params.seed == 13
                                          else None)
    a = make_request([1, 2, 3], max_tokens=3)
    a.params.seed = 13
    engine.submit(a)
    wait_done(a)
    assert [e.kind for e in sink_of(a).errors] == [ErrorKind.FAILED]
    b = make_request([4, 5, 6], max_tokens=3)
    engine.submit(b)
    assert sink_of(b).done.wait(1.0), "the only slot is still bound to the failed request"
    assert sink_of(b).finish.reason == "length"


def test_a_long_solo_prefill_step_is_preempted_for_a_newcomer(harness):
    """The runner polls the abort callback like llama.cpp does mid-graph; a newcomer aborts the
    solo long step, which is rolled back and redone after the newcomer's first token."""
    engine, sched, runner = harness(start=False, n_slots=2, n_pages=64, max_batch_tokens=32, max_ctx=128,
                                    prefill_chunk=4, preempt_chunk=4)
    polls: list = []
    runner.set_abort = polls.append
    engine.__init__(sched, runner, name="test")  # wire the abort callback into the runner
    in_long_step, aborted = threading.Event(), threading.Event()
    long = make_request(list(range(100, 160)), max_tokens=2)
    original_execute = runner.execute

    def execute(step):
        if any(i.request is long and len(i.tokens) == 32 for i in step.items) and not aborted.is_set():
            in_long_step.set()
            for _ in range(1000):  # "computing" (up to 1 s) until llama.cpp's abort poll says stop
                if polls[0]():
                    aborted.set()
                    raise DecodeError(2)
                threading.Event().wait(0.001)
        return original_execute(step)

    runner.execute = execute
    engine.start()
    engine.submit(long)
    assert in_long_step.wait(TIMEOUT)
    short = make_request([1, 2, 3], max_tokens=1)
    engine.submit(short)
    wait_done(short, long)
    settle(engine)
    assert aborted.is_set()
    first_short = next(r.index for r in runner.steps if r.for_request(short.request_id))
    long_logits = next(r.index for r in runner.steps if (i := r.for_request(long.request_id)) and i.wants_logits)
    assert first_short < long_logits  # the newcomer did not wait for the long prefill
    assert sink_of(long).finish.reason == "length"
    check_scheduler(sched, runner)


# ---- the GPU's order: the last step's text while the next decode runs -----------------------------
@pytest.mark.parametrize("overlaps", [False, True])
def test_text_goes_out_while_the_next_decode_runs_where_the_runner_overlaps(harness, overlaps):
    """On a GPU (`runner.overlaps`) a step's text is released after the next step's decode is
    launched, so the host's detokenizing and events run beside the device; on the CPU before it.
    A first token goes out before the launch either way (its client waits for nothing else)."""
    engine, sched, runner = harness(start=False, n_slots=1, n_pages=64, max_batch_tokens=8, max_ctx=64)
    runner.overlaps = overlaps
    request = make_request([10, 11], max_tokens=5)
    delivered: list[int] = []  # at each decode's launch: the text events the client has had
    runner.hook = lambda index, step: delivered.append(len([e for e in sink_of(request).events if e.text]))
    engine.start()
    engine.submit(request)
    wait_done(request)
    assert delivered == ([0, 1, 1, 2, 3] if overlaps else [0, 1, 2, 3, 4])
    assert sink_of(request).text == "<12><13><14><15><16>"
    assert sink_of(request).finish.reason == "length"


@pytest.mark.parametrize("n_ubatch", [4, 8])
def test_overlapped_a_step_of_several_ubatches_sends_the_last_steps_text_before_its_launch(harness, n_ubatch):
    """On a GPU a launch of more tokens than a ubatch returns only as its last ubatch computes, so
    text released after it would wait out the step: a short request's first token, decoded beside
    a long prompt's 8-token steps, reaches its client before such a step's launch where the step is
    two ubatches (4 tokens each), and beside it where it is one (8); a first token before it always."""
    engine, sched, runner = harness(start=False, n_slots=2, n_pages=64, max_batch_tokens=8, max_ctx=128)
    runner.overlaps, runner.n_ubatch = True, n_ubatch
    short, long = make_request([10, 11], max_tokens=3), make_request(list(range(100, 140)), max_tokens=1)
    at_launch: list[tuple[int, int]] = []  # each step's tokens, and the short request's text events by then
    runner.hook = lambda index, step: at_launch.append(
        (step.n_tokens, len([e for e in sink_of(short).events if e.text])))
    engine.start()
    engine.submit(short, long)
    wait_done(short, long)
    sent_before = n_ubatch < 8
    # the short prompt alone, then its decode rows beside the long prompt's chunks
    assert at_launch[:3] == [(2, 0), (8, 1), (8, 1 + sent_before)]
    assert sink_of(short).text == "<12><13><14>"
    check_scheduler(sched, runner)


@pytest.mark.parametrize("overlaps", [False, True])
def test_a_stop_string_found_while_the_next_decode_runs_ends_the_request_as_before(harness, overlaps):
    """The stop string spans tokens 13 and 14. Overlapped, it is found while a step with one more
    row for the request runs: that row's token is dropped, its KV cell removed, and the queued
    request that reuses the slot's prefix sees only the request's real tokens."""
    engine, sched, runner = harness(start=False, n_slots=1, n_pages=64, max_batch_tokens=8, max_ctx=64)
    runner.overlaps = overlaps
    stopped = make_request([10, 11], max_tokens=10, stop=["3><1"])
    queued = make_request([10, 11, 12, 13, 77, 78], max_tokens=2)
    engine.start()
    engine.submit(stopped, queued)
    wait_done(stopped, queued)
    assert sink_of(stopped).text == "<12><1"
    assert sink_of(stopped).finish.reason == "stop" and sink_of(stopped).finish.stop == "3><1"
    assert stopped.output_tokens == [12, 13, 14]
    rows = [record.for_request(stopped.request_id) for record in runner.steps]
    assert sum(row is not None for row in rows) == 3 + overlaps  # prefill, 12, 13 (+ the dropped 14)
    assert queued.cached_tokens == 4
    assert sink_of(queued).text == "<79><80>"
    settle(engine)
    check_scheduler(sched, runner)


def test_a_step_that_fails_after_a_stop_string_ended_a_request_leaves_no_cell_behind(harness):
    """Overlapped, a stop string ends a request while the next decode runs; if that step then fails
    to collect, the cell its row wrote is dropped all the same (the other requests fail)."""
    engine, sched, runner = harness(start=False, n_slots=2, n_pages=64, max_batch_tokens=8, max_ctx=64)
    runner.overlaps = True
    stopped = make_request([10, 11], max_tokens=10, stop=["3><1"])
    other = make_request([50, 51], max_tokens=10)
    collect, failed = runner.collect, []

    def failing_collect(step):
        if not stopped.status.running and not failed:
            failed.append(step)
            raise RuntimeError("the device is gone")
        return collect(step)

    runner.collect = failing_collect
    engine.start()
    engine.submit(stopped, other)
    wait_done(stopped, other)
    assert failed and sink_of(stopped).finish.reason == "stop"
    assert sink_of(other).errors and "the device is gone" in sink_of(other).errors[0].message
    settle(engine)
    check_scheduler(sched, runner)
