"""engine/steps.py's steady decode steps (Steps.steady: wherever each slot has a KV stream): filler
rows in idle slots keep a decode step's slots one run, and its shape while rows end, so llama.cpp
decodes the step as one ubatch on the graph it built before; the fillers' writes are dropped, the
real rows' tokens are those of steps without fillers."""
from __future__ import annotations

import random

from pflash_plugin.engine.failures import Failures
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.published import Published
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.engine.stepping import Stepping
from tests.mock_runner import Collector, check_scheduler, make_request, make_scheduler, wait_done


def slot_runs(slots: list[int]) -> int:
    """Runs of consecutive slots: llama.cpp's ubatches of a decode step with a KV stream per slot."""
    slots = sorted(slots)
    return 1 + sum(b != a + 1 for a, b in zip(slots, slots[1:]))


def decode_steps(steady: bool, lengths: list[int], filler_logits: bool = True
                 ) -> tuple[list[list[tuple[int, bool]]], list[list[int]]]:
    """Requests of these lengths, one per slot, stepped to the end over the mock runner: each
    decode step's (slot, filler) rows, and each request's tokens. The KV is checked after every step."""
    sched, runner = make_scheduler(n_slots=len(lengths), per_slot=True, n_pages=8, page_size=4,
                                   max_batch_tokens=64, check_every_step=False)
    runner.require_active = False  # filler rows belong to no started request
    sched.steps.steady, sched.steps.filler_logits = steady, filler_logits
    requests = [make_request([1 + i, 2 + i, 3 + i], max_tokens=n) for i, n in enumerate(lengths)]
    sched.submit(*requests)
    seen = []
    while sched.has_work:
        step = sched.schedule()
        sched.update(step, runner.execute(step))
        sched.emit()
        check_scheduler(sched, runner)  # every filler's write dropped: each slot's KV is its tokens
        if all(len(item.tokens) == 1 for item in step.items):
            seen.append([(item.request.held_slot, item.filler) for item in step.items])
            assert all(item.wants_logits == (filler_logits or not item.filler) for item in step.items)
    return seen, [r.output_tokens for r in requests]


def test_a_decode_step_keeps_its_slots_one_run_while_rows_end_and_its_tokens():
    lengths = [8, 2, 4, 8, 3, 3]  # slots 1, 4, 5 and 2 end first: holes among the rows still decoding
    plain, plain_tokens = decode_steps(False, lengths)
    steady, steady_tokens = decode_steps(True, lengths)
    assert steady_tokens == plain_tokens
    assert max(slot_runs([slot for slot, _ in rows]) for rows in plain) > 1  # without fillers: several ubatches
    for rows in steady:
        real = [slot for slot, filler in rows if not filler]
        if 2 * len(real) >= len(lengths):  # half or more of the shape real: all six slots, one run
            assert sorted(slot for slot, _ in rows) == list(range(len(lengths)))
        assert all(filler == (slot not in real) for slot, filler in rows)
    # once 2 of the 6 decode (slots 0 and 3), the shape is let go for the run between them
    assert steady[-1] == [(0, False), (1, True), (2, True), (3, False)]


def test_on_the_cpu_the_fillers_ask_for_no_logits_and_the_steps_and_tokens_stay_the_same():
    """Steps.filler_logits False (the CPU's: a filler's logits would cost its row of the output
    projection, 8 ms at a 262K vocabulary): the same rows and tokens, no filler asks for logits."""
    lengths = [8, 2, 4, 8, 3, 3]
    assert decode_steps(True, lengths, filler_logits=False) == decode_steps(True, lengths)


def test_decode_step_fillers_never_take_a_slot_a_request_holds_and_a_new_request_reuses_a_filled_slot_exactly():
    """Pure decode steps (a mixed step may fill a held slot sitting the step out: tests/test_media_steps.py)."""
    sched, runner = make_scheduler(n_slots=3, per_slot=True, n_pages=8, page_size=4, max_batch_tokens=64,
                                   check_every_step=False)
    runner.require_active = False
    sched.steps.steady = True
    first = [make_request([1, 2, 3], max_tokens=6), make_request([4, 5, 6], max_tokens=2),
             make_request([7, 8, 9], max_tokens=6)]
    sched.submit(*first)
    late = None
    for index in range(12):
        step = sched.schedule()
        for item in step.items:
            if item.filler:
                assert sched.slots[item.request.held_slot].request is None
        sched.update(step, runner.execute(step))
        sched.emit()
        check_scheduler(sched, runner)
        if index == 4:  # slot 1 has held fillers: a request with its prefix takes it in place
            late = make_request([4, 5, 6, 7], max_tokens=3)
            sched.submit(late)
        if not sched.has_work:
            break
    assert late is not None and late.finish_reason == "length" and len(late.output_tokens) == 3
    ours = {r.request_id for r in [*first, late]}
    assert any(item.slot == 1 and item.request_id not in ours for record in runner.steps for item in record.items)


def test_filler_rows_on_a_real_model_leave_every_token_and_the_kv_as_they_were(tiny_model):
    """Seeded rows of different lengths: the same tokens with fillers as without, llama.cpp reusing
    its graph on more steps with them, and every slot's KV exactly its tokens afterwards."""
    runs = {}
    for steady in (False, True):
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=6, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                             steady_decode=steady))
        try:
            assert engine.scheduler.cache.per_slot
            rng = random.Random(3)
            requests = [Request([rng.randrange(1, 200) for _ in range(8)],
                                SamplingParams(max_tokens=n, min_tokens=n, temperature=0.8, seed=i), sink=Collector())
                        for i, n in enumerate([12, 3, 6, 12, 4, 12])]
            ctx = engine.runner.ctx
            reused = ctx.graph_reuses()
            engine.submit(*requests)  # in one message: admitted in the same step
            wait_done(*requests, timeout=120)
            tokens = [r.output_tokens for r in requests]
            reused = ctx.graph_reuses() - reused
            engine.stop()
            for slot in engine.scheduler.slots:
                assert ctx.memory.seq_pos_max(slot.index) + 1 == len(slot.tokens)
            runs[steady] = tokens, reused
        finally:
            engine.close()
            model.close()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > runs[False][1]


def test_a_step_that_fails_after_its_write_drops_its_fillers_cells_too():
    """The failed requests' KV is forgotten (Failures.fail_step); a filler's cell goes as well, so
    the idle slot's prefix cache stays exact."""
    sched, runner = make_scheduler(n_slots=3, per_slot=True, n_pages=8, page_size=4, max_batch_tokens=64,
                                   check_every_step=False)
    runner.require_active = False
    sched.steps.steady = True
    failures = Failures(sched, "test")
    stepping = Stepping(sched, runner, failures, Published(sched))
    sched.submit(make_request([1, 2, 3], max_tokens=6), make_request([4, 5, 6], max_tokens=1),
                 make_request([7, 8, 9], max_tokens=6))
    stepping.run(sched.schedule())  # the prompts: slot 1's request ends with its first token
    step = sched.schedule()
    assert [(item.request.held_slot, item.filler) for item in step.items] == [(0, False), (1, True), (2, False)]
    runner.fail_steps[len(runner.steps) + 1] = (RuntimeError("the device is gone"), True)  # after writing
    stepping.run(step)
    assert not sched.running
    check_scheduler(sched, runner)


def test_the_flag_sets_the_engine_s_steady_steps_and_auto_keeps_them_with_logit_free_fillers_on_the_cpu(tiny_model):
    """--steady_decode on/off/auto becomes EngineConfig.steady_decode True/False/None; None (auto) is
    on wherever each slot has a KV stream; on the CPU its filler rows ask for no logits (each would cost
    its row of the output projection), on a GPU they do (the step keeps its outputs and its graph)."""
    from pflash_plugin.llama import ModelParams
    from pflash_plugin.server.config.llama_params import engine_config
    from pflash_plugin.server.config.settings import ModelSettings

    chosen = {value: engine_config(ModelSettings(model=str(tiny_model), steady_decode=value), ModelParams(),
                                   256).steady_decode for value in ("on", "off", "auto")}
    assert chosen == {"on": True, "off": False, "auto": None}
    for value, steady in ((None, True), (True, True), (False, False)):
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=2, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                             steady_decode=value))
        try:
            assert engine.scheduler.steps.steady is steady
            assert engine.scheduler.steps.filler_logits is False  # no GPU here
        finally:
            engine.stop()
            engine.close()
            model.close()
