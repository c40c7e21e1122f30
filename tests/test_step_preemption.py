"""A step of several prompts cut short for a newcomer, on a real llama.cpp context (the tiny generated
llama, CPU): the abort callback fires inside the decode after some ubatches computed; what they wrote
stays prefilled (Steps.preempted), the rest is redone after the newcomer's step. Greedy tokens match
a run that is never cut, no KV page leaks, and the idle slots' prefix caches hold exactly their KV."""
from __future__ import annotations

from pathlib import Path

import pytest

from pflash_plugin.engine.failures import Failures
from pflash_plugin.engine.kv_pool import PagePool
from pflash_plugin.engine.published import Published
from pflash_plugin.engine.request import Request, RequestStatus, SamplingParams
from pflash_plugin.engine.runner import LlamaRunner
from pflash_plugin.engine.scheduler import Scheduler, SchedulerConfig
from pflash_plugin.engine.stepping import Stepping
from pflash_plugin.llama import Context, ContextConfig, Model

SLOTS, SLOT_CTX, PAGE = 3, 256, 16
N_BATCH, N_UBATCH = 64, 8


def request(prompt: list[int], max_tokens: int = 6) -> Request:
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), sink=lambda event: None)


class Rig:
    """An engine's step machinery over a real context, driven round by round (no thread). `cut_at`:
    the abort poll (one per graph node on the CPU) at which a newcomer arrives, inside the first
    step, which prefills two prompts."""

    def __init__(self, model: Model, cut_at: int | None) -> None:
        self.ctx = Context(model, ContextConfig(n_ctx=SLOTS * SLOT_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH,
                                                n_seq_max=SLOTS, kv_unified=False, n_threads=1, n_threads_batch=1))
        self.runner = LlamaRunner(model, self.ctx)
        config = SchedulerConfig(n_slots=SLOTS, max_batch_tokens=N_BATCH, max_ctx=SLOT_CTX, max_queue=8,
                                 prefill_chunk=None, preempt_chunk=N_UBATCH)
        pools = [PagePool(SLOT_CTX // PAGE, PAGE) for _ in range(SLOTS)]
        self.sched = Scheduler(self.runner, pools, config, model.piece, model.is_eog)
        polls: list = []
        self.runner.set_abort = polls.append  # type: ignore[method-assign]  # the engine's callback, wrapped below
        self.stepping = Stepping(self.sched, self.runner, Failures(self.sched, "test"), Published(self.sched))
        self.cut_at, self.polls, self.cut = cut_at, 0, False
        self.newcomer: Request | None = None
        self.ctx.set_abort(lambda: self.poll(polls[0]))

    def poll(self, engine_says: object) -> bool:
        if self.cut_at is not None and not self.cut:
            self.polls += 1
            if self.polls == self.cut_at:
                self.stepping.arrived([self.newcomer])  # as Engine.submit does from a server thread
        aborted = bool(engine_says())  # type: ignore[operator]
        self.cut |= aborted
        return aborted

    def run(self, first: list[Request], newcomer: Request, then: Request) -> list[int]:
        """Submit `first` (two prompts that prefill in one step), then the newcomer once that step
        ran (or was cut: the newcomer's arrival cut it), then `then` once all three ended. Returns
        what the two-prompt step left prefilled of each of `first`."""
        self.newcomer = newcomer
        self.sched.submit(*first)
        kept: list[int] = []
        while self.sched.has_work:
            step = self.sched.schedule()
            two = not kept and len(step.items) == 2
            self.stepping.run(step)
            self.sched.emit()
            if two:
                assert self.cut == (self.cut_at is not None), "the step of two prompts was cut, or not"
                kept = [r.n_prefilled for r in first]
                self.stepping.arrival.clear()  # the engine's next round
                self.sched.submit(newcomer)
        self.sched.submit(then)
        while self.sched.has_work:
            self.stepping.run(self.sched.schedule())
            self.sched.emit()
        return kept

    def close(self) -> None:
        self.runner.close()


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    loaded = Model(tiny_model)
    yield loaded
    loaded.close()


def prompts() -> tuple[list[Request], Request, Request]:
    """Two prompts that finish their prefill in one step, a newcomer, and a prompt that extends the
    first one (it reuses that slot's cache in place)."""
    return ([request(list(range(100, 140))), request(list(range(300, 320)))], request(list(range(500, 505))),
            request([*range(100, 140), 7, 8, 9]))


@pytest.mark.parametrize("cut_at", [100, 200])  # polls: 2 or 5 ubatches of the 60-token step computed
def test_a_step_of_two_prompts_cut_for_a_newcomer_keeps_what_it_computed_and_the_tokens(model, cut_at):
    reference = Rig(model, cut_at=None)
    try:
        (a, b), c, d = prompts()
        reference.run([a, b], c, d)
        expected = [r.output_tokens for r in (a, b, c, d)]
    finally:
        reference.close()
    rig = Rig(model, cut_at=40)  # some ubatches of the 60-token step computed, not all
    try:
        (a, b), c, d = prompts()
        kept = rig.run([a, b], c, d)
        assert 0 < sum(kept) < 60, f"the cut step kept {kept} of its 40 + 20 tokens"
        # greedy, with and without the cut; d reads a's cache, written partly by the cut step
        assert [r.output_tokens for r in (a, b, c, d)] == expected
        assert d.cached_tokens == 40
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, c, d))
        check_cache_exact(rig)
    finally:
        rig.close()


def check_cache_exact(rig: Rig) -> None:
    """Every slot idle, its KV exactly its tokens, and its pages exactly what those tokens need."""
    cache = rig.sched.cache
    for slot in rig.sched.slots:
        assert slot.request is None
        assert rig.runner.kv_tokens(slot.index) == len(slot.tokens), f"slot {slot.index}: KV past its tokens"
        assert len(slot.pages) == cache.pages_for(len(slot.tokens))
    assert cache.used_pages == sum(cache.pages_for(len(s.tokens)) for s in rig.sched.slots)
