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
    step that prefills two prompts."""

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
        self.cut_at, self.polls, self.armed, self.cut = cut_at, 0, False, False
        self.newcomer: Request | None = None
        self.ctx.set_abort(lambda: self.poll(polls[0]))

    def poll(self, engine_says: object) -> bool:
        if self.armed and self.cut_at is not None:
            self.polls += 1
            if self.polls == self.cut_at:
                self.stepping.arrived([self.newcomer])  # as Engine.submit does from a server thread
        aborted = bool(engine_says())  # type: ignore[operator]
        self.cut |= aborted
        return aborted

    def round(self) -> None:
        """One engine round: schedule, step, events out."""
        self.stepping.run(self.sched.schedule())
        self.sched.emit()

    def run(self, a: Request, b: Request, newcomer: Request, then: Request) -> list[int]:
        """`a` prefills a step alone, then `b` comes: the next step finishes both prompts (the cut
        one, where `cut_at` is set: the newcomer arrives inside it), then the newcomer is admitted,
        and `then` once all three ended. Returns what the two-prompt step left prefilled of a, b."""
        self.newcomer = newcomer
        self.sched.submit(a)
        self.round()
        self.sched.submit(b)
        step = self.sched.schedule()
        assert sorted(len(item.tokens) for item in step.items) == [len(b.prompt_tokens), a.prefill_left]
        self.armed = True
        self.stepping.run(step)
        self.armed = False
        assert self.cut == (self.cut_at is not None), "the step of two prompts was cut, or not"
        kept = [a.n_prefilled, b.n_prefilled]
        self.stepping.arrival.clear()  # the engine's next round
        self.sched.submit(newcomer)
        while self.sched.has_work:
            self.round()
        self.sched.submit(then)
        while self.sched.has_work:
            self.round()
        return kept

    def close(self) -> None:
        self.runner.close()


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    loaded = Model(tiny_model)
    yield loaded
    loaded.close()


def prompts() -> tuple[Request, Request, Request, Request]:
    """A prompt longer than a step, one that finishes its prefill beside the first one's rest, a
    newcomer, and a prompt that extends the first one (it reuses that slot's cache in place)."""
    return (request(list(range(100, 200))), request(list(range(300, 320))), request(list(range(500, 505))),
            request([*range(100, 200), 7, 8, 9]))


@pytest.mark.parametrize("cut_at", [60, 160])  # polls: 1 or 4 of the 56-token step's ubatches computed
def test_a_step_of_two_prompts_cut_for_a_newcomer_keeps_what_it_computed_and_the_tokens(model, cut_at):
    reference = Rig(model, cut_at=None)
    try:
        requests = prompts()
        assert reference.run(*requests) == [100, 20]
        expected = [r.output_tokens for r in requests]
    finally:
        reference.close()
    rig = Rig(model, cut_at=cut_at)
    try:
        requests = a, b, c, d = prompts()
        kept = rig.run(*requests)
        # a keeps what the computed ubatches wrote of its chunk; b had prefilled nothing into its
        # slot (it could still lend it): rolled back
        assert 64 < kept[0] < 100 and kept[1] == 0, kept
        # greedy, with and without the cut; d reads a's cache, written partly by the cut step
        assert [r.output_tokens for r in requests] == expected
        assert d.cached_tokens == 100
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
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
