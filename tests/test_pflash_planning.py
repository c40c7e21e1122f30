"""Per-request PFlash planning (pflash/planning.py): a job, or a report of why not, or neither."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pflash_plugin.pflash.compressor import PflashConfig
from pflash_plugin.pflash.planning import MAX_EXPLICIT_QUERY, NOT_ENABLED, Planner, PlanError, PromptFacts
from pflash_plugin.pflash.report import MANDATORY_OVER_BUDGET


class WordModel:
    """One token per word: token i is the piece b" w<i>"; `tokenize` counts the words."""

    def piece(self, token: int) -> bytes:
        return f" w{token}".encode()

    def pieces(self, tokens: list[int]) -> list[bytes]:
        return [self.piece(t) if t >= 0 else b"" for t in tokens]

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(range(len(text.split())))


def planner(enabled: bool = True, **config) -> Planner:
    return Planner(PflashConfig(**{"mode": "auto", "threshold": 100, "keep_ratio": 0.25, **config}),
                   WordModel(), enabled)  # type: ignore[arg-type]


def ask(mode=None, keep_ratio=None, query=None):
    return SimpleNamespace(mode=mode, keep_ratio=keep_ratio, query=query)


PROMPT = list(range(400))


def test_a_long_prompt_gets_a_job_with_its_keep_ratio():
    plan = planner().plan(PROMPT, ask(keep_ratio=0.5))
    assert plan.report is None and plan.job is not None
    assert plan.job.tokens == PROMPT and plan.job.keep_ratio == 0.5


def test_off_and_not_asked_reports_nothing():
    plan = planner(mode="off").plan(PROMPT, None)
    assert plan.job is None and plan.report is None


@pytest.mark.parametrize(("kw", "tokens", "facts", "reason"), [
    ({}, PROMPT[:50], PromptFacts(), "not over the threshold"),
    ({}, PROMPT, PromptFacts(has_tools=True), "tools or a JSON response format"),
    ({"enabled": False}, PROMPT, PromptFacts(), NOT_ENABLED),
    ({"segment_min": 200}, PROMPT, PromptFacts(), MANDATORY_OVER_BUDGET),  # a head of 200 > 100 kept
])
def test_skips_say_why(kw, tokens, facts, reason):
    plan = planner(**kw).plan(tokens, None, facts)
    assert plan.job is None and plan.report is not None
    assert plan.report.to_json() == {"status": "skipped", "reason": plan.report.reason, "original_tokens": len(tokens)}
    assert reason in plan.report.reason


@pytest.mark.parametrize(("tokens", "keep_ratio"), [(PROMPT[:1], None), (PROMPT[:1], 0.1), (PROMPT, 1.0)])
def test_a_budget_that_keeps_every_token_is_a_skip_not_a_draft(tokens, keep_ratio):
    """Issue 22: a 1-token prompt with mode always ran the drafter and reported a fallback; a keep
    ratio of 1.0 drafted the whole prompt (23 s against 22 s of plain prefill) to keep all of it."""
    plan = planner().plan(tokens, ask(mode="always", keep_ratio=keep_ratio))
    assert plan.job is None and plan.report is not None and plan.report.status == "skipped"
    assert f"keeps all {len(tokens)} tokens" in plan.report.reason


def test_an_explicit_query_over_the_limit_is_refused_naming_the_field():
    with pytest.raises(PlanError, match=f"over {MAX_EXPLICIT_QUERY} tokens") as error:
        planner().plan(PROMPT, ask(mode="always", query="word " * (MAX_EXPLICIT_QUERY + 1)))
    assert error.value.param == "pflash.query"
    job = planner().plan(PROMPT, ask(mode="always", query="when does it open")).job
    assert job is not None and job.plan.extra_query == (0, 1, 2, 3)


class CountingWordModel(WordModel):
    def __init__(self) -> None:
        self.read: list[int] = []

    def pieces(self, tokens: list[int]) -> list[bytes]:
        self.read.append(len(tokens))
        return super().pieces(tokens)


def test_pieces_are_read_only_to_find_a_chat_s_messages():
    """A completion's plan is the prompt's tail: its bytes are not read (~1 ms a 22K-token prompt
    on the request's thread); a chat's plan finds the last user message and the system prompt in them."""
    model = CountingWordModel()
    config = PflashConfig(mode="auto", threshold=100, keep_ratio=0.25, query_tokens=8)
    completion = Planner(config, model, True).plan(PROMPT, None).job  # type: ignore[arg-type]
    assert completion is not None and model.read == []
    assert (completion.plan.query_start, completion.plan.query_end) == (392, 400)
    facts = PromptFacts(last_user=" ".join(f"w{i}" for i in range(380, 396)),
                        system=" ".join(f"w{i}" for i in range(1, 21)))
    chat = Planner(config, model, True).plan(PROMPT, None, facts).job  # type: ignore[arg-type]
    assert chat is not None and model.read == [len(PROMPT)]
    assert (chat.plan.query_start, chat.plan.query_end, chat.plan.head_end) == (388, 396, 21)
