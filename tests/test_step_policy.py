"""The split between decoding, prefilling and drafting (engine/step_policy.py): the step's
composition from plain values, what the engine publishes to the drafter from the same requests,
and the two together with PFlash's pacing on an injected clock (engine steps and draft chunks
sharing one simulated device)."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.request import RequestStatus
from pflash_plugin.engine.step_policy import Flags, Plan, Seat, StepPolicy, arrival_order, flags
from pflash_plugin.pflash.pacing import Pacing

from mock_runner import (
    EngineHarness,
    FakeCompressor,
    compressed_request,
    make_request,
    make_scheduler,
    run_until_idle,
    step_once,
)


def decoding(key: str) -> Seat[str]:
    return Seat(key, decoding=True, prefill_left=0)


def prefilling(key: str, left: int, starved: int = 0) -> Seat[str]:
    return Seat(key, decoding=False, prefill_left=left, starved=starved, first_token_due=True)


# ---- the step's composition ---------------------------------------------------------------------
def test_decode_rows_first_then_the_shortest_prefill_capped_while_others_decode():
    policy = StepPolicy(max_batch_tokens=512, prefill_chunk=128)
    plan = policy.plan([decoding("a"), prefilling("long", 5000), decoding("b"), prefilling("mid", 900)])
    # two prompts prefill beside decoding rows: 2 x 128 tokens, all of it to the shortest
    assert plan == Plan(("a", "b"), (("mid", 256),), ("long",))
    alone = policy.plan([prefilling("long", 5000)])
    assert alone == Plan((), (("long", 512),), ())  # no one decodes: no cap


def test_a_cap_per_step_bounds_the_steps_prefill_however_many_prompts_prefill():
    """The CPU's cap: a request decoding beside 3 long prompts (the online load, bench/online_steps.py)
    has steps of prefill_chunk prefill tokens, as beside one prompt, not a chunk per prompt (384
    tokens, a step 2-3x as long on 2 cores); shortest first, finishing prompts together."""
    policy = StepPolicy(max_batch_tokens=512, prefill_chunk=128, chunk_per_step=True)
    longs = [prefilling("p2k", 2048), prefilling("p4k", 4096), prefilling("p6k", 6144)]
    assert policy.plan([decoding("d"), *longs]) == Plan(("d",), (("p2k", 128),), ("p4k", "p6k"))
    assert policy.plan([decoding("d"), longs[2]]) == Plan(("d",), (("p6k", 128),), ())
    ending = policy.plan([decoding("d"), prefilling("a", 40), prefilling("b", 60), *longs])
    assert ending.chunks == (("a", 40), ("b", 60)) and sum(n for _, n in ending.chunks) <= 128
    assert policy.plan(longs).chunks == (("p2k", 512),)  # nothing decodes: the whole step


def test_the_cap_grows_while_few_answers_decode():
    """`prefill_per_answer`: a long prompt beside one answer gets that many tokens a step, beside two
    half, and never less than `prefill_chunk`; per prompt on a GPU, in all where chunk_per_step."""
    policy = StepPolicy(max_batch_tokens=4096, prefill_chunk=512, prefill_per_answer=2048)
    answers = [decoding(f"d{i}") for i in range(8)]
    chunk = {n: policy.plan([*answers[:n], prefilling("long", 16000)]).chunks for n in (1, 2, 3, 4, 8)}
    assert chunk == {1: (("long", 2048),), 2: (("long", 1024),), 3: (("long", 682),), 4: (("long", 512),),
                     8: (("long", 512),)}
    two = policy.plan([answers[0], prefilling("a", 9000), prefilling("b", 16000)])
    assert two.chunks == (("a", 4095),)  # 2 x 2,048, the step's 4,096 less the decode row, to the shortest
    cpu = StepPolicy(max_batch_tokens=512, prefill_chunk=128, chunk_per_step=True, prefill_per_answer=256)
    assert cpu.plan([answers[0], prefilling("a", 900), prefilling("b", 900)]).chunks == (("a", 256),)
    assert cpu.plan([*answers[:3], prefilling("a", 900)]).chunks == (("a", 128),)
    assert StepPolicy(4096, 512).prefill_cap(1) == 512  # 0: the cap does not grow


def test_a_step_holds_at_most_its_tokens_of_decode_rows():
    plan = StepPolicy(max_batch_tokens=2).plan([decoding("a"), decoding("b"), decoding("c"), prefilling("p", 5)])
    assert plan == Plan(("a", "b"), (), ("p",))


def test_prompts_that_finish_their_prefill_go_alone():
    """A short chat beside a long prompt: it finishes this step, so the long one waits a step
    rather than delay the chat's first token with a long chunk."""
    policy = StepPolicy(max_batch_tokens=512)
    assert policy.plan([prefilling("long", 5000), prefilling("chat", 12)]) == Plan((), (("chat", 12),), ("long",))
    both = policy.plan([prefilling("c1", 100), prefilling("long", 5000), prefilling("c2", 40)])
    assert both == Plan((), (("c2", 40), ("c1", 100)), ("long",))


def test_a_step_finishing_short_prompts_takes_other_chunks_only_up_to_the_preempt_chunk():
    """Beside a short prompt finishing (one a newcomer's cut is for), another prompt's last long
    chunk or an aged prompt fills the step only up to `preempt_chunk`, so the short one's first
    token does not wait for it; short prompts together keep the whole budget."""
    gpu = StepPolicy(max_batch_tokens=2048, prefill_chunk=512, preempt_chunk=512)
    assert gpu.plan([prefilling("rest", 1500), prefilling("tiny", 6)]).chunks == (("tiny", 6), ("rest", 506))
    assert gpu.plan([prefilling("rest", 1500)]).chunks == (("rest", 1500),)  # alone: the whole step
    chats = [prefilling(f"c{i}", 200) for i in range(4)]
    assert gpu.plan([*chats, prefilling("rest", 1500)]).chunks == tuple((f"c{i}", 200) for i in range(4))
    cpu = StepPolicy(max_batch_tokens=512, prefill_chunk=128, preempt_chunk=128, chunk_per_step=True)
    assert cpu.plan([prefilling("rest", 439), prefilling("tiny", 6)]).chunks == (("tiny", 6), ("rest", 122))
    aged = prefilling("aged", 400, starved=4)  # 400 - 4 x 128 < 6: ahead of the tiny one by urgency
    assert cpu.plan([aged, prefilling("tiny", 6)]).chunks == (("tiny", 6), ("aged", 122))
    assert StepPolicy(max_batch_tokens=512).plan([prefilling("rest", 439), prefilling("tiny", 6)]).chunks == (
        ("tiny", 6), ("rest", 439))  # no preemption: no bound


def test_aging_moves_a_long_prompt_ahead_of_newer_short_ones():
    policy = StepPolicy(max_batch_tokens=64, aging=128)
    fresh = policy.plan([prefilling("long", 1000), prefilling("short", 100)])
    assert fresh.chunks == (("short", 64),) and fresh.left_out == ("long",)
    aged = policy.plan([prefilling("long", 1000, starved=8), prefilling("short", 100)])  # 1000 - 8 x 128 < 100
    assert aged.chunks == (("long", 64),) and aged.left_out == ("short",)


def test_prompts_finishing_in_the_step_go_ahead_of_an_aged_one_which_takes_what_they_leave():
    """Aged past the step's budget, a long prompt went first and kept the whole budget of every
    step for the rest of its prefill, and short prompts arriving meanwhile waited for it (2 CPU
    cores, online: a 12-token prompt 1.2 s behind a 2,236-token one, docs/online.md)."""
    policy = StepPolicy(max_batch_tokens=512, prefill_chunk=128, chunk_per_step=True)
    aged = prefilling("long", 1000, starved=8)  # 1000 - 8 x 128 < 128: due as if it finished now
    plan = policy.plan([decoding("d"), aged, prefilling("chat", 21), prefilling("hi", 12), prefilling("mid", 560)])
    assert plan.chunks == (("hi", 12), ("chat", 21), ("long", 95)) and plan.left_out == ("mid",)
    assert policy.plan([decoding("d"), aged, prefilling("mid", 560)]).chunks == (("long", 128),)


def test_a_step_whose_prefill_chunks_together_pass_the_preempt_chunk_is_preemptible():
    """One prompt or several (the step's decode rows are not passed: they do not count)."""
    policy = StepPolicy(max_batch_tokens=512, preempt_chunk=128)
    assert policy.preemptible([512]) and policy.preemptible([100, 29]) and policy.preemptible([64, 64, 64])
    assert not policy.preemptible([128]) and not policy.preemptible([64, 64]) and not policy.preemptible([])
    assert not StepPolicy(max_batch_tokens=512, prefill_chunk=128).preemptible([512])  # the cap alone: never


def test_only_a_newcomer_whose_prompt_fits_a_step_gains_from_a_cut():
    policy = StepPolicy(max_batch_tokens=2048, preempt_chunk=512)
    assert policy.newcomer_gains(32) and policy.newcomer_gains(2048)
    assert not policy.newcomer_gains(2049)  # it would wait behind the prompts ahead of it anyway
    assert not StepPolicy(max_batch_tokens=2048).newcomer_gains(32)  # no preemption at all


def test_a_step_of_decode_rows_and_several_prompts_chunks_is_preemptible_in_the_scheduler():
    """What the composer passes the policy: the prefill chunks of the step, whatever else it holds."""
    sched, runner = make_scheduler(n_slots=3, n_pages=256, max_batch_tokens=64, max_ctx=1024, preempt_chunk=16,
                                   per_slot=True)
    chat = make_request([900, 901, 902], max_tokens=8)
    sched.submit(chat)
    step_once(sched, runner)  # its prompt: it decodes from now on
    a, b = make_request(list(range(1, 31)), max_tokens=2), make_request(list(range(100, 125)), max_tokens=2)
    sched.submit(a, b)
    step = sched.schedule()
    assert sorted(len(item.tokens) for item in step.items) == [1, 25, 30]
    assert sched.steps.preemptible(step)


def test_with_no_cap_a_prefill_takes_the_whole_step_after_the_decode_rows():
    """No cap (a prefill_chunk as large as the step; the GPU's default before 512, loader.step_chunks):
    llama-server's rule, one long chunk beside the decoding rows rather than a 512-token one per step."""
    seats = [decoding("a"), decoding("b"), prefilling("long", 20_000)]
    assert StepPolicy(max_batch_tokens=2048).plan(seats).chunks == (("long", 2046),)
    assert StepPolicy(max_batch_tokens=2048, prefill_chunk=512).plan(seats).chunks == (("long", 512),)


def test_a_short_chat_arriving_beside_a_long_prefill_gets_its_first_token_next_step():
    sched, runner = make_scheduler(n_slots=2, n_pages=256, max_batch_tokens=64, max_ctx=1024, prefill_chunk=16,
                                   preempt_chunk=16)
    long = make_request(list(range(1, 801)), max_tokens=2)
    sched.submit(long)
    step = step_once(sched, runner)
    assert sched.steps.preemptible(step), "a long prompt prefilling alone is aborted for a newcomer"
    chat = make_request([900, 901, 902], max_tokens=2)
    sched.submit(chat)
    step = step_once(sched, runner)
    assert [item.request for item in step.items] == [chat] and chat.timings.first_token is not None
    assert long.prefill_left > 0 and not sched.steps.preemptible(step)


# ---- what the drafter is told -------------------------------------------------------------------
def test_flags_from_the_seats():
    assert flags([]) == Flags(False, False)
    assert flags([decoding("a")]) == Flags(False, True)
    assert flags([prefilling("p", 10)]) == Flags(True, False)
    assert flags([decoding("a"), prefilling("p", 10)]) == Flags(True, True)
    # a first token a step away (the prompt's rest fits the step) is told apart from a long prefill's
    assert flags([prefilling("p", 10)], step_tokens=64).first_token_next
    assert not flags([prefilling("p", 800)], step_tokens=64).first_token_next
    assert not flags([decoding("a")], step_tokens=64).first_token_next


@pytest.fixture
def harness():
    harness = EngineHarness()
    yield harness
    harness.stop()


def test_the_engine_publishes_prefilling_decoding_and_queued_requests_rightly(harness):
    """Requests awaiting a first token in a slot make the drafter step aside; a request queued for
    a slot behind decoding ones does not: the device gives it nothing sooner (the trap of issue 28:
    queued requests used to count as waiting, and the drafter yielded to them)."""
    engine, sched, runner = harness(start=False, compressor=FakeCompressor(), n_slots=2, n_pages=64,
                                    max_batch_tokens=16, max_ctx=64)
    activity = engine.activity
    first, second = make_request([5, 6], max_tokens=30), make_request([7, 8], max_tokens=30)
    sched.submit(first, second)
    engine._publish_status()
    assert activity.interactive_waiting() and not activity.slots_decoding()  # both prefilling
    queued = make_request([9, 10], max_tokens=2)
    sched.submit(queued)
    step_once(sched, runner)
    engine._publish_status()
    assert queued.status is RequestStatus.WAITING, "both slots are taken: it waits for one"
    assert all(r.status is RequestStatus.DECODING for r in (first, second))
    assert not activity.interactive_waiting() and activity.slots_decoding()
    sched.finish(first, RequestStatus.FINISHED_CANCELLED)
    sched.admit()
    engine._publish_status()
    assert queued.status is RequestStatus.PREFILLING and activity.interactive_waiting() and activity.slots_decoding()
    run_until_idle(sched, runner)
    engine._publish_status()
    assert not activity.interactive_waiting() and not activity.slots_decoding()


# ---- pacing and the policy together, on one simulated device ------------------------------------
STEP_S = 0.02  # an engine step
CHUNK_S = 0.002  # a 512-token draft chunk, alone
CHUNKS = 160  # the handed-off prompt's draft, in 512-token chunks: 0.32 s alone
BOUND_S = 2.0
DUTY = 0.5


class Device:
    """An injected clock shared by the engine and one draft: time the draft spends (computing,
    pausing, stepping aside) lets the engine run its steps meanwhile, one every STEP_S, each
    followed by the engine's publishing."""

    def __init__(self, engine, sched, runner) -> None:
        self.engine, self.sched, self.runner = engine, sched, runner
        self.now, self.next_step, self.steps = 0.0, 0.0, 0

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while self.next_step <= end:
            step_once(self.sched, self.runner)
            self.engine._publish_status()
            self.next_step += STEP_S
            self.steps += 1
        self.now = end

    def draft(self, pacing: Pacing) -> float:
        """Draft CHUNKS chunks as the drafter does (step aside, then a turn); the time it ends."""
        tokens = CHUNKS * 512
        while tokens > 0:
            while pacing.stepping_aside():
                self.advance(0.005)
            turn = pacing.turn()
            size = min(turn.chunk or 2048, tokens)
            self.advance(CHUNK_S * size / 512 / turn.duty)
            tokens -= size
        return self.now


def serve_beside(harness, n_slots: int, neighbours: list, **kw) -> tuple[Device, Pacing, object]:
    """Two chats decoding long answers in an engine of `n_slots`, then `neighbours` submitted, then
    a long prompt handed off to compression; its pacing reads the engine's published activity."""
    fake = FakeCompressor()
    engine, sched, runner = harness(start=False, compressor=fake, n_slots=n_slots, n_pages=600,
                                    max_batch_tokens=16, max_ctx=1024, prefill_chunk=4, **kw)
    device = Device(engine, sched, runner)
    chats = [make_request([5, 6, 7], max_tokens=400), make_request([8, 9, 10], max_tokens=400)]
    sched.submit(*chats)
    device.advance(0.0)
    device.advance(STEP_S)
    assert all(c.status is RequestStatus.DECODING for c in chats)
    sched.submit(*neighbours)
    prompt = compressed_request(list(range(1, 41)))
    sched.submit(prompt)
    engine._hand_off()
    assert fake.jobs and prompt.status is RequestStatus.COMPRESSING
    pacing = Pacing(fake.neighbours[0], started=device.now, bound_s=BOUND_S, duty=DUTY, clock=lambda: device.now)
    return device, pacing, (chats, prompt, fake)


def test_a_draft_beside_decoding_and_queued_requests_never_steps_aside(harness):
    """Two slots decode and a chat is queued for a slot: no request that holds a slot awaits a
    first token, so the draft only shares the device (its duty cycle) and ends well within the
    bound; with queued requests counted as waiting it stepped aside for the whole bound."""
    queued = make_request([11, 12], max_tokens=2)
    device, pacing, (chats, _, _) = serve_beside(harness, 2, [queued])
    started = device.now
    ended = device.draft(pacing)
    assert queued.status is RequestStatus.WAITING and all(c.status is RequestStatus.DECODING for c in chats)
    assert ended - started <= CHUNKS * CHUNK_S / DUTY + 0.05 < BOUND_S


def test_a_draft_beside_decoding_and_a_long_prefill_ends_within_the_bound(harness):
    """Two slots decode and a long prompt prefills (it awaits its first token for many seconds):
    the draft steps aside until its bound, then runs alone, so it ends by the bound plus its own
    time; back from compression, the prompt gets its first token within two steps."""
    long = make_request(list(range(100, 900)), max_tokens=2)
    device, pacing, (chats, prompt, fake) = serve_beside(harness, 4, [long], check_every_step=False)
    started = device.now
    ended = device.draft(pacing)
    assert long.status is RequestStatus.PREFILLING, "the long prompt still prefills: the draft was held back"
    assert BOUND_S <= ended - started <= BOUND_S + CHUNKS * CHUNK_S + 0.05
    fake.deliver(0, list(range(33, 41)))
    device.engine._drain_inbox()  # the engine thread's part: the Compressed message resumes it
    assert prompt.status is RequestStatus.WAITING
    steps = device.steps
    while prompt.timings.first_token is None:
        device.advance(STEP_S)
        assert device.steps - steps <= 2, "the compressed prompt did not start at once"
    assert all(c.status is RequestStatus.DECODING for c in chats)


# ---- admission within a round -------------------------------------------------------------------
def test_submissions_of_a_round_go_shortest_first_other_messages_stay_between():
    messages = [("s", 900), ("s", 20), ("cancel", None), ("s", 500), ("s", 30), ("s", 30)]
    order = arrival_order(messages, lambda m: m[1])
    assert order == [("s", 20), ("s", 900), ("cancel", None), ("s", 30), ("s", 30), ("s", 500)]


def test_short_prompts_arriving_with_long_ones_take_the_free_slots(harness):
    """Four requests reach the engine in one round, the long ones first, two slots free: the two
    short ones get the slots (in arrival order the long ones would hold them for their prefill)."""
    engine, sched, runner = harness(start=False, n_slots=2, n_pages=256, max_batch_tokens=64, max_ctx=1024)
    longs = [make_request(list(range(1, 601)), max_tokens=2) for _ in range(2)]
    shorts = [make_request([900 + i, 901, 902], max_tokens=2) for i in range(2)]
    for request in (*longs, *shorts):
        engine.submit(request)
    engine._round()
    assert {r.request_id for r in sched.running} == {r.request_id for r in shorts}
    assert all(r.status is RequestStatus.WAITING for r in longs)
