"""--prefill_chunk by where the model runs: 512 with its layers on a GPU, 128 on the CPU (measured
on each: engine/loader.py, default_prefill_chunk); an explicit value wins everywhere."""
from __future__ import annotations

import pytest

from pflash_plugin.engine import loader
from pflash_plugin.engine.loader import EngineConfig, build_engine, load_model
from pflash_plugin.llama import ModelParams


@pytest.mark.parametrize("gpus, layers, chunk, expected", [
    (0, 0, None, 128), (0, -1, None, 128),  # a CPU build: -1 asks for layers no GPU takes
    (1, -1, None, 512), (1, 0, None, 128),  # a GPU, but the layers left on the CPU
    (1, -1, 64, 64), (0, 0, 1024, 1024),
])
def test_the_prefill_chunk_follows_the_layers(tiny_model, monkeypatch, gpus, layers, chunk, expected):
    monkeypatch.setattr(loader, "gpu_count", lambda: gpus)
    config = EngineConfig(n_slots=1, max_ctx=256, prefill_chunk=chunk, n_threads=1, n_threads_batch=1,
                          model=ModelParams(n_gpu_layers=layers))
    model = load_model(tiny_model, config)
    engine = build_engine(model, config)
    try:
        assert engine.scheduler.config.prefill_chunk == expected
    finally:
        engine.shutdown(0.0)
        engine.close()
        model.close()
