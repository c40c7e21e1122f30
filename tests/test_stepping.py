"""engine/stepping.py over the mock runner (no thread, no model): where a step's text goes out
relative to the next decode, preemption for a newcomer, and the step count."""
from __future__ import annotations

from pflash_plugin.engine.failures import Failures
from pflash_plugin.engine.published import Published
from pflash_plugin.engine.stepping import Stepping
from pflash_plugin.llama import DecodeError
from tests.mock_runner import check_scheduler, default_piece, make_request, make_scheduler, sink_of


def default_text(tokens: list[int]) -> str:
    return b"".join(default_piece(t) for t in tokens).decode()


def setup(overlaps: bool, **kw):
    sched, runner = make_scheduler(n_slots=2, **kw)
    runner.overlaps = overlaps
    failures = Failures(sched, "test")
    return sched, runner, failures, Stepping(sched, runner, failures, Published(sched))


def test_overlapped_a_step_s_text_goes_out_beside_the_next_decode_and_a_first_token_s_before_it():
    """Between the next launch and its collect (the GPU's order): never before that launch; but a
    request's first token goes out before the next launch (its client waits for nothing else)."""
    sched, runner, _, stepping = setup(overlaps=True)
    request = make_request([1, 2, 3], max_tokens=4)
    runner.scripts[request.request_id] = [10, 11, 12, 13]
    sched.submit(request)
    seen_at_launch: list[str] = []
    runner.hook = lambda index, step: seen_at_launch.append(sink_of(request).text)
    for _ in range(3):
        stepping.run(sched.schedule())
    # the prompt's step samples 10: out before the second launch; 11 (the second step's) is out
    # during the third launch, not before it
    assert seen_at_launch == ["", default_text([10]), default_text([10])]
    assert sink_of(request).text == default_text([10, 11])
    assert stepping.count == 3


def test_overlapped_a_first_token_goes_out_before_the_launch_and_the_others_beside_it():
    """Of two running requests, the one whose first token the last step sampled has its text out
    before the next launch; the other's text (a later token) still waits for the launch."""
    sched, runner, _, stepping = setup(overlaps=True)
    old = make_request([1, 2, 3], max_tokens=8)
    runner.scripts[old.request_id] = [10, 11, 12, 13, 14, 15, 16, 17]
    sched.submit(old)
    stepping.run(sched.schedule())
    stepping.run(sched.schedule())  # old's first token (10) went out before this launch
    new = make_request([4, 5], max_tokens=4)
    runner.scripts[new.request_id] = [20, 21, 22, 23]
    sched.submit(new)
    stepping.run(sched.schedule())  # new's prompt and old's third row: samples 20 and 12
    seen_at_launch: list[tuple[str, str]] = []
    runner.hook = lambda index, step: seen_at_launch.append((sink_of(old).text, sink_of(new).text))
    stepping.run(sched.schedule())
    assert seen_at_launch == [(default_text([10, 11]), default_text([20]))]
    assert sink_of(old).text == default_text([10, 11, 12])


def test_not_overlapped_a_step_s_text_waits_in_the_outbox_for_the_engine_s_emit():
    sched, runner, _, stepping = setup(overlaps=False)
    request = make_request([1, 2, 3], max_tokens=4)
    runner.scripts[request.request_id] = [10, 11, 12, 13]
    sched.submit(request)
    stepping.run(sched.schedule())
    assert sched.outbox and sink_of(request).text == ""
    sched.emit()
    assert sink_of(request).text == default_text([10])


def test_a_preemptible_step_aborted_for_a_newcomer_is_rolled_back_without_counting_an_abort():
    sched, runner, failures, stepping = setup(overlaps=False, max_batch_tokens=64, preempt_chunk=8, per_slot=True)
    long = make_request(list(range(1, 41)), max_tokens=2)
    sched.submit(long)
    step = sched.schedule()
    assert sched.steps.preemptible(step)
    runner.fail_steps[1] = (DecodeError(2), False)
    stepping.arrival.set()  # a newcomer arrived while the step ran
    stepping.run(step)
    assert failures.aborts == 0 and long.status.running and long.n_prefilled == 0
    assert stepping.count == 1


def test_an_abort_without_a_newcomer_counts_toward_the_failures():
    sched, runner, failures, stepping = setup(overlaps=False, max_batch_tokens=64, preempt_chunk=8, per_slot=True)
    long = make_request(list(range(1, 41)), max_tokens=2)
    sched.submit(long)
    runner.fail_steps[1] = (DecodeError(2), False)
    stepping.run(sched.schedule())
    assert failures.aborts == 1 and long.status.running


def test_a_cut_step_keeps_what_its_computed_ubatches_wrote_of_a_prompt_under_way_and_redoes_the_rest():
    """llama.cpp keeps the cells of the ubatches computed before the abort: those of the chunk of a
    prompt that had prefilled into its slot stay prefilled; a prompt's first chunk (it may still
    lend its slot to the newcomer) and a decode row (its token was not sampled) are redone."""
    sched, runner = make_scheduler(n_slots=3, n_pages=64, max_batch_tokens=64, max_ctx=128, preempt_chunk=8,
                                   per_slot=True)
    failures = Failures(sched, "test")
    stepping = Stepping(sched, runner, failures, Published(sched))
    chat = make_request([900, 901, 902], max_tokens=4)
    sched.submit(chat)
    stepping.run(sched.schedule())
    long = make_request(list(range(1, 101)), max_tokens=2)
    sched.submit(long)
    stepping.run(sched.schedule())  # chat's row and 63 of long's tokens
    short = make_request(list(range(200, 210)), max_tokens=2)
    sched.submit(short)
    step = sched.schedule()
    assert sorted(len(item.tokens) for item in step.items) == [1, 10, 37] and sched.steps.preemptible(step)

    def cut(step):  # the ubatches before the abort wrote chat's row, all of short's, 12 of long's
        for item in step.items:
            runner._write(item.request.slot, item.tokens[:12], item.start_pos)
        raise DecodeError(2)

    runner.execute, plain = cut, runner.execute
    newcomer = make_request([5, 6, 7], max_tokens=2)
    stepping.arrived([newcomer])  # a newcomer whose prompt fits a step, while every slot is held
    stepping.run(step)
    runner.execute = plain
    assert failures.aborts == 0 and (long.n_prefilled, short.n_prefilled) == (75, 0)
    assert len(chat.output_tokens) == 2 and len(sched.slots[chat.slot].tokens) == 4
    check_scheduler(sched, runner)  # the KV holds exactly what the slots say
    stepping.arrival.clear()
    sched.submit(newcomer)
    while sched.has_work:
        stepping.run(sched.schedule())
    assert len(long.output_tokens) == len(short.output_tokens) == len(newcomer.output_tokens) == 2
    assert len(chat.output_tokens) == 4
    assert [item.start_pos for item in runner.items_of(long.request_id)] == [0, 75, 100]  # resumed past the kept 12
    check_scheduler(sched, runner)


def test_only_a_newcomer_whose_prompt_fits_a_step_signals_an_arrival():
    _, _, _, stepping = setup(overlaps=False, max_batch_tokens=64, preempt_chunk=8)
    stepping.arrived([make_request(list(range(1, 66)))])
    assert not stepping.arrival.is_set()  # 65 tokens: it would wait for the prompts ahead anyway
    stepping.arrived([make_request(list(range(1, 66))), make_request([1, 2])])
    assert stepping.arrival.is_set()
