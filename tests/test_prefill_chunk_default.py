"""--prefill_chunk by where the model runs (engine/loader.py, step_chunks, measured on each): on the
CPU 128 per prompt while others decode, and a lone prefill step past 128 tokens cut short for a
newcomer; with the layers on a GPU no cap (the step's whole budget after the decode rows, as
llama-server) and the cut past 512. An explicit value is the cap everywhere, and the threshold
where it is the smaller."""
from __future__ import annotations

import pytest

from pflash_plugin.engine import loader
from pflash_plugin.engine.loader import EngineConfig, build_engine, load_model
from pflash_plugin.llama import ModelParams


@pytest.mark.parametrize("gpus, layers, chunk, expected", [
    (0, 0, None, (128, 128)), (0, -1, None, (128, 128)),  # a CPU build: -1 asks for layers no GPU takes
    (1, -1, None, (None, 512)), (1, 0, None, (128, 128)),  # a GPU, but the layers left on the CPU
    (1, -1, 64, (64, 64)), (1, -1, 2048, (2048, 512)), (0, 0, 1024, (1024, 128)),
])
def test_the_step_chunks_follow_the_layers(tiny_model, monkeypatch, gpus, layers, chunk, expected):
    monkeypatch.setattr(loader, "gpu_count", lambda: gpus)
    config = EngineConfig(n_slots=1, max_ctx=256, prefill_chunk=chunk, n_threads=1, n_threads_batch=1,
                          model=ModelParams(n_gpu_layers=layers))
    model = load_model(tiny_model, config)
    engine = build_engine(model, config)
    try:
        assert (engine.scheduler.config.prefill_chunk, engine.scheduler.config.preempt_chunk) == expected
    finally:
        engine.shutdown(0.0)
        engine.close()
        model.close()
