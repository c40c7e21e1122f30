"""The KV layout on real llama.cpp contexts: a stream per slot, its capacity, copies across streams."""
from __future__ import annotations

import llama_cpp.llama_cpp as C
import numpy as np
import pytest

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import ErrorKind, Request, SamplingParams
from pflash_plugin.engine.scheduler import AdmissionError
from pflash_plugin.llama import Batch, Context

from test_engine_real import run_together

THREADS = {"n_threads": 1, "n_threads_batch": 1}


@pytest.mark.parametrize("pool, per_slot", [(None, True), (4 * 512 - 256, False)])
def test_auto_layout_gives_each_slot_a_stream_when_every_stream_holds_max_ctx(tiny_model, pool, per_slot):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=512, kv_pool_tokens=pool, **THREADS))
    try:
        ctx = engine.runner.ctx
        assert ctx.config.kv_unified is not per_slot and engine.scheduler.cache.per_slot is per_slot
        if per_slot:  # llama.cpp's own stream size is what the scheduler admits against
            assert C.llama_n_ctx_seq(ctx.ptr) == engine.scheduler.cache.slot_capacity == 512
        prompts = [model.tokenize(f"stream {i} " * (20 + 9 * i)) for i in range(4)]
        outputs = run_together(engine, [Request(p, SamplingParams(max_tokens=6, temperature=0)) for p in prompts])
        assert all(len(o) == 6 for o in outputs)
    finally:
        engine.stop()


def test_a_request_over_a_slots_stream_is_refused_and_one_that_fills_it_is_served(tiny_model):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=1024, kv_pool_tokens=2 * 256,
                                                         kv_layout="per_slot", **THREADS))
    try:
        prompt = model.tokenize("fill " * 100)[:100]
        fits = Request(prompt, SamplingParams(max_tokens=256 - len(prompt), temperature=0, min_tokens=256))
        assert run_together(engine, [fits])[0] and len(fits.output_tokens) == 256 - len(prompt)
        with pytest.raises(AdmissionError) as refused:
            engine.submit(Request(prompt, SamplingParams(max_tokens=257 - len(prompt))))
        assert refused.value.kind is ErrorKind.TOO_LONG and "257 KV tokens" in refused.value.message
        assert "a slot's KV stream holds 256" in refused.value.message
    finally:
        engine.stop()


def prefill(ctx: Context, batch: Batch, tokens: list[int], start: int, seq: int) -> np.ndarray:
    batch.clear()
    batch.add_sequence(tokens, start, seq, True)
    ctx.decode(batch)
    return ctx.logits(batch.n_tokens - 1)


def test_a_prefix_copied_across_streams_gives_the_logits_of_a_fresh_prefill(two_streams):
    """The runner copies slot 0's whole stream into slot 1 and trims it to the prefix (llama.cpp
    asserts on a partial copy across streams); slot 1 then continues as if it had prefilled."""
    model, ctx, runner, batch = two_streams
    tokens = model.tokenize("a prefix shared by two requests, and then their own words " * 8)[:90]
    prefill(ctx, batch, tokens[:60], 0, 0)
    fresh = prefill(ctx, batch, tokens[60:], 60, 0)
    runner.seq_cp(0, 1, 60)
    assert ctx.memory.seq_pos_max(1) == 59 and ctx.memory.seq_pos_max(0) == 89
    copied = prefill(ctx, batch, tokens[60:], 60, 1)
    np.testing.assert_array_equal(copied, fresh)
    assert ctx.memory.seq_pos_max(0) == 89, "the source stream changed"
