"""Sampling through a real engine: seeds repeat alone and in a batch, mixed batches give each row
what it gets alone, and the device path (llama.cpp's backend sampling, here on the CPU backend)
gives the host path's greedy tokens."""
from __future__ import annotations

import threading

import pytest

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import ErrorEvent, FinishEvent, Request, SamplingParams

GRAMMAR = 'root ::= "the " [a-z]+ " " [a-z]+'
SEEDED = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, top_p=0.9, min_p=0.02, seed=1234)


def run(engine, model, work: list[tuple[str, SamplingParams]], timeout: float = 120) -> list[list[int]]:
    """Submit all requests at once (admitted in one step); their tokens, in order."""
    requests = [Request(model.tokenize(prompt), params) for prompt, params in work]
    done, errors = threading.Semaphore(0), []

    def sink(event) -> None:
        if isinstance(event, ErrorEvent):
            errors.append(event.message)
        if isinstance(event, (FinishEvent, ErrorEvent)):
            done.release()

    for request in requests:
        request.sink = sink
    engine.submit(*requests)
    for _ in requests:
        assert done.acquire(timeout=timeout), "request did not finish"
    assert not errors
    return [r.output_tokens for r in requests]


@pytest.fixture(params=["off", "on"], ids=["host", "device"])
def engine(request, tiny_model):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=16, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                         backend_sampling=request.param))
    assert engine.runner.sampling.device == {"on": "all", "off": "none"}[request.param]
    yield model, engine
    engine.stop()


def test_a_seeded_request_repeats_alone_and_inside_a_batch(engine):
    model, engine = engine
    alone = run(engine, model, [("a seeded prompt", SEEDED)])[0]
    assert run(engine, model, [("a seeded prompt", SEEDED)])[0] == alone
    others = [(f"other prompt {i}", SamplingParams(max_tokens=20, temperature=1.0, seed=i if i % 2 else None))
              for i in range(15)]
    together = run(engine, model, others[:7] + [("a seeded prompt", SEEDED)] + others[7:])
    assert together[7] == alone
    assert len(set(map(tuple, together))) == 16  # the others drew their own tokens


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(engine):
    """Grammar (llama.cpp's chain on the host), seeded, greedy, penalized and min_tokens rows in one
    batch; on the device engine every row but the grammar's is sampled inside the decode."""
    model, engine = engine
    work = [("grammar", SamplingParams(max_tokens=12, temperature=0.0, grammar=GRAMMAR)),
            ("seeded", SEEDED),
            ("greedy", SamplingParams(max_tokens=20, temperature=0.0)),
            ("penalized", SamplingParams(max_tokens=20, temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.2,
                                         presence_penalty=0.3)),
            ("sampled and penalized", SamplingParams(max_tokens=20, temperature=0.9, seed=77, presence_penalty=0.5,
                                                     logit_bias={5: 2.0})),
            ("held", SamplingParams(max_tokens=20, temperature=0.0, min_tokens=20))]
    alone = [run(engine, model, [item])[0] for item in work]
    assert run(engine, model, work) == alone
    assert model.detokenize(alone[0]).startswith("the ")


def test_device_greedy_tokens_equal_the_host_s(tiny_model):
    """Greedy rows with penalties, a logit bias and min_tokens (whose end swaps the device chain)."""
    work = [(f"prompt {i} about the weather", SamplingParams(max_tokens=24, temperature=0.0, min_tokens=6 * (i % 2),
                                                             repeat_penalty=1.0 + 0.3 * (i % 2), logit_bias={9: 0.5}))
            for i in range(4)]
    outputs = {}
    for setting in ("off", "on"):
        model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                             backend_sampling=setting, penalty_last_n=8))
        try:
            outputs[setting] = run(engine, model, work)
        finally:
            engine.stop()
    assert outputs["on"] == outputs["off"]
    assert max(len(set(tokens)) for tokens in outputs["on"]) > 2  # the penalties moved the tiny model off its loop


@pytest.mark.demo
def test_device_greedy_tokens_equal_the_host_s_on_the_demo_model(demo_model):
    work = [(p, SamplingParams(max_tokens=16, temperature=0.0)) for p in
            ("The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are")]
    outputs = {}
    for setting in ("off", "on"):
        model, engine = load_engine(demo_model, EngineConfig(n_slots=4, max_ctx=512, backend_sampling=setting))
        try:
            outputs[setting] = run(engine, model, work)
        finally:
            engine.stop()
    assert outputs["on"] == outputs["off"]


def test_the_end_of_generation_tokens_are_found_when_the_engine_is_built(engine):
    """One pass over the vocabulary (90 ms at 262K tokens), made as the engine is built, not on the
    engine thread when a request first holds end-of-generation back (min_tokens, ignore_eos)."""
    model, _ = engine
    assert "eog_tokens" in vars(model)  # functools.cached_property: computed already
    assert model.eog_tokens == [t for t in range(model.n_vocab) if model.is_eog(t)] and model.eog_tokens


def test_end_of_generation_waits_for_min_tokens_in_each_row_of_a_step(engine):
    """Every row's logits favour the end-of-generation token (a bias of +50): rows short of their
    min_tokens get exactly that many tokens, the others end at once, whichever rows share a step."""
    model, engine = engine
    eog = next(t for t in range(model.n_vocab) if model.is_eog(t))
    minimums = [0, 3, 0, 7, 5, 0, 1, 4]
    work = [(f"prompt {i}", SamplingParams(max_tokens=12, temperature=0.0, min_tokens=m, logit_bias={eog: 50.0}))
            for i, m in enumerate(minimums)]
    assert [len(tokens) for tokens in run(engine, model, work)] == minimums


def test_a_greedy_grammar_row_asks_the_grammar_about_one_token_and_gets_the_same_tokens(tiny_model, monkeypatch):
    """Greedy with a grammar: where the row's argmax is allowed it is the answer, so the grammar is
    asked about that token alone; the tokens equal those of the pass over the whole vocabulary."""
    from pflash_plugin.llama.sampler import SamplerChain

    loose = 'root ::= [^\\x00]+'  # allows nearly every token: the argmax mostly passes
    work = [(f"prompt {i}", SamplingParams(max_tokens=16, temperature=0.0, grammar=g, repeat_penalty=1.2))
            for i, g in enumerate([GRAMMAR, loose, loose])]
    check = SamplerChain._greedy_allowed
    served: list[int] = []

    def counted(self, logits):
        token = check(self, logits)
        served.append(token >= 0)
        return token

    model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=256, n_threads=1, n_threads_batch=1))
    try:
        monkeypatch.setattr(SamplerChain, "_greedy_allowed", counted)
        fast = run(engine, model, work)
        monkeypatch.setattr(SamplerChain, "_greedy_allowed", lambda self, logits: -1)  # always the whole pass
        assert run(engine, model, work) == fast
    finally:
        engine.stop()
    assert sum(served) >= len(served) // 2 and not all(served), served
    assert model.detokenize(fast[0]).startswith("the ")


def test_the_grammar_pass_over_the_vocabulary_is_split_over_threads_with_the_same_verdict(tiny_model, monkeypatch):
    """The whole-vocabulary grammar check runs as slices on the pass's threads, which together
    cover every token once, and allow exactly the tokens one pass over the whole array allows."""
    import llama_cpp.llama_cpp as C

    from pflash_plugin.llama import Model, SamplerParams
    from pflash_plugin.llama import sampler as S

    model = Model(tiny_model)
    chain = S.SamplerChain(model, SamplerParams(temperature=0.0, grammar=GRAMMAR))
    try:
        whole, _ = chain._allowed(1)
        calls: list[tuple[str, int]] = []
        apply = C.llama_sampler_apply

        def recorded(sampler, array):
            calls.append((threading.current_thread().name, array._obj.size))
            return apply(sampler, array)

        monkeypatch.setattr(S._GrammarPass, "MIN_PART", 64)
        monkeypatch.setattr(C, "llama_sampler_apply", recorded)
        split, pooled = chain._allowed(4)
    finally:
        chain.close()
    assert whole.sum() > 0 and (split == whole).all()
    assert len(calls) == 4 and sum(size for _, size in calls) == model.n_vocab
    assert all(name.startswith("grammar") for name, _ in calls)
    assert pooled >= 0.0  # the pool's threads' CPU seconds, counted against the guard (issue 49)
