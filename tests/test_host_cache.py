"""The host-RAM tier of saved sequences: its bounds, the scheduler's use of it, a real restore."""
from __future__ import annotations

import random

import numpy as np
import pytest
from mock_runner import make_request, make_scheduler, run_until_idle, sink_of, step_once
from conftest import live_server
from test_kv_layout import THREADS, prefill

from pflash_plugin.engine.host_cache import HostCache
from pflash_plugin.engine.request import RequestStatus


def test_the_byte_bound_holds_under_a_flood_of_distinct_prompts():
    host = HostCache(capacity_bytes=10_000, min_tokens=4)
    rng = random.Random(0)
    for i in range(500):
        tokens = [i] + [rng.randrange(1000) for _ in range(rng.randint(4, 40))]
        host.put(tokens, bytes(rng.randint(100, 3000)))
        assert host.bytes_used <= 10_000
    assert host.bytes_used == sum(len(s.data) for s in host._entries.values())
    assert 3 <= len(host) <= 100
    host.put([1, 2, 3, 4], bytes(10_001))  # larger than the whole tier: not kept, nothing dropped
    assert host.bytes_used <= 10_000 and host.best([1, 2, 3, 4, 5])[1] == 0


def test_least_recently_used_goes_first_and_an_extension_replaces_its_prefix():
    host = HostCache(capacity_bytes=300, min_tokens=2)
    host.put([1, 2, 3], bytes(100))
    host.put([7, 8, 9], bytes(100))
    saved, n = host.best([1, 2, 3, 4])
    assert n == 3 and host.best([7, 8, 9, 1])[1] == 3  # a lookup alone changes no order
    host.touch(saved)  # restored: [1, 2, 3] is now the most recently used
    host.put([4, 5, 6], bytes(100))
    host.put([5, 5, 5], bytes(100))  # evicts [7, 8, 9]
    assert host.best([7, 8, 9, 1])[1] == 0 and host.best([1, 2, 3, 1])[1] == 3
    host.put([1, 2, 3, 4, 5], bytes(100))  # holds all of [1, 2, 3]: that entry goes
    assert len(host) == 3 and not host.worth_saving([1, 2, 3]) and host.worth_saving([1, 2, 4])


@pytest.mark.parametrize("per_slot", [True, False])
def test_a_turn_whose_cells_were_evicted_restores_them_and_counts_them_cached(per_slot):
    host = HostCache(capacity_bytes=1 << 20, min_tokens=8)
    sched, runner = make_scheduler(n_slots=1, n_pages=16, page_size=4, max_batch_tokens=32, max_ctx=64,
                                   per_slot=per_slot, host=host)
    turn1 = make_request(list(range(100, 130)), max_tokens=4)
    sched.add(turn1)
    run_until_idle(sched, runner)
    other = make_request(list(range(500, 520)), max_tokens=2)  # takes the only slot: turn 1's cells go
    sched.add(other)
    run_until_idle(sched, runner)
    assert runner.ops_of("save") == [("save", 0)] and len(host) == 1
    history = turn1.prompt_tokens + turn1.output_tokens[:-1]  # what the slot held
    turn2 = make_request(history + [900, 901], max_tokens=2)
    sched.add(turn2)
    step_once(sched, runner)
    assert runner.ops_of("restore") == [("restore", 0, len(history))]
    assert turn2.cached_tokens == len(history) and runner.seq_tokens(0)[:len(history)] == history
    run_until_idle(sched, runner)
    assert sink_of(turn2).finish.usage.cached_tokens == len(history)
    assert sched.stats().cache.prefix_reused_tokens["restored"] == len(history)
    assert len(runner.ops_of("save")) == 2, "the other request's cells are saved when turn 2 takes the slot"


def test_random_load_with_a_host_tier_keeps_every_invariant():
    rng = random.Random(3)
    host = HostCache(capacity_bytes=4000, min_tokens=6)
    sched, runner = make_scheduler(n_slots=2, n_pages=12, page_size=4, max_batch_tokens=8, max_ctx=48,
                                   per_slot=True, host=host, min_copy_tokens=4)
    bases = [[rng.randrange(1, 200) for _ in range(30)] for _ in range(6)]
    requests = []
    for _ in range(120):
        prompt = rng.choice(bases)[: rng.randint(1, 30)] + [rng.randrange(200, 400) for _ in range(rng.randint(0, 4))]
        request = make_request(prompt or [1], max_tokens=rng.randint(1, 6))
        requests.append(request)
        sched.add(request)
        for _ in range(rng.randint(0, 3)):
            step_once(sched, runner)
        assert host.bytes_used <= 4000
    run_until_idle(sched, runner)
    assert all(sink_of(r).finish is not None for r in requests)
    assert runner.ops_of("restore") and sched.stats().cache.prefix_reused_tokens["restored"] > 0


def test_a_restored_state_gives_the_logits_of_a_fresh_prefill(two_streams):
    model, ctx, runner, batch = two_streams
    tokens = model.tokenize("a conversation whose cells were evicted, then asked again " * 8)[:90]
    prefill(ctx, batch, tokens[:60], 0, 0)
    fresh = prefill(ctx, batch, tokens[60:], 60, 0)
    saved = runner.save(0, 1 << 30)
    runner.seq_rm(0, 0)
    prefill(ctx, batch, model.tokenize("something else entirely " * 4)[:40], 0, 0)  # the stream is reused
    runner.restore(1, saved, 60)
    assert ctx.memory.seq_pos_max(1) == 59
    restored = prefill(ctx, batch, tokens[60:], 60, 1)
    np.testing.assert_array_equal(restored, fresh)


def test_over_http_an_evicted_conversation_is_restored_with_cache_true(tiny_model):
    """Stock's --cache / --cache_size: the next turn of a conversation whose cells another request
    took gets them back from host RAM, counted in usage.prompt_tokens_details.cached_tokens."""
    settings = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 1024, "max_concurrency": 1,
                "cache": True, "cache_size": 64 << 20, **THREADS}
    with live_server([settings]) as server, server.client() as client:
        def complete(prompt: str) -> dict:
            reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            return reply.json()

        first = complete("an earlier turn of a long conversation " * 40)
        history = "an earlier turn of a long conversation " * 40 + first["choices"][0]["text"]
        complete("an unrelated request takes the only slot " * 20)
        second = complete(history + " and the next question")
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 8, second["usage"]  # to the retokenized boundary
        status = client.get("/status").json()["models"]["tiny"]
        assert status["prefix_reused_tokens"]["restored"] == cached and status["host_cache_entries"] >= 1


def test_metrics_count_prefix_tokens_by_source_and_the_tier_bytes(tiny_model):
    settings = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 1024, "max_concurrency": 1,
                "cache": True, "cache_size": 64 << 20, **THREADS}
    with live_server([settings]) as server, server.client() as client:
        keep = "a long conversation to keep "
        for prompt in (keep * 60, "something else " * 40, keep * 61):
            assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        text = client.get("/metrics").text
    restored = [line for line in text.splitlines() if line.startswith("pflash_prefix_reused_tokens_total{")
                and 'source="restored"' in line]
    assert restored and float(restored[0].rsplit(" ", 1)[1]) > 300, restored
    host = [line for line in text.splitlines() if line.startswith("pflash_host_cache_bytes{")]
    assert host and float(host[0].rsplit(" ", 1)[1]) > 0


def test_a_restore_llama_cpp_cannot_place_prefills_instead():
    host = HostCache(capacity_bytes=1 << 20, min_tokens=8)
    sched, runner = make_scheduler(n_slots=1, n_pages=16, page_size=4, max_batch_tokens=32, max_ctx=64,
                                   per_slot=True, host=host)
    for prompt in (list(range(100, 130)), list(range(500, 520))):  # the second evicts the first: saved
        sched.add(make_request(prompt, max_tokens=2))
        run_until_idle(sched, runner)

    def cannot_place(slot: int, data: bytes, n_tokens: int) -> None:
        raise RuntimeError("llama.cpp could not restore")

    runner.restore = cannot_place  # type: ignore[method-assign]
    turn = make_request(list(range(100, 131)) + [7], max_tokens=2)
    sched.add(turn)
    run_until_idle(sched, runner)  # check_scheduler after every step: the slot's KV is what it says
    assert turn.cached_tokens == 0 and sink_of(turn).finish.reason == "length"
    assert sched.stats().cache.prefix_reused_tokens["restored"] == 0


def test_a_stream_copy_llama_cpp_has_not_made_yet_is_neither_saved_nor_overwritten_by_a_restore():
    """llama.cpp copies a stream's data at the next decode. A copy's destination that its request
    leaves at once (a grammar refused at start) and a restore into that slot in the same round must
    not mix: the slot's cells would be saved before their data came, or the copy would land on the
    restored cells (a review found it)."""
    host = HostCache(capacity_bytes=1 << 20, min_tokens=8)
    sched, runner = make_scheduler(n_slots=2, n_pages=16, page_size=4, max_batch_tokens=64, max_ctx=64,
                                   per_slot=True, host=host, min_copy_tokens=4)
    saved_prompt, busy_prompt = list(range(100, 120)), list(range(200, 220))
    for prompt, max_tokens in ((saved_prompt, 2), (busy_prompt, 40), (list(range(300, 320)), 2)):
        sched.add(make_request(prompt, max_tokens=max_tokens))
        step_once(sched, runner)
        step_once(sched, runner)
    assert len(host) == 1 and sched.slots[0].request is None and sched.slots[1].request is not None
    refused = make_request(busy_prompt[:15] + [7], grammar="bad")  # copied from the busy slot, then refused
    extends = make_request(saved_prompt + [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2)
    assert sched.submit(refused, extends) is None
    assert runner.ops_of("seq_cp") == [("seq_cp", 1, 0, 15)] and refused.status is RequestStatus.FINISHED_REJECTED
    run_until_idle(sched, runner)  # check_scheduler after every step: each slot's cells hold its tokens
    assert sink_of(extends).finish.reason == "length"


def test_a_saved_state_a_window_sized_swa_cache_cannot_serve_is_never_restored():
    """A window-sized SWA cache holds only a sequence's last cells (n_swa back): a saved state serves
    a prompt only from near its end. Its first cell is read when it is saved, so a prompt sharing only
    its beginning prefills without the state copied back first (and undone), and one extending it
    still restores it."""
    host = HostCache(capacity_bytes=1 << 20, min_tokens=8)
    sched, runner = make_scheduler(n_slots=1, n_pages=16, page_size=4, max_batch_tokens=32, max_ctx=64,
                                   per_slot=True, host=host, swa_window=8)
    turn1 = make_request(list(range(100, 130)), max_tokens=4)
    sched.add(turn1)
    run_until_idle(sched, runner)
    history = turn1.prompt_tokens + turn1.output_tokens[:-1]
    runner.window_first[0] = len(history) - 8  # what a window of 8 keeps of the slot's sequence
    sched.add(make_request(list(range(500, 520)), max_tokens=2))  # takes the slot: turn 1's state saved
    run_until_idle(sched, runner)
    runner.window_first.clear()
    assert len(host) == 1

    early = make_request(history[:12] + [900, 901], max_tokens=2)
    sched.add(early)
    run_until_idle(sched, runner)
    assert runner.ops_of("restore") == [] and early.cached_tokens == 0

    later = make_request(history + [900, 901], max_tokens=2)
    sched.add(later)
    step_once(sched, runner)
    assert runner.ops_of("restore") == [("restore", 0, len(history))] and later.cached_tokens == len(history)
