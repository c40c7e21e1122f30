"""size_memory (server/runtime/assembly.py): the drafter's lanes, its reserve and the KV pool beside it,
decided from measured numbers alone."""
from __future__ import annotations

from typing import Any

import pytest

from pflash_plugin.engine.loader import EngineConfig, MemoryReserveError
from pflash_plugin.server.runtime.assembly import MemoryPlan, MemoryProbe, size_memory
from pflash_plugin.server.config.llama_params import ModelPlan, pflash_plan, plan
from pflash_plugin.server.config.settings import ModelSettings

KV = 100  # bytes per token of the target's KV
# 4 slots x max_ctx 1000, each slot's stream padded to 1024 tokens: 4096, in pages of 10
AUTOMATIC_POOL = 4100


def model_plan(kv_pool_tokens: int | None = None, **pflash: Any) -> ModelPlan:
    settings = ModelSettings(model="m.gguf", **pflash)
    engine = EngineConfig(max_ctx=1000, n_slots=4, page_size=10, kv_pool_tokens=kv_pool_tokens)
    return ModelPlan("m", engine, pflash_plan(settings, engine.max_ctx), plan(settings))


WINDOWED = {"pflash": "always", "pflash_drafter_window": 512}
# each lane adds 20 KB; a pool of max_ctx takes 100 KB
RESERVES = (10_000, 30_000, 50_000, 70_000)


def gpu_probe(available: int, reserves: tuple[int, ...] = RESERVES) -> MemoryProbe:
    return MemoryProbe(KV, available, 1.0, drafter_on_gpu=True, reserves=reserves)


def test_without_pflash_the_pool_is_the_automatic_size_and_nothing_is_reserved():
    assert size_memory(model_plan(), gpu_probe(0)) == MemoryPlan(0, 0, AUTOMATIC_POOL)


def test_the_most_lanes_whose_reserve_leaves_a_pool_of_max_ctx():
    # 4 lanes leave 80 KB (800 tokens < max_ctx); 3 leave 100 KB, a pool of exactly max_ctx
    assert size_memory(model_plan(**WINDOWED), gpu_probe(150_000)) == MemoryPlan(3, 50_000, 1000)
    # room for every lane: the pool shrinks to what is left, at most its automatic size
    assert size_memory(model_plan(**WINDOWED), gpu_probe(300_000)) == MemoryPlan(4, 70_000, 2300)
    assert size_memory(model_plan(**WINDOWED), gpu_probe(10**9)) == MemoryPlan(4, 70_000, AUTOMATIC_POOL)


def test_lanes_asked_for_are_taken_and_refused_when_their_reserve_leaves_too_little():
    assert size_memory(model_plan(**WINDOWED, pflash_drafter_lanes=2), gpu_probe(300_000)) == \
        MemoryPlan(2, 30_000, 2700)
    with pytest.raises(MemoryReserveError, match="only 800 KV tokens fit, less than max_ctx"):
        size_memory(model_plan(**WINDOWED, pflash_drafter_lanes=4), gpu_probe(150_000))


def test_one_lane_on_the_cpu_or_without_windows():
    cpu = MemoryProbe(KV, 300_000, 1.0, drafter_on_gpu=False, reserves=RESERVES)
    assert size_memory(model_plan(**WINDOWED), cpu) == MemoryPlan(1, 10_000, 2900)
    no_windows = model_plan(pflash="always", pflash_drafter_window=0)
    assert size_memory(no_windows, gpu_probe(300_000)) == MemoryPlan(1, 10_000, 2900)


def test_a_drafter_on_another_device_than_the_pool_reserves_nothing_of_it():
    assert size_memory(model_plan(**WINDOWED), gpu_probe(0, reserves=(0,) * 4)) == MemoryPlan(4, 0, AUTOMATIC_POOL)


def test_the_pool_counts_only_its_kv_share_on_the_drafters_gpu():
    half = MemoryProbe(KV, 150_000, 0.5, drafter_on_gpu=True, reserves=RESERVES)
    # 4 lanes leave 80 KB, at 50 bytes a token here: 1600 tokens
    assert size_memory(model_plan(**WINDOWED), half) == MemoryPlan(4, 70_000, 1600)


def test_an_explicit_pool_that_eats_the_reserve_is_refused_saying_what_fits():
    with pytest.raises(MemoryReserveError, match="--kv_pool_tokens 2000 does not leave .* at most 1000 tokens fit"):
        size_memory(model_plan(2000, **WINDOWED, pflash_drafter_lanes=3), gpu_probe(150_000))
    assert size_memory(model_plan(1000, **WINDOWED), gpu_probe(150_000)) == MemoryPlan(3, 50_000, 1000)
