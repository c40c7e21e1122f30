"""The engine on real llama.cpp contexts (no HTTP): determinism and batched-vs-alone agreement."""
from __future__ import annotations

import threading
from typing import Callable

import pytest

from pflash_plugin.engine.embedder import Embedder
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import ErrorEvent, ErrorKind, FinishEvent, Request, SamplingParams, TextEvent
from pflash_plugin.engine.prefixes import common_prefix
from pflash_plugin.engine.scheduler import AdmissionError, Step
from pflash_plugin.llama import Model


def run_together(engine, requests: list[Request], timeout: float = 120) -> list[list[int]]:
    """Submit all requests in one message, so they are admitted in the same step."""
    done = threading.Semaphore(0)
    for request in requests:
        request.sink = lambda event: done.release() if isinstance(event, (FinishEvent, ErrorEvent)) else None
    engine.submit(*requests)
    for _ in requests:
        assert done.acquire(timeout=timeout), "request did not finish"
    return [r.output_tokens for r in requests]


def run_texts(engine, requests: list[Request], timeout: float = 120) -> list[tuple[str, str]]:
    """Submit all requests in one message; each one's text and finish reason ("error" for an error)."""
    texts: dict[int, list[str]] = {}
    ends: dict[int, str] = {}
    done = threading.Semaphore(0)
    for request in requests:
        def sink(event, rid: int = request.request_id) -> None:
            if isinstance(event, TextEvent):
                texts.setdefault(rid, []).append(event.text)
            elif isinstance(event, (FinishEvent, ErrorEvent)):
                ends[rid] = getattr(event, "reason", "error")
                done.release()
        request.sink = sink
    engine.submit(*requests)
    for _ in requests:
        assert done.acquire(timeout=timeout), "a request did not finish"
    return [("".join(texts.get(r.request_id, [])), ends[r.request_id]) for r in requests]


def test_same_seed_same_concurrency_same_output(tiny_model):
    outputs = []
    for _ in range(2):
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=256, n_threads=1, n_threads_batch=1))
        try:
            requests = [
                Request(model.tokenize(f"prompt {i} about the weather"),
                        SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i))
                for i in range(4)
            ]
            outputs.append(run_together(engine, requests))
        finally:
            engine.stop()
    assert outputs[0] == outputs[1]
    assert len({tuple(o) for o in outputs[0]}) == 4




@pytest.mark.demo
def test_batched_decode_stays_close_to_alone(demo_model):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colors are"]
    model, engine = load_engine(demo_model, EngineConfig(n_slots=4, max_ctx=512))
    try:
        greedy = SamplingParams(max_tokens=16, temperature=0)
        alone = []
        for prompt in prompts:
            engine.clear_prefix_cache()  # no prefix reuse: each runs from scratch
            alone += run_together(engine, [Request(model.tokenize(prompt), greedy)])
        engine.clear_prefix_cache()
        together = run_together(engine, [Request(model.tokenize(p), greedy) for p in prompts])
    finally:
        engine.stop()
    # not bit-identical (DESIGN.md 3): same first token, and a long shared greedy prefix
    assert [a[0] for a in alone] == [t[0] for t in together]
    prefixes = [common_prefix(a, t) for a, t in zip(alone, together)]
    assert sum(prefixes) / len(prefixes) >= 8, prefixes


def test_shutdown_cancels_what_runs_and_leaves_the_kv_as_the_pool_says(tiny_model):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=4096, n_threads=1, n_threads_batch=1))
    first_token, finished = threading.Event(), []

    def sink(event) -> None:
        if isinstance(event, TextEvent):
            first_token.set()
        elif isinstance(event, (FinishEvent, ErrorEvent)):
            finished.append(event)

    long = Request(model.tokenize("a story that goes on"),
                   SamplingParams(max_tokens=4000, temperature=0, min_tokens=4000), sink=sink)
    short = Request(model.tokenize("short"), SamplingParams(max_tokens=2, temperature=0))
    engine.submit(long)
    assert first_token.wait(60)
    run_together(engine, [short])  # served beside it
    engine.shutdown(0.0)
    assert not engine._thread.is_alive() and engine.health().state == "stopped"
    assert [e.reason for e in finished] == ["cancelled"] and 0 < len(long.output_tokens) < 4000
    with pytest.raises(AdmissionError):
        engine.submit(Request(model.tokenize("late"), SamplingParams(max_tokens=2)))
    sched, ctx = engine.scheduler, engine.runner.ctx
    assert not sched.live and all(s.request is None for s in sched.slots)
    for slot in sched.slots:  # the real KV holds exactly what each idle cache says
        assert ctx.memory.seq_pos_max(slot.index) == len(slot.tokens) - 1
        assert len(slot.pages) == sched.cache.pages_for(len(slot.tokens))
    assert sched.cache.used_pages == sum(len(s.pages) for s in sched.slots)
    engine.close()
    assert ctx.ptr is None


def test_embedder_embeds_then_frees_its_context(tiny_model):
    model = Model(tiny_model)
    embedder = Embedder(model, 64, 64, n_threads=1)
    vector = embedder.embed(model.tokenize("hello there"))
    assert len(vector) == model.n_embd and abs(sum(v * v for v in vector) - 1.0) < 1e-4
    embedder.close()
    assert embedder.ctx.ptr is None and embedder.batch.raw is None


def test_steps_that_only_decode_measure_both_thread_counts_and_prefill_keeps_the_batch_threads(tiny_model):
    """A step of two slots decoding runs on n_threads or n_threads_batch (both threads of llama.cpp
    set alike), each measured before the runner picks the faster; a prefill keeps n_threads_batch."""
    import llama_cpp.llama_cpp as C

    model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=256, n_threads=1, n_threads_batch=2))
    ctx, seen = engine.runner.ctx, []
    decode = ctx.decode

    def recording(batch) -> None:
        seen.append((batch.n_tokens, C.llama_n_threads(ctx.ptr), C.llama_n_threads_batch(ctx.ptr)))
        decode(batch)

    ctx.decode = recording
    try:
        prompts = ["the first prompt of a few tokens", "another prompt, also of several tokens"]
        run_together(engine, [Request(model.tokenize(p), SamplingParams(max_tokens=6, temperature=0)) for p in prompts])
    finally:
        engine.stop()
    decode_steps = [(threads, batch_threads) for n_tokens, threads, batch_threads in seen if n_tokens == 2]
    assert (2, 2) in decode_steps and (1, 1) in decode_steps, seen  # both measured
    assert engine.runner.decode_threads.threads(2) in (1, 2)
    assert all(batch_threads == 2 for n_tokens, _, batch_threads in seen if n_tokens > 2), seen  # prefill


PENALTIES = [{}, {"repeat_penalty": 1.3}, {"frequency_penalty": 0.25, "presence_penalty": 0.5}]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_greedy_rows_are_taken_together_and_match_the_sampler_chain(tiny_model, monkeypatch, penalties):
    """Greedy requests take the argmax of llama.cpp's logits buffer for all rows at once, after
    each row's penalties (no sampler call); the tokens equal those of the chain's own pass, which a
    typical_p forces (greedy ignores it). min_tokens still keeps end-of-generation tokens out."""
    from pflash_plugin.llama import SamplerChain

    calls = {"n": 0}
    original = SamplerChain.sample

    def counting(self, ctx, index):
        calls["n"] += 1
        return original(self, ctx, index)

    monkeypatch.setattr(SamplerChain, "sample", counting)
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                         penalty_last_n=8))
    try:
        def requests(**extra) -> list[Request]:
            return [Request(model.tokenize(f"prompt {i} about the weather"),
                            SamplingParams(max_tokens=24, temperature=0.0, min_tokens=6 * (i % 2), **penalties,
                                           **extra))
                    for i in range(4)]

        fast = run_together(engine, requests())
        assert calls["n"] == 0
        chain = run_together(engine, requests(typical_p=0.5))  # a typical_p changes nothing but the path
        assert calls["n"] == sum(len(tokens) for tokens in chain)
    finally:
        engine.stop()
    assert fast == chain
    if penalties:  # the window of 8 makes the tiny model leave its two-token loop
        assert max(len(set(tokens)) for tokens in fast) > 2


def test_logprobs_match_a_float64_log_softmax():
    """The runner's float32 log-probabilities (the normalizer summed in float64) agree with a
    float64 log-softmax to 1e-6, best first; -inf logits (suppressed tokens) stay -inf."""
    import numpy as np

    from pflash_plugin.engine.logprobs import with_logprobs as _with_logprobs

    logits = (np.random.default_rng(0).standard_normal(50_000) * 6).astype(np.float32)
    logits[:3] = -np.inf
    shifted = logits.astype(np.float64) - logits.max()
    reference = shifted - np.log(np.exp(shifted).sum())
    out = _with_logprobs(7, logits, 5)
    assert abs(out.logprob - reference[7]) < 1e-6
    assert [t for t, _ in out.top_logprobs] == list(np.argsort(-reference)[:5])
    assert max(abs(v - reference[t]) for t, v in out.top_logprobs) < 1e-6
    assert _with_logprobs(1, logits, 0).logprob == -np.inf


def test_greedy_rows_with_logprobs_match_the_sampler_chain(tiny_model):
    """Log-probabilities on the batched greedy path are those of the chain's path: taken from the
    row before its penalties."""
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=256, n_threads=1, n_threads_batch=1))

    def outputs(**extra) -> list[list[tuple[int, float | None, list | None]]]:
        requests = [Request(model.tokenize(f"prompt {i}"), SamplingParams(max_tokens=10, temperature=0.0, logprobs=3,
                                                                          repeat_penalty=1.3, **extra))
                    for i in range(2)]
        seen: list[list] = [[], []]
        done = threading.Semaphore(0)
        for i, request in enumerate(requests):
            def sink(event, i=i):
                if isinstance(event, TextEvent):
                    seen[i] += [(t.token, t.logprob, t.top_logprobs) for t in event.tokens]
                elif isinstance(event, (FinishEvent, ErrorEvent)):
                    done.release()
            request.sink = sink
        engine.submit(*requests)
        for _ in requests:
            assert done.acquire(timeout=60)
        return seen

    try:
        fast, chain = outputs(), outputs(typical_p=0.5)
    finally:
        engine.stop()
    assert fast == chain and all(len(tokens) == 10 and tokens[0][1] is not None for tokens in fast)


def test_a_grammar_whose_steps_keep_growing_ends_its_request_with_a_400(tiny_model):
    """An ambiguous grammar multiplies llama.cpp's parse stacks with every token (about 4x here:
    0.05 s at the 10th token, 2.7 s at the 14th), which no estimate before the first token sees: the
    step that runs past max_grammar_step_s ends its request, and the request beside it goes on."""
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=256, n_threads=1, n_threads_batch=1))
    try:
        a = model.tokenize("a", add_special=False)[-1]
        grammar = 'root ::= r "x"\nr ::= "a" r "b" | "a" r "c" | "a"'
        hostile = Request(model.tokenize("hi"), SamplingParams(max_tokens=40, temperature=0, grammar=grammar,
                                                               logit_bias={a: 100.0}, max_grammar_step_s=0.05))
        beside = Request(model.tokenize("hello"), SamplingParams(max_tokens=30, temperature=0))
        ends: dict[int, object] = {}
        done = threading.Semaphore(0)
        for request in (hostile, beside):
            def sink(event, request=request):
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    ends[request.request_id] = event
                    done.release()
            request.sink = sink
        engine.submit(hostile, beside)
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    finally:
        engine.stop()
    error = ends[hostile.request_id]
    assert isinstance(error, ErrorEvent) and error.kind is ErrorKind.INVALID
    assert "grow with every token" in error.message
    assert 5 < len(hostile.output_tokens) < 20
    assert isinstance(ends[beside.request_id], FinishEvent) and len(beside.output_tokens) == 30


def assert_overlapped_is_serial(tiny_model, config: EngineConfig,
                                make_requests: Callable[[Model, list[str]], list[Request]]) -> None:
    """The requests' tokens, texts and finish reasons, overlapped as on a GPU (`runner.overlaps`),
    are the serial order's, with a stop string for the first request cut from the middle of its
    answer (which must end on it, early)."""
    def run(overlaps: bool, stop: list[str]) -> list[tuple[str, list[int], str]]:
        model, engine = load_engine(tiny_model, config)
        engine.runner.overlaps = overlaps
        requests = make_requests(model, stop)
        try:
            return [(text, r.output_tokens, reason) for r, (text, reason) in zip(requests, run_texts(engine, requests))]
        finally:
            engine.stop()

    whole = run(False, [])[0][0]
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    serial, overlapped = run(False, [stop]), run(True, [stop])
    assert serial[0][2] == "stop" and len(serial[0][1]) < 24
    assert overlapped == serial


@pytest.mark.parametrize("backend_sampling", ["off", "on"])
def test_overlapped_steps_give_what_serial_steps_give(tiny_model, backend_sampling):
    """A GPU's order forced on the CPU (`runner.overlaps`): the text of a step is released while
    the next decode runs, so a stop string ends its request one decode late. The tokens, texts and
    finish reasons are those of the serial order, and the queued request that takes the stopped
    one's slot runs as it would (llama.cpp's sampling skips the stopped request's extra row; with
    backend sampling, the stopped request's device chain is freed once that decode has landed)."""
    def requests(model: Model, stop: list[str]) -> list[Request]:
        return [Request(model.tokenize(f"prompt {i} about the weather"),
                        SamplingParams(max_tokens=24, temperature=0, stop=stop if i == 0 else []))
                for i in range(3)]

    assert_overlapped_is_serial(tiny_model, EngineConfig(n_slots=2, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                         backend_sampling=backend_sampling), requests)


@pytest.mark.parametrize("backend_sampling", ["off", "on"])
def test_a_stop_found_before_a_launch_of_several_ubatches_gives_what_serial_steps_give(tiny_model, backend_sampling):
    """A GPU's order forced on the CPU with ubatches of 4 tokens: a long prompt prefills beside a
    short one's answer in steps of 16 tokens, so each step's text goes out before its launch, and
    the stop string is found there, with the stopped request's row already in the step about to
    launch. Tokens, texts and finish reasons are the serial order's."""
    def requests(model: Model, stop: list[str]) -> list[Request]:
        long = model.tokenize(" ".join(f"word{i}" for i in range(150)))
        assert 15 * 24 < len(long) < 500  # still prefilling when the short one stops
        return [Request(model.tokenize("a short prompt about the weather"),
                        SamplingParams(max_tokens=24, temperature=0, stop=stop)),
                Request(long, SamplingParams(max_tokens=2, temperature=0))]

    config = EngineConfig(n_slots=2, max_ctx=512, n_batch=16, n_ubatch=4, n_threads=1, n_threads_batch=1,
                          backend_sampling=backend_sampling)
    assert_overlapped_is_serial(tiny_model, config, requests)


def test_only_a_step_of_one_ubatch_returns_early_where_the_runner_overlaps(tiny_model):
    """The context's ubatch as llama.cpp sized it (n_ubatch 8 of n_batch 16): a step of more
    tokens waits at its launch for all its ubatches but the last, so it does not return early."""
    from pflash_plugin.engine.scheduler import BatchItem

    model, engine = load_engine(tiny_model, EngineConfig(n_slots=1, max_ctx=256, n_batch=16, n_ubatch=8,
                                                         n_threads=1, n_threads_batch=1))
    try:
        runner = engine.runner
        step = lambda n: Step([BatchItem(Request([1] * n, SamplingParams()), [1] * n, 0, True)])  # noqa: E731
        assert runner.ctx.n_ubatch == 8 and not runner.overlaps  # the CPU: nothing runs beside a launch
        assert not runner.returns_early(step(8))
        runner.overlaps = True
        assert runner.returns_early(step(8)) and not runner.returns_early(step(9))
    finally:
        engine.stop()


def test_collect_waits_for_the_decode_only_where_nothing_read_its_outputs(tiny_model):
    """Reading a step's logits or sampled tokens waits for its decode (llama.cpp synchronizes), so
    collect waits itself only after a step that sampled nothing (a prompt's chunks before its last):
    the next launch and KV operations need that decode landed."""
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=256, n_batch=16, n_threads=1,
                                                         n_threads_batch=1))
    runner, collects = engine.runner, []  # [tokens returned, waits] per collect
    synchronize, collect = runner.ctx.synchronize, runner.collect

    def counted_synchronize() -> None:
        collects[-1][1] += 1
        synchronize()

    def counted_collect(step: Step) -> dict:
        collects.append([0, 0])
        outputs = collect(step)
        collects[-1][0] = len(outputs)
        return outputs

    runner.ctx.synchronize, runner.collect = counted_synchronize, counted_collect
    try:
        prompt = model.tokenize(" ".join(f"word{i}" for i in range(40)))
        assert len(prompt) > 32  # prefilled in chunks of 16
        run_together(engine, [Request(prompt, SamplingParams(max_tokens=4, temperature=0))])
    finally:
        engine.stop()
    assert [waits for _, waits in collects] == [0 if returned else 1 for returned, _ in collects]
    assert any(returned == 0 for returned, _ in collects) and sum(returned for returned, _ in collects) >= 3


def test_a_chat_turn_whose_cache_is_in_a_lone_slot_is_copied_beside_the_running_ones(tiny_model, monkeypatch):
    """Four slots, a KV stream each: a conversation's cache in slot 3 while two requests run in
    slots 0 and 1. Its next turn is copied into slot 2 (one run of sequences, one ubatch a step)
    and gives the tokens it gets where it reuses the cache in place."""
    from pflash_plugin.engine.slot_placement import SlotPlacement

    def chat_turn() -> Request:
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=128, kv_layout="per_slot",
                                                             n_threads=1, n_threads_batch=1))
        try:
            greedy = lambda n: SamplingParams(max_tokens=n, min_tokens=n, temperature=0)  # noqa: E731
            warm = [Request(model.tokenize(f"warm {i} on a long road"), greedy(1 + i)) for i in range(4)]
            run_together(engine, warm)
            assert [w.slot for w in warm] == [0, 1, 2, 3]
            last = warm[3]
            chat = Request(last.prompt_tokens + last.output_tokens + model.tokenize(" and then"), greedy(12))
            runners = [Request([5 + i, 6], greedy(24)) for i in range(2)]  # shorter: admitted first
            run_together(engine, runners + [chat])
            assert [r.slot for r in runners] == [0, 1]
        finally:
            engine.stop()
        return chat

    moved = chat_turn()
    monkeypatch.setattr(SlotPlacement, "lone_runs_move", lambda self, idle, copying: False)
    in_place = chat_turn()
    assert (moved.slot, in_place.slot) == (2, 3)
    assert moved.cached_tokens == in_place.cached_tokens > 0
    assert moved.output_tokens == in_place.output_tokens and len(moved.output_tokens) == 12
