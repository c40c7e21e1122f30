"""llama.cpp polls the abort callback (a call into Python that takes the GIL) after every node the CPU
computes: only steps that may be cut short for a newcomer pay those polls, never a step of decode
rows alone (issue 48 item 5)."""
from __future__ import annotations

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.llama import Batch, Context, ContextConfig, Model, ModelParams
from tests.conftest import run_requests


def test_a_disarmed_context_decodes_without_polling_and_an_armed_one_polls(tiny_model):
    model = Model(tiny_model, ModelParams(n_gpu_layers=0))
    ctx = Context(model, ContextConfig(n_ctx=256, n_threads=1, n_threads_batch=1))
    polls: list[int] = []
    ctx.set_abort(lambda: polls.append(1) is None and False)
    batch = Batch(64)
    try:
        for armed, start in ((False, 0), (True, 8), (False, 16)):
            ctx.arm_abort(armed)
            before = len(polls)
            batch.clear()
            batch.add_sequence(list(range(5, 13)), start, 0, True)
            ctx.decode(batch)
            assert (len(polls) > before) is armed
    finally:
        batch.close()
        ctx.close()
        model.close()


def test_decode_steps_are_not_polled_and_prefill_steps_are(tiny_model):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                         backend_sampling="off"))
    polls: list[int] = []
    engine.runner.set_abort(lambda: polls.append(1) is None and False)  # never aborts: counts the polls
    by_kind: dict[bool, int] = {True: 0, False: 0}
    launch = engine.runner.launch

    def counted(step):
        before = len(polls)
        launch(step)
        decoding = all(len(item.tokens) == 1 + item.drafts for item in step.items)
        by_kind[decoding] += len(polls) - before

    engine.runner.launch = counted
    try:
        requests = [Request(model.tokenize(f"prompt {i} about the weather"),
                            SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)) for i in range(3)]
        run_requests(engine, requests)
    finally:
        engine.stop()
    assert [len(r.output_tokens) for r in requests] == [8, 8, 8]
    assert by_kind[False] > 0  # the prompts' step may be cut short: polled
    assert by_kind[True] == 0  # the decode steps: never
