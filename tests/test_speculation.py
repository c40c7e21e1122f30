"""Speculative decoding in the batched engine (issue 47) on real llama.cpp contexts: greedy text the
same with and without prompt lookup, alone and beside rows that do not speculate (turned off, a
grammar, a seed); rejected drafts leave no KV cells; the prefix cache stays exact; stop strings and
max_tokens end a run of accepted tokens where they fall."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pflash_plugin.engine.engine import Engine
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.llama import Model
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.engine.speculation.setup import PROMPT_LOOKUP, SpeculationConfig
from test_engine_real import run_texts
from test_speculation_policy import free

COPY = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. Every cloud has a silver "
        "lining. ") * 3 + "The same text, word for word:"
PROMPTS = [COPY, "hello world hello world hello", "1 2 3 4 5 1 2 3 4 5 1 2", "one two three four one two"]
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def config(speculate: bool, slots: int = 4) -> EngineConfig:
    return EngineConfig(n_slots=slots, max_ctx=512, n_threads=1, n_threads_batch=1,
                        speculation=SpeculationConfig(PROMPT_LOOKUP) if speculate else None)


def load(path: Path, speculate: bool) -> tuple[Model, Engine]:
    """The engine, every step of it free to draft (the budget would stop drafts that do not pay
    after a probe: the equality is tested with drafts kept and rejected)."""
    model, engine = load_engine(path, config(speculate))
    if engine.scheduler.steps.speculation is not None:
        engine.scheduler.steps.speculation.policy.budget = free()
    return model, engine


def outcomes(path: Path, speculate: bool, params: list[SamplingParams], prompts: list[str] = PROMPTS):
    """Each request's (text, finish reason, tokens), all submitted together; the engine's stats."""
    model, engine = load(path, speculate)
    try:
        requests = [Request(model.tokenize(p), q) for p, q in zip(prompts, params)]
        texts = run_texts(engine, requests)
        return [(*t, r.output_tokens) for t, r in zip(texts, requests)], engine.stats().speculation
    finally:
        engine.stop()


def test_greedy_text_is_the_same_alone_and_beside_rows_that_do_not_speculate(tiny_model):
    """Speculating greedy rows (a copy, repetitions) beside one turned off, one with a grammar and
    one seeded: every greedy row's text is the one it gives without speculation, and so is the
    grammar's and the seeded row's that does not speculate; drafts were made and some kept."""
    grammar = dataclasses.replace(GREEDY, grammar='root ::= ("ab" | "cd")+ " "')
    seeded = SamplingParams(max_tokens=40, temperature=0.9, seed=11, speculative=False)
    mixed = [GREEDY, dataclasses.replace(GREEDY, speculative=False), grammar, seeded]
    for params in ([GREEDY], mixed, [GREEDY] * 4):
        prompts = PROMPTS[:len(params)]
        plain, none = outcomes(tiny_model, False, params, prompts)
        fast, stats = outcomes(tiny_model, True, params, prompts)
        assert none is None and fast == plain
        assert stats.accepted > 0 and stats.tokens > stats.rows  # more than a token a step
    assert stats.drafted > stats.accepted  # some were rejected (and their cells removed)


def test_seeded_sampled_rows_give_the_tokens_they_give_without_speculation(tiny_model):
    """A seeded sampled row speculates (acceptance.py: one-hot drafts kept while they equal the
    row's own draw) and gives the tokens its seed gives without speculation, beside a greedy row."""
    seeded = SamplingParams(max_tokens=40, temperature=0.7, seed=5)
    plain, _ = outcomes(tiny_model, False, [seeded, GREEDY], [PROMPTS[1], COPY])
    fast, stats = outcomes(tiny_model, True, [seeded, GREEDY], [PROMPTS[1], COPY])
    assert fast == plain and stats.accepted > 0


def test_rejected_drafts_leave_no_kv_cells_and_the_prefix_cache_stays_exact(tiny_model):
    """After speculating steps each slot's KV ends where its tokens say (seq_pos_max + 1 ==
    len(tokens)); a follow-up prompt that extends the first prompt and answer reuses those cells and
    continues exactly as an engine that never speculated."""
    follow = []
    for speculate in (False, True):
        model, engine = load(tiny_model, speculate)
        try:
            firsts = [Request(model.tokenize(p), GREEDY) for p in PROMPTS]
            run_texts(engine, firsts)
            first = firsts[0]
            if speculate:
                spec = engine.stats().speculation
                assert spec.drafted > spec.accepted > 0
                for slot in engine.scheduler.slots:
                    assert engine.runner.ctx.memory.seq_pos_max(slot.index) + 1 == len(slot.tokens)
            second = Request(first.prefill_tokens + first.output_tokens + model.tokenize(" again:"), GREEDY)
            run_texts(engine, [second])
            assert second.cached_tokens >= len(first.prefill_tokens) + len(first.output_tokens) - 1
            follow.append(second.output_tokens)
        finally:
            engine.stop()
    assert follow[0] == follow[1]


def test_stop_strings_and_max_tokens_end_a_run_of_accepted_drafts(tiny_model):
    """A stop string or max_tokens that falls inside a run of accepted drafts ends the request
    there: the same text, finish reason and token count as without speculation."""
    plain, _ = outcomes(tiny_model, False, [GREEDY])
    text = plain[0][0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = [dataclasses.replace(GREEDY, stop=[stop]), dataclasses.replace(GREEDY, max_tokens=13),
              dataclasses.replace(GREEDY, max_tokens=3)]
    prompts = [COPY, COPY, COPY]
    without, _ = outcomes(tiny_model, False, params, prompts)
    with_, stats = outcomes(tiny_model, True, params, prompts)
    assert with_ == without and stats.accepted > 0
    assert without[0][1] == "stop" and len(without[1][2]) == 13 and len(without[2][2]) == 3


@pytest.mark.demo
def test_demo_model_greedy_text_is_the_same(demo_model):
    """The demo model (262K vocabulary, sliding-window layers): greedy rows give the same text with
    prompt lookup, alone and four at once with one turned off."""
    for params in ([GREEDY], [GREEDY, dataclasses.replace(GREEDY, speculative=False), GREEDY, GREEDY]):
        prompts = PROMPTS[:len(params)]
        plain, _ = outcomes(demo_model, False, params, prompts)
        fast, stats = outcomes(demo_model, True, params, prompts)
        assert fast == plain and stats.accepted > 0
