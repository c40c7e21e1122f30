"""A speculative draft model in the server's memory plan (issue 47): its weights and its context's
KV and buffers are reserved beside the KV pool (before, the pool could take the memory the draft
model then needed), and `--draft_model pflash` borrows PFlash's loaded drafter rather than loading
the same GGUF a second time."""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from pflash_plugin.engine.loader import EngineConfig, MemoryReserveError
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.engine.speculation.setup import DraftModel, draft_context
from pflash_plugin.llama import Model
from pflash_plugin.pflash.reserve import context_bytes
from pflash_plugin.server.config.llama_params import ModelPlan, pflash_plan, plan
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.server.runtime.assembly import (Devices, MemoryPlan, MemoryProbe, size_memory,
                                                   speculation_draft_bytes)
from pflash_plugin.testing import cached_tiny_llama
from test_engine_real import run_texts

KV = 100  # bytes per token of the target's KV
AUTOMATIC_POOL = 4100  # 4 slots x max_ctx 1000, each stream padded to 1024 tokens, in pages of 10
RESERVES = (10_000, 30_000, 50_000, 70_000)  # the PFlash drafter's, by lanes


def model_plan(**settings: Any) -> ModelPlan:
    model = ModelSettings(model="m.gguf", **settings)
    engine = EngineConfig(max_ctx=1000, n_slots=4, page_size=10)
    return ModelPlan("m", engine, pflash_plan(model, engine.max_ctx), plan(model))


def test_a_draft_model_s_need_is_left_free_beside_the_pool():
    no_draft = MemoryProbe(KV, 300_000, 1.0)
    assert size_memory(model_plan(), no_draft) == MemoryPlan(0, 0, AUTOMATIC_POOL)  # not sized by the memory
    draft = MemoryProbe(KV, 300_000, 1.0, draft_bytes=50_000)
    assert size_memory(model_plan(), draft) == MemoryPlan(0, 50_000, 2500)  # 250 KB left: 2,500 tokens
    with pytest.raises(MemoryReserveError, match="the draft model's reserve .* only 500 KV tokens fit.*--draft_model"):
        size_memory(model_plan(), MemoryProbe(KV, 100_000, 1.0, draft_bytes=50_000))


def test_with_pflash_the_draft_model_s_need_adds_to_the_drafter_s_reserve():
    windowed = model_plan(pflash="always", pflash_drafter_window=512)
    alone = MemoryProbe(KV, 300_000, 1.0, drafter_on_gpu=True, reserves=RESERVES)
    assert size_memory(windowed, alone) == MemoryPlan(4, 70_000, 2300)
    both = MemoryProbe(KV, 300_000, 1.0, drafter_on_gpu=True, reserves=RESERVES, draft_bytes=50_000)
    assert size_memory(windowed, both) == MemoryPlan(4, 120_000, 1800)
    # 4 lanes and the draft leave 80 KB (800 tokens); 3 lanes and the draft leave exactly max_ctx
    tight = MemoryProbe(KV, 200_000, 1.0, drafter_on_gpu=True, reserves=RESERVES, draft_bytes=50_000)
    assert size_memory(windowed, tight) == MemoryPlan(3, 100_000, 1000)


def test_a_draft_model_needs_its_context_and_its_weights_unless_they_are_borrowed(tiny_model):
    model = Model(str(tiny_model))
    try:
        served = ModelPlan("m", EngineConfig(max_ctx=512, n_slots=4), pflash_plan(ModelSettings(model="m"), 512),
                           plan(ModelSettings(model="m")))
        shape = draft_context(4, 512)
        context = context_bytes(model, shape.batch_tokens, 512, gpu=False)
        assert context >= model.kv_bytes_per_token() * 512 > 0
        cpu = Devices(0, [])
        assert speculation_draft_bytes(served, DraftModel(model), cpu) == context + model.size_bytes
        assert speculation_draft_bytes(served, DraftModel(model, owned=False), cpu) == context
        assert speculation_draft_bytes(served, None, cpu) == 0
    finally:
        model.close()


@pytest.fixture(scope="module")
def q4_draft() -> Path:
    return cached_tiny_llama(quant="q4_0")


def loaded(path: Path) -> int:
    """Models of that GGUF open in this process."""
    gc.collect()
    return sum(1 for m in gc.get_objects() if isinstance(m, Model) and m.ptr and m.path == str(path))


def test_draft_model_pflash_borrows_the_loaded_drafter_and_the_memory_counts_it_once(tiny_model, q4_draft):
    from pflash_plugin.server.runtime.models import ServedModel

    before = loaded(q4_draft)
    served = ServedModel(ModelSettings(model=str(tiny_model), n_ctx=512, max_concurrency=2, pflash="always",
                                       verbose=False, n_threads=1, n_threads_batch=1, pflash_drafter=str(q4_draft),
                                       pflash_drafter_cut=False, draft_model="pflash"))
    try:
        drafter = served.compression.compressor._drafter.model
        speculation = served.engine.scheduler.steps.speculation
        assert speculation is not None and speculation.proposer.model is drafter
        assert loaded(q4_draft) == before + 1  # the GGUF loaded once, for both jobs
        requests = [Request(served.model.tokenize("one two three four one two"),
                            SamplingParams(max_tokens=16, temperature=0))]
        run_texts(served.engine, requests)
        assert served.engine.stats().speculation.drafted > 0
    finally:
        served.close()
    assert drafter.ptr  # the engine closed its draft context, not the drafter's weights
