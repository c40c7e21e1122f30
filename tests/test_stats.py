"""The engine's stats (engine/stats.py): one frozen record a round, in the /status shape."""
from __future__ import annotations

import dataclasses

import pytest

from pflash_plugin.engine.engine import Engine
from pflash_plugin.engine.host_cache import HostCache
from pflash_plugin.engine.request import Event, FinishEvent, Request
from mock_runner import EngineHarness, make_request, make_scheduler, run_until_idle, sink_of, wait_done

# the /status keys of one model's engine part, in their order (docs/api.md)
ENGINE_KEYS = ["slots", "running", "waiting", "compressing", "waiting_prepared", "kv_layout", "kv_pages_used",
               "kv_pages_active", "kv_pages_total", "kv_page_size", "prefix_cache_tokens", "prefix_reused_tokens"]
HOST_KEYS = ["host_cache_entries", "host_cache_bytes", "host_cache_capacity_bytes", "host_cache_saved"]


@pytest.fixture
def harness():
    h = EngineHarness()
    yield h
    h.stop()


def test_the_status_shape_is_kept():
    sched, runner = make_scheduler(n_slots=2)
    done = make_request([1, 2, 3], max_tokens=2)
    sched.add(done)
    run_until_idle(sched, runner)
    stats = sched.stats()
    assert list(stats.as_dict()) == [*ENGINE_KEYS, "steps"]
    assert stats.as_dict()["slots"] == [
        {"id": 0, "state": "idle", "request_id": None, "kv_tokens": 4, "kv_pages": 1},
        {"id": 1, "state": "idle", "request_id": None, "kv_tokens": 0, "kv_pages": 0}]
    assert stats.as_dict()["prefix_reused_tokens"] == {"in_place": 0, "copied": 0, "restored": 0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.running = 1  # type: ignore[misc]
    with_host, _ = make_scheduler(host=HostCache(10**6, 1))
    assert list(with_host.stats().as_dict()) == [*ENGINE_KEYS, *HOST_KEYS, "steps"]
    assert with_host.stats().as_dict()["host_cache_capacity_bytes"] == 10**6


def count_stats_builds(engine, sched) -> list[int]:
    """The engine's step count at each build of the scheduler's stats, from now on."""
    built: list[int] = []
    stats = sched.stats

    def counted():
        built.append(engine.steps)
        return stats()

    sched.stats = counted
    return built


def test_a_busy_stretch_builds_the_stats_once_a_round(harness):
    """A round publishes after its step; before it only when events go out first (or no step runs)."""
    engine, sched, runner = harness(n_slots=2, n_pages=32)
    built = count_stats_builds(engine, sched)
    request = make_request([1, 2, 3], max_tokens=40)
    engine.submit(request)
    wait_done(request)
    busy = [steps for steps in built if 0 < steps < engine.steps]  # published between two steps
    assert engine.steps >= 40 and len(busy) == len(set(busy))
    assert engine.stats().steps == engine.steps and engine.stats().running == 0


def test_overlapped_a_busy_stretch_with_ends_and_a_cancel_builds_the_stats_once_a_round(harness):
    """Where the runner overlaps, a round whose events go out before its launch (the last step's
    ends, a cancel) builds the stats there and not again beside its decode."""
    engine, sched, runner = harness(start=False, n_slots=4, n_pages=64)
    runner.overlaps = True
    built = count_stats_builds(engine, sched)
    long = make_request([1, 2, 3], max_tokens=30)
    short = [make_request([10 + i, 20, 30], max_tokens=3 + 4 * i) for i in range(2)]  # end by length
    cancelled = make_request([40, 41, 42], max_tokens=30)
    runner.hook = lambda index, step: engine.cancel(cancelled) if index == 12 else None
    engine.start()
    engine.submit(long, *short, cancelled)
    wait_done(long, *short, cancelled)
    assert sink_of(cancelled).finish.reason == "cancelled"
    busy = [steps for steps in built if 0 < steps < engine.steps]  # built between two steps
    assert engine.steps >= 30 and len(busy) == len(set(busy))
    assert engine.stats().running == 0  # built before the last request's end went out


def _watch(request: Request, engine: Engine, seen: dict[int, tuple[int, list[int | None]]]) -> None:
    """At the request's last event: the engine's steps and the requests its published stats show in slots."""
    collector = sink_of(request)

    def sink(event: Event) -> None:
        if isinstance(event, FinishEvent):
            seen[request.request_id] = (engine.steps, [slot.request_id for slot in engine.stats().slots])
        collector(event)

    request.sink = sink


@pytest.mark.parametrize("overlaps", [False, True])
def test_a_client_that_got_its_answer_no_longer_sees_its_request_in_the_stats(harness, overlaps):
    """Ended by length, by a stop string and by a cancel. Overlapped, a step's ends go out in the next
    round, after its stats; the stop string is found beside the decode of the round whose launch the
    other end went out before: the stats are built again there."""
    engine, sched, runner = harness(start=False, n_slots=4, n_pages=64)
    runner.overlaps = overlaps
    length = make_request([10, 11], max_tokens=2)  # 12, 13
    stop = make_request([20, 21], max_tokens=10, stop=["<23>"])  # 22, 23: the stop
    cancelled = make_request([30, 31], max_tokens=30)
    long = make_request([40, 41], max_tokens=12)
    collectors = [sink_of(r) for r in (length, stop, cancelled, long)]
    seen: dict[int, tuple[int, list[int | None]]] = {}
    for request in (length, stop, cancelled, long):
        _watch(request, engine, seen)
    runner.hook = lambda index, step: engine.cancel(cancelled) if index == 5 else None
    engine.start()
    engine.submit(length, stop, cancelled, long)
    for collector in collectors:
        assert collector.done.wait(5)
    assert [c.finish.reason for c in collectors] == ["length", "stop", "cancelled", "length"]
    assert seen[length.request_id][0] == seen[stop.request_id][0]  # their ends went out in one round
    for request in (length, stop, cancelled, long):
        assert request.request_id not in seen[request.request_id][1]
