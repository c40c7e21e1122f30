"""The reasoning budget in the engine (engine/reasoning_budget.py): past its tokens, a request still
thinking takes the closing tag's tokens in place of what it sampled, one a step, and the next decode
row carries them; a block the model closed itself, or no budget, changes nothing. On the mock
runner, whose pieces are scripted."""
from __future__ import annotations

from pflash_plugin.engine.reasoning_budget import ReasoningBudget
from pflash_plugin.engine.request import Request, SamplingParams

from mock_runner import EOG, Collector, default_piece, make_scheduler, run_until_idle, sink_of

CLOSE, BLANK = 90, 91
PIECES = {CLOSE: b"</think>", BLANK: b"\n\n", 92: b"</thi", 93: b"nk>"}
BUDGET = ReasoningBudget(tokens=3, close="</think>", close_tokens=(CLOSE, BLANK))


def piece(token: int) -> bytes:
    return PIECES.get(token, default_piece(token))


def run(script: list[int], budget: ReasoningBudget | None, n: int = 1) -> tuple[list[Request], object]:
    sched, runner = make_scheduler(piece=piece, n_slots=2)
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=12, reasoning_budget=budget), sink=Collector())
                for _ in range(n)]
    for request in requests:
        runner.scripts[request.request_id] = list(script)
        sched.add(request)
    run_until_idle(sched, runner)
    return requests, runner


def test_past_its_budget_the_closing_tag_replaces_the_sampled_tokens_and_is_decoded_next():
    (request,), runner = run([10, 11, 12, 13, 14, 15, 16, EOG], BUDGET)
    assert request.output_tokens == [10, 11, 12, CLOSE, BLANK, 15, 16]
    assert sink_of(request).text == "<10><11><12></think>\n\n<15><16>"
    fed = [item.tokens for step in runner.steps for item in step.items if item.request_id == request.request_id]
    assert (CLOSE,) in fed and (BLANK,) in fed  # the model reads the tag it did not write


def test_a_block_the_model_closes_itself_in_time_is_left_alone():
    script = [10, 92, 93, 13, 14, 15, EOG]  # "</think>" across two tokens, within the budget
    (request,), _ = run(script, BUDGET)
    assert request.output_tokens == script[:-1]


def test_without_a_budget_or_with_budget_zero():
    (plain,), _ = run([10, 11, 12, 13, 14, EOG], None)
    assert plain.output_tokens == [10, 11, 12, 13, 14]
    (closed,), _ = run([10, 11, 12, EOG], ReasoningBudget(0, "</think>", (CLOSE, BLANK)))
    assert closed.output_tokens == [CLOSE, BLANK, 12]


def test_each_request_keeps_its_own_budget():
    requests, _ = run([10, 11, 12, 13, 14, 15, EOG], BUDGET, 2)
    assert [r.output_tokens for r in requests] == [[10, 11, 12, CLOSE, BLANK, 15]] * 2
    assert requests[0].thinking is not requests[1].thinking
