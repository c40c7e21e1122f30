"""--prefill_chunk by where the model runs (engine/loader.py, step_chunks, measured on each): on the
CPU 128 per step while others decode, however many prompts prefill, and a lone prefill step past
128 tokens cut short for a newcomer; with the layers on a GPU 512 per prompt prefilling (an explicit
value as large as n_batch: the step's whole budget after the decode rows, llama-server's rule), and
the cut past 512. An explicit value is the cap everywhere, and the threshold where it is the smaller.
On a GPU the cap grows to 2,048 over the answers decoding while few do (--prefill_per_answer), on the
CPU not. --prefill_chunk_per_step sets whether the cap is the step's in all or each prompt's."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from pflash_plugin.engine.engine import Engine
from pflash_plugin.llama import model as model_module
from pflash_plugin.engine.loader import EngineConfig, build_engine, load_model
from pflash_plugin.llama import ModelParams


@contextmanager
def built(tiny_model: Path, config: EngineConfig) -> Iterator[Engine]:
    """The engine `config` builds on the tiny model, shut down and closed afterwards."""
    model = load_model(tiny_model, config)
    engine = build_engine(model, config)
    try:
        yield engine
    finally:
        engine.shutdown(0.0)
        engine.close()
        model.close()


def from_settings(tiny_model: Path, **settings: Any) -> EngineConfig:
    """The engine config the server makes of these settings (the layers on the CPU)."""
    from pflash_plugin.server.config.llama_params import engine_config
    from pflash_plugin.server.config.settings import ModelSettings

    return engine_config(ModelSettings(model=str(tiny_model), n_threads=1, n_threads_batch=1, **settings),
                         ModelParams(n_gpu_layers=0), 256)



@pytest.mark.parametrize("gpus, layers, chunk, expected", [
    (0, 0, None, (128, 128, True, 0)), (0, -1, None, (128, 128, True, 0)),  # a CPU build: -1 asks for layers none takes
    (1, -1, None, (512, 512, False, 2048)), (1, 0, None, (128, 128, True, 0)),  # a GPU, but the layers left on the CPU
    (1, -1, 64, (64, 64, False, 2048)), (1, -1, 2048, (2048, 512, False, 2048)), (0, 0, 1024, (1024, 128, True, 0)),
])
def test_the_step_chunks_follow_the_layers(tiny_model, monkeypatch, gpus, layers, chunk, expected):
    monkeypatch.setattr(model_module, "gpu_count", lambda: gpus)  # Model.layers_on_gpu reads it
    config = EngineConfig(n_slots=1, max_ctx=256, prefill_chunk=chunk, n_threads=1, n_threads_batch=1,
                          model=ModelParams(n_gpu_layers=layers))
    with built(tiny_model, config) as engine:
        limits = engine.scheduler.config
        chunks = (limits.prefill_chunk, limits.preempt_chunk, limits.chunk_per_step, limits.prefill_per_answer)
        assert chunks == expected


def test_prefill_per_answer_reaches_the_step_policy(tiny_model):
    """--prefill_per_answer from the server's settings to the policy that composes the steps."""
    with built(tiny_model, from_settings(tiny_model, prefill_per_answer=2048)) as engine:
        policy = engine.scheduler.steps.policy
        assert (policy.prefill_chunk, policy.prefill_cap(1), policy.prefill_cap(2), policy.prefill_cap(64)) == (
            128, 2048, 1024, 128)


@pytest.mark.parametrize("per_step", [False, True])
def test_prefill_chunk_per_step_reaches_the_step_policy(tiny_model, per_step):
    """--prefill_chunk_per_step from the server's settings to the policy: with three prompts prefilling
    beside a decoding answer, a step prefills 128 tokens in all, or 128 for each of them (shortest first)."""
    from pflash_plugin.engine.step_policy import Seat

    with built(tiny_model, from_settings(tiny_model, prefill_chunk_per_step=per_step)) as engine:
        seats = [Seat("answer", decoding=True, prefill_left=0)] + [
            Seat(f"prompt{i}", decoding=False, prefill_left=1000) for i in range(3)]
        plan = engine.scheduler.steps.policy.plan(seats)
        assert sum(n for _, n in plan.chunks) == (128 if per_step else 3 * 128)
