"""PFlash under concurrent serving: hand-off to the compression thread, resume, cancel, routing."""
from __future__ import annotations

import threading

import pytest

from pflash_plugin.engine.request import ErrorKind, RequestStatus
from pflash_plugin.engine.scheduler import AdmissionError
from pflash_plugin.llama import Model
from pflash_plugin.pflash.compressor import CompressionJob, CompressionWorker, Compressor, PflashConfig
from pflash_plugin.pflash.drafter import DraftOptions, Drafter
from pflash_plugin.pflash.pacing import Alone
from pflash_plugin.pflash.query import plan_query
from pflash_plugin.pflash.report import PflashReport
from pflash_plugin.testing import cached_tiny_llama

from mock_runner import (
    EngineHarness,
    FakeCompressor,
    check_scheduler,
    compressed_request,
    make_request,
    make_scheduler,
    run_until_idle,
    sink_of,
    step_once,
)

TIMEOUT = 5.0
LONG = list(range(1, 41))


def long_request(prompt=LONG, max_tokens: int = 3):
    return compressed_request(prompt, max_tokens)


def test_long_prompt_is_served_compressed_and_reports_the_client_prompt():
    sched, runner = make_scheduler(n_slots=2, n_pages=32, max_batch_tokens=16, can_compress=True)
    request = long_request()
    sched.add(request)
    assert not sched.schedule().items  # handed off, nothing to prefill yet
    assert sched.take_handed() == [request] and request.status is RequestStatus.COMPRESSING
    assert sched.stats().compressing[0].prompt_tokens == 40
    sched.resume(request, LONG[:4] + LONG[-6:], PflashReport("compressed", 40, kept_tokens=10))
    run_until_idle(sched, runner)
    usage = sink_of(request).finish.usage
    assert usage.prompt_tokens == 40 and usage.pflash.kept_tokens == 10
    assert sched.slots[request.slot].tokens[:10] == LONG[:4] + LONG[-6:]  # the compressed prompt was prefilled
    check_scheduler(sched, runner)


def test_prepared_requests_go_ahead_of_new_arrivals_in_arrival_order():
    sched, runner = make_scheduler(n_slots=1, n_pages=64, max_batch_tokens=16, can_compress=True)
    first, second = long_request(LONG), long_request([50 + i for i in range(40)])
    sched.add(first), sched.add(second)
    sched.schedule()
    newcomer = make_request([7, 8, 9])
    sched.add(newcomer)
    sched.resume(first, LONG[:8], PflashReport("compressed", 40))
    sched.resume(second, [50, 51, 52], PflashReport("compressed", 40))
    assert list(sched.prepared) == [first, second] and list(sched.waiting) == [newcomer]
    run_until_idle(sched, runner)
    assert runner.started == [first.request_id, second.request_id, newcomer.request_id]


def test_cached_prefix_skips_compression():
    sched, runner = make_scheduler(n_slots=2, n_pages=32, max_batch_tokens=64, can_compress=True)
    sched.add(make_request(LONG, max_tokens=2))
    run_until_idle(sched, runner)
    again = long_request(LONG + [99])
    sched.add(again)
    run_until_idle(sched, runner)
    assert sched.take_handed() == [] and again.pflash.status == "skipped" and "cached" in again.pflash.reason
    assert sink_of(again).finish.usage.cached_tokens == 40


def test_queue_limit_counts_prompts_in_compression():
    sched, runner = make_scheduler(n_slots=1, max_queue=1, can_compress=True)
    assert sched.submit(long_request()) is None and sched.submit(long_request()) is None
    assert len(sched.compressing) == 2 and not sched.running  # the slot is free, but both will want it
    error = sched.submit(make_request([1, 2]))
    assert isinstance(error, AdmissionError) and error.kind is ErrorKind.BUSY


@pytest.fixture
def engine_with_fake():
    harness = EngineHarness()

    def build(**kw):
        fake = FakeCompressor()
        engine, sched, _ = harness(compressor=fake, **kw)
        return engine, sched, fake

    yield build
    harness.stop()


def test_the_compressor_drafts_beside_the_engines_activity():
    """The engine hands each job over with its activity: interactive work waits while a request
    in a slot awaits its first token, and slots decode once one generates."""
    harness, fake = EngineHarness(), FakeCompressor()
    engine, sched, runner = harness(start=False, compressor=fake, n_slots=2, n_pages=64, max_batch_tokens=16)
    activity = engine.activity
    scored, chat = long_request(), make_request([5, 6, 7], max_tokens=4)
    sched.submit(scored, chat)
    engine._hand_off()
    engine._publish_status()
    assert fake.neighbours == [activity] and fake.jobs[0][0] is scored.compression
    assert activity.interactive_waiting() and not activity.slots_decoding()
    step_once(sched, runner)  # the chat's prompt and first token
    engine._publish_status()
    assert not activity.interactive_waiting() and activity.slots_decoding()
    run_until_idle(sched, runner)
    engine._publish_status()
    assert not activity.interactive_waiting() and not activity.slots_decoding()


def test_decoding_chat_keeps_stepping_while_a_prompt_is_scored(engine_with_fake):
    engine, sched, fake = engine_with_fake(n_slots=2, n_pages=64, max_batch_tokens=16, max_ctx=128)
    long = long_request()
    engine.submit(long)
    assert fake.submitted.acquire(timeout=TIMEOUT)
    chat = make_request([5, 6, 7], max_tokens=30)
    engine.submit(chat)
    assert sink_of(chat).done.wait(TIMEOUT), "the chat did not finish while the drafter scored"
    assert sink_of(chat).finish.usage.completion_tokens == 30
    assert long.status is RequestStatus.COMPRESSING and not sink_of(long).events
    fake.deliver(0, LONG[-8:])
    assert sink_of(long).done.wait(TIMEOUT)
    assert sink_of(long).finish.usage.prompt_tokens == 40


def test_two_long_prompts_arriving_together_are_both_compressed(engine_with_fake):
    engine, sched, fake = engine_with_fake(n_slots=2, n_pages=64, max_batch_tokens=16, max_ctx=128)
    a, b = long_request(LONG), long_request([60 + i for i in range(40)])
    engine.submit(a), engine.submit(b)
    assert fake.submitted.acquire(timeout=TIMEOUT) and fake.submitted.acquire(timeout=TIMEOUT)
    assert [j for j, _ in fake.jobs] == [a.compression, b.compression]
    fake.deliver(1, [60, 61, 62, 99])
    fake.deliver(0, [1, 2, 3, 40])
    assert sink_of(a).done.wait(TIMEOUT) and sink_of(b).done.wait(TIMEOUT)
    assert {a.pflash.status, b.pflash.status} == {"compressed"}


def test_cancelled_request_stops_its_compression(engine_with_fake):
    engine, sched, fake = engine_with_fake(n_slots=1, n_pages=64, max_batch_tokens=16, max_ctx=128)
    request = long_request()
    engine.submit(request)
    assert fake.submitted.acquire(timeout=TIMEOUT)
    engine.cancel(request)
    assert sink_of(request).done.wait(TIMEOUT)
    assert sink_of(request).finish.reason == "cancelled"
    job_, _ = fake.jobs[0]
    assert job_.cancelled.is_set()  # the worker stops scoring at its next chunk
    fake.deliver(0, LONG[:4])  # a late result is dropped, no slot is taken
    follow = make_request([1, 2, 3], max_tokens=2)
    engine.submit(follow)
    assert sink_of(follow).done.wait(TIMEOUT)
    assert len(sink_of(request).terminal) == 1 and request.slot is None


def test_worker_stops_drafting_a_cancelled_job():
    model = Model(cached_tiny_llama())
    tokens = model.tokenize("word " * 600)[:600]
    job_ = CompressionJob(tokens, plan_query(len(tokens), 8), 0.25)

    class CancelledAfterOneChunk(Drafter):
        def run(self, toks, *args, progress, **kw):
            return super().run(toks, *args, progress=lambda done: (progress(done), job_.cancelled.set()), **kw)

    def drafter() -> CancelledAfterOneChunk:
        return CancelledAfterOneChunk(model, [0], 1024, DraftOptions(n_batch=64))

    compressor = Compressor(PflashConfig(), model.piece, drafter, persistent=False)
    worker = CompressionWorker(compressor)
    delivered = []
    done = threading.Event()
    worker.submit(job_, Alone(), lambda result: (delivered.append(result), done.set()))
    follow = CompressionJob(tokens[:100], plan_query(100, 8), 0.5)
    worker.submit(follow, Alone(), lambda result: (delivered.append(result), done.set()))
    assert done.wait(TIMEOUT)
    worker.stop()
    assert job_.progress == 64  # one chunk of 64, then it stopped
    assert len(delivered) == 1 and delivered[0].report.original_tokens == 100  # the thread lives on


def test_scored_prompt_waits_for_its_model_even_when_the_queue_is_full():
    sched, runner = make_scheduler(n_slots=1, max_queue=1, can_compress=True)
    long = long_request()
    sched.add(long)
    sched.schedule()
    sched.add(make_request([1, 2]))  # the queue is now full for new arrivals
    sched.resume(long, LONG[:6], PflashReport("compressed", 40))
    assert long in sched.prepared  # never scored twice, never answered 429 after scoring
    run_until_idle(sched, runner)
    assert sink_of(long).finish.reason == "length"


def test_routed_long_prompt_is_compressed_by_its_model(tiny_model, tmp_path):
    from conftest import live_server
    from pflash_plugin.testing import write_tiny_llama

    other = write_tiny_llama(tmp_path / "b.gguf", seed=9)
    pflash = {"pflash": "auto", "pflash_threshold": 64, "pflash_keep_ratio": 0.3, "pflash_segment_min": 4,
              "pflash_segment_max": 16}
    threads = {"n_threads": 1, "n_threads_batch": 1}
    models = [
        {"model": str(tiny_model), "model_alias": "a", "n_ctx": 1024, "max_concurrency": 1, **threads},
        {"model": str(other), "model_alias": "b", "n_ctx": 1024, "max_concurrency": 1, "max_queue": 1, **threads,
         **pflash},
    ]
    prompt = " ".join(f"note {i}: the bridge opens at dawn." for i in range(25)) + " When does it open?"
    with live_server(models) as server, server.client(timeout=120) as client:
        short = client.post("/v1/completions", json={"prompt": "hi", "model": "a", "max_tokens": 2}).json()
        assert "pflash" not in short["usage"]["timings"]
        reply = client.post("/v1/completions", json={"prompt": prompt, "model": "b", "max_tokens": 4}).json()
    report = reply["usage"]["timings"]["pflash"]
    assert reply["model"] == "b" and report["status"] == "compressed"
    assert reply["usage"]["prompt_tokens"] == report["original_tokens"] > 3 * report["kept_tokens"] * 0.9


def test_prompt_too_short_to_compress_never_queues_behind_scoring(tiny_model):
    """Decided on the request's own thread: a short chat with pflash 'always' must not wait in the
    compression queue behind long prompts being scored."""
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.wire.protocol import PflashOverride
    from pflash_plugin.server.config.settings import ModelSettings

    served = ServedModel(ModelSettings(model=str(tiny_model), n_ctx=1024, pflash="always", verbose=False, n_threads=1,
                                       n_threads_batch=1))
    try:
        short = served.planner.plan(served.model.tokenize("Name a color."), None)
        assert short.job is None and short.report is not None and short.report.status == "skipped"
        long = served.planner.plan(served.model.tokenize(" ".join(f"line {i} of notes." for i in range(120))),
                                   PflashOverride(keep_ratio=0.3))
        assert long.job is not None and long.report is None
    finally:
        served.close()


def test_chat_and_explicit_query_requests_are_compressed_over_http(tiny_model):
    from conftest import live_server

    settings = {"model": str(tiny_model), "n_ctx": 2048, "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1,
                "pflash": "auto", "pflash_threshold": 64, "pflash_keep_ratio": 0.3, "pflash_segment_min": 4,
                "pflash_segment_max": 16, "pflash_reuse_compressed": True}
    notes = " ".join(f"Note {i}: the bridge opens at dawn." for i in range(40))
    with live_server([settings]) as server, server.client(timeout=120) as client:
        chat = client.post("/v1/chat/completions", json={"max_tokens": 3, "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": notes + " When does the bridge open?"}]}).json()
        tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
        tools = client.post("/v1/chat/completions", json={
            "max_tokens": 3, "messages": [{"role": "user", "content": notes}], "tools": [tool]}).json()
        asked = {"mode": "always", "keep_ratio": 0.5, "query": "When does it open?"}
        explicit = client.post("/v1/completions", json={"prompt": notes, "max_tokens": 3, "pflash": asked}).json()
        too_long = client.post("/v1/completions", json={"prompt": notes, "max_tokens": 3,
                                                         "pflash": {"mode": "always", "query": "open " * 300}})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "pflash.query"
    report = chat["usage"]["timings"]["pflash"]
    assert report["status"] == "compressed" and chat["usage"]["prompt_tokens"] == report["original_tokens"]
    assert tools["usage"]["timings"]["pflash"]["status"] == "skipped"  # tools: only when the request asks
    assert "tools" in tools["usage"]["timings"]["pflash"]["reason"]
    e = explicit["usage"]["timings"]["pflash"]
    assert e["status"] == "compressed" and 0.3 < e["keep_ratio"] <= 0.5


# ---- a prompt that extends one compressed earlier (the next turn of a conversation) --------------
def serve_compressed(sched, runner, kept: list[int]):
    """LONG compressed to `kept` and answered; returns the request."""
    first = long_request(max_tokens=3)
    sched.add(first)
    sched.schedule()
    assert sched.take_handed() == [first]
    sched.resume(first, kept, PflashReport("compressed", 40, kept_tokens=len(kept)))
    run_until_idle(sched, runner)
    return first


def test_by_default_the_next_turn_of_a_compressed_prompt_is_compressed_again():
    """Its question may need segments the earlier turn's selection dropped."""
    sched, runner = make_scheduler(n_slots=2, n_pages=32, max_batch_tokens=16, can_compress=True)
    first = serve_compressed(sched, runner, LONG[:4] + LONG[-6:])
    follow = long_request(LONG + first.output_tokens + [77, 78], max_tokens=2)
    sched.add(follow)
    sched.schedule()
    assert sched.take_handed() == [follow]


def test_a_prompt_that_extends_a_compressed_one_reuses_its_cells_without_compressing():
    sched, runner = make_scheduler(n_slots=2, n_pages=32, max_batch_tokens=16, can_compress=True,
                                   reuse_compressed=True)
    kept = LONG[:4] + LONG[-6:]
    first = serve_compressed(sched, runner, kept)
    follow = long_request(LONG + first.output_tokens + [77, 78], max_tokens=2)
    sched.add(follow)
    run_until_idle(sched, runner)
    assert sched.take_handed() == []  # nothing drafted
    assert follow.prefill_tokens == kept + first.output_tokens + [77, 78]
    assert follow.pflash.status == "skipped" and "compressed earlier" in follow.pflash.reason
    usage = sink_of(follow).finish.usage
    assert usage.prompt_tokens == 40 + 3 + 2  # what the client sent
    assert usage.cached_tokens >= len(kept)
    check_scheduler(sched, runner)
    # and the turn after: the follow-up's own compressed form serves it
    third = long_request(follow.prompt_tokens + follow.output_tokens + [88], max_tokens=1)
    sched.add(third)
    run_until_idle(sched, runner)
    assert sched.take_handed() == [] and third.prefill_tokens[:len(kept)] == kept
    check_scheduler(sched, runner)


def test_a_prompt_that_leaves_the_compressed_one_or_outlives_its_cache_is_compressed():
    sched, runner = make_scheduler(n_slots=2, n_pages=32, max_batch_tokens=16, can_compress=True,
                                   reuse_compressed=True)
    first = serve_compressed(sched, runner, LONG[:4] + LONG[-6:])
    again = long_request(LONG + first.output_tokens + [77], max_tokens=1)
    sched.add(again)
    run_until_idle(sched, runner)
    assert sched.take_handed() == []  # reused while cached
    other = long_request(LONG[:20] + [90 + i for i in range(25)])  # differs inside the first prompt
    sched.add(other)
    sched.schedule()
    assert sched.take_handed() == [other]
    sched.cache.evict_idle()  # the compressed cells are gone: the same follow-up is compressed
    follow = long_request(LONG + first.output_tokens + [77])
    sched.add(follow)
    sched.schedule()
    assert sched.take_handed() == [follow]


def test_the_next_chat_turn_reuses_the_compressed_prompt_over_http(tiny_model):
    from conftest import live_server

    settings = {"model": str(tiny_model), "n_ctx": 2048, "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1,
                "pflash": "auto", "pflash_threshold": 64, "pflash_keep_ratio": 0.3, "pflash_segment_min": 4,
                "pflash_segment_max": 16, "pflash_reuse_compressed": True}
    notes = " ".join(f"Note {i}: the bridge opens at dawn." for i in range(40))
    turn = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": notes + " When does the bridge open?"}]
    with live_server([settings]) as server, server.client(timeout=120) as client:
        first = client.post("/v1/chat/completions", json={"max_tokens": 4, "temperature": 0, "messages": turn}).json()
        turn += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And when does it close?"}]
        second = client.post("/v1/chat/completions", json={"max_tokens": 4, "temperature": 0, "messages": turn}).json()
    compressed = first["usage"]["timings"]["pflash"]
    reused = second["usage"]["timings"]["pflash"]
    assert compressed["status"] == "compressed", compressed
    assert reused["status"] == "skipped" and "compressed earlier" in reused["reason"], reused
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]  # the client's count
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= compressed["kept_tokens"]


def samples_of(prompt: list[int], n: int) -> list:
    """n samples of one prompt sharing one compression job, as prepare makes them for `n`."""
    first = long_request(prompt)
    rest = [long_request(prompt) for _ in range(n - 1)]
    for request in rest:
        request.compression = first.compression
    return [first, *rest]


def test_the_samples_of_one_prompt_are_compressed_once(engine_with_fake):
    """Issue 22: n=3 on a compressed prompt drafted it 3 times (6.9 s against 3.2 s for n=1), and
    held the compression thread n times as long. One job runs; each sample gets its result, and
    cancelling one sample leaves the job to the others."""
    engine, sched, fake = engine_with_fake(n_slots=3, n_pages=64, max_batch_tokens=16, max_ctx=128)
    samples = samples_of(LONG, 3)
    engine.submit(*samples)
    assert fake.submitted.acquire(timeout=TIMEOUT)
    engine.cancel(samples[0])
    assert sink_of(samples[0]).done.wait(TIMEOUT) and sink_of(samples[0]).finish.reason == "cancelled"
    assert len(fake.jobs) == 1 and not samples[1].compression.cancelled.is_set()
    fake.deliver(0, [1, 2, 3, 40])
    for request in samples[1:]:
        assert sink_of(request).done.wait(TIMEOUT) and sink_of(request).finish.reason == "length"
        assert request.pflash.status == "compressed" and request.pflash.kept_tokens == 4
    assert samples[1].pflash is not samples[2].pflash  # each its own report


def test_a_job_shared_by_samples_is_cancelled_once_all_of_them_are(engine_with_fake):
    engine, sched, fake = engine_with_fake(n_slots=2, n_pages=64, max_batch_tokens=16, max_ctx=128)
    samples = samples_of(LONG, 2)
    engine.submit(*samples)
    assert fake.submitted.acquire(timeout=TIMEOUT)
    job_ = samples[0].compression
    engine.cancel(samples[1])
    assert sink_of(samples[1]).done.wait(TIMEOUT) and not job_.cancelled.is_set()
    engine.cancel(samples[0])
    assert sink_of(samples[0]).done.wait(TIMEOUT) and job_.cancelled.is_set()


def test_n_samples_of_a_compressed_prompt_are_drafted_once_over_http(tiny_model):
    from conftest import live_server

    settings = {"model": str(tiny_model), "n_ctx": 2048, "max_concurrency": 3, "n_threads": 1, "n_threads_batch": 1,
                "pflash": "auto", "pflash_threshold": 64, "pflash_keep_ratio": 0.3, "pflash_segment_min": 4,
                "pflash_segment_max": 16}
    notes = " ".join(f"Note {i}: the bridge opens at dawn." for i in range(40))
    with live_server([settings]) as server, server.client(timeout=120) as client:
        compressor = server.app.state.models.get(None).compression.compressor
        drafted = []
        compress = compressor.compress
        compressor.compress = lambda job, neighbours: (drafted.append(job), compress(job, neighbours))[1]
        answer = client.post("/v1/completions", json={"prompt": notes, "max_tokens": 2, "n": 3, "seed": 1})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 3 and len(drafted) == 1
    assert answer.json()["usage"]["timings"]["pflash"]["status"] == "compressed"
