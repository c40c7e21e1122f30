"""llama.cpp polls the abort callback (a call into Python that takes the GIL) after every node the CPU
computes: only steps that may be cut short for a newcomer pay those polls, never a step of decode
rows alone nor one of short prompts (issue 48 items 4 and 5)."""
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


def test_only_steps_that_may_be_cut_short_are_polled(tiny_model):
    """Short prompts' steps (under the CPU's preempt chunk of 128) and decode steps are not polled;
    a long prompt prefilling alone (a step of 512) is. Each poll takes the GIL inside llama_decode:
    beside mix8's long bodies in preparation the short prompts' step waited for it."""
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=1024, n_threads=1, n_threads_batch=1,
                                                         backend_sampling="off"))
    polls: list[int] = []
    engine.runner.set_abort(lambda: polls.append(1) is None and False)  # never aborts: counts the polls
    polled: dict[bool, int] = {True: 0, False: 0}  # by whether the step may be cut short
    launch = engine.runner.launch

    def counted(step):
        before = len(polls)
        launch(step)
        polled[engine.scheduler.steps.preemptible(step)] += len(polls) - before

    engine.runner.launch = counted
    try:
        short = [Request(model.tokenize(f"prompt {i} about the weather"),
                         SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)) for i in range(3)]
        run_requests(engine, short)
        long = Request(model.tokenize("the weather today " * 150), SamplingParams(max_tokens=2, temperature=0.0))
        run_requests(engine, [long])
    finally:
        engine.stop()
    assert [len(r.output_tokens) for r in short] == [8, 8, 8] and len(long.prompt_tokens) > 300
    assert polled[True] > 0  # the long prompt's step may be cut short: polled
    assert polled[False] == 0  # the short prompts' step and every decode step: never
