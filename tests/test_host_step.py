"""The host's work between decode steps (issue 48 item 5) keeps what the engine gives: plain greedy
rows are argmaxed without the batch path's per-row parameter arrays, and a sampled token reaches its
text event as the very object sampled (no copy per row and step)."""
from __future__ import annotations

import numpy as np
import pytest

from pflash_plugin.engine import batch_sampling
from pflash_plugin.engine.batch_sampling import RowParams, greedy_rows, sample_rows
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import Request, SamplingParams, TextEvent, TokenOutput
from pflash_plugin.llama import native
from tests.conftest import run_requests


@pytest.fixture
def engine(tiny_model):
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=8, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                         backend_sampling="off"))
    yield model, engine
    engine.stop()


def _tokens(model, engine, params: list[SamplingParams], first: int = 0) -> list[list[int]]:
    """Each request's tokens; request i's prompt names `first + i`."""
    requests = [Request(model.tokenize(f"prompt {first + i} about the weather"), p) for i, p in enumerate(params)]
    run_requests(engine, requests)
    return [r.output_tokens for r in requests]


def test_plain_greedy_rows_skip_the_row_parameters_and_keep_their_tokens(engine, monkeypatch):
    """A zero logit bias sends a greedy row through RowParams (bias, penalties, sample_rows); without
    one, the row is a bare argmax: the same tokens, and RowParams is never built for it."""
    model, engine = engine
    through_params = _tokens(model, engine, [SamplingParams(max_tokens=12, temperature=0.0, logit_bias={7: 0.0},
                                                            min_tokens=12) for _ in range(6)])

    def refuse(cls, entries):
        raise AssertionError("a plain greedy row built RowParams")

    monkeypatch.setattr(RowParams, "of", classmethod(refuse))
    plain = _tokens(model, engine, [SamplingParams(max_tokens=12, temperature=0.0, min_tokens=12) for _ in range(6)])
    assert plain == through_params
    assert all(len(tokens) == 12 for tokens in plain)


def test_a_greedy_row_beside_sampled_and_penalized_rows_keeps_its_tokens(engine):
    """A step mixing plain greedy rows with rows that need RowParams: each row gets what it gets alone."""
    model, engine = engine
    work = [SamplingParams(max_tokens=10, temperature=0.0, min_tokens=10),
            SamplingParams(max_tokens=10, temperature=0.9, seed=3, min_tokens=10),
            SamplingParams(max_tokens=10, temperature=0.0, repeat_penalty=1.3, min_tokens=10),
            SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, min_tokens=10)]
    together = _tokens(model, engine, work)
    assert together == [_tokens(model, engine, [p], first=i)[0] for i, p in enumerate(work)]


@pytest.mark.parametrize("built", [True, False], ids=["native", "numpy"])
def test_greedy_rows_is_sample_rows_for_greedy_rows(built, monkeypatch):
    """The first index of each row's max, None where it is NaN, as sample_rows gives greedy rows."""
    if not built:
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.load() is None:
        pytest.skip("the native sampler is not built")
    logits = np.random.default_rng(1).standard_normal((6, 300)).astype(np.float32)
    logits[1, [5, 9]] = 50.0  # a tie: the first index
    logits[3, 17] = np.nan
    rows = np.asarray([5, 1, 3, 0], dtype=np.int64)
    params = RowParams.of([(int(k), SamplingParams(temperature=0.0), [], np.random.default_rng(0)) for k in rows])
    assert greedy_rows(logits, rows) == sample_rows(logits, params)
    assert greedy_rows(logits, rows)[1:3] == [5, None]
    assert batch_sampling.greedy_rows(logits, np.zeros(0, dtype=np.int64)) == []


def test_a_sampled_token_reaches_its_text_event_uncopied(engine, monkeypatch):
    """The scheduler takes the sampling's TokenOutput as it is (a row without accepted drafts)."""
    model, engine = engine
    sampled: list[TokenOutput] = []
    sample = engine.runner.sampling.sample

    def recorded(rows, drafts=None):
        outputs = sample(rows, drafts)
        sampled.extend(o for o in outputs.values() if isinstance(o, TokenOutput))
        return outputs

    monkeypatch.setattr(engine.runner.sampling, "sample", recorded)
    request = Request(model.tokenize("a prompt"), SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8))
    events: list[object] = []
    run_requests(engine, [request], on_event=lambda r, e: events.append(e))
    in_text = [t for e in events if isinstance(e, TextEvent) for t in e.tokens]
    assert len(in_text) == 8
    assert all(any(t is s for s in sampled) for t in in_text)


def test_rows_without_a_constraint_never_reach_llguidance_s_masks(engine, monkeypatch):
    """A step of unconstrained rows asks the constraints nothing per row (no mask pass, no commit)."""
    from pflash_plugin.engine.constraints import Constraints

    def refuse(*args, **kwargs):
        raise AssertionError("the constraints were asked about unconstrained rows")

    monkeypatch.setattr(Constraints, "apply", refuse)
    monkeypatch.setattr(Constraints, "settle", refuse)
    model, engine = engine
    tokens = _tokens(model, engine, [SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6),
                                     SamplingParams(max_tokens=6, temperature=0.8, seed=1, min_tokens=6)])
    assert [len(t) for t in tokens] == [6, 6]


def test_sampling_reads_the_logits_on_the_threads_the_decode_ran_on(tiny_model, monkeypatch):
    """The host's pass over a step's logits (the argmax of its greedy rows) runs on as many threads as
    the step's decode ran its batch on (the wide count on a GPU), not on the narrow count alone."""
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=4, max_ctx=256, n_threads=1, n_threads_batch=2,
                                                         backend_sampling="off"))
    seen: list[tuple[int, int]] = []
    real = native.sample_rows

    def spied(logits, table, n_threads):
        seen.append((n_threads, engine.runner.ctx.host_threads))
        return real(logits, table, n_threads)

    monkeypatch.setattr(native, "sample_rows", spied)
    try:
        tokens = _tokens(model, engine, [SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6) for _ in range(3)])
    finally:
        engine.stop()
    assert [len(t) for t in tokens] == [6, 6, 6]
    assert seen and all(passed == ran for passed, ran in seen)
    assert any(passed == 2 for passed, _ in seen)  # the prompts' step ran its batch on the wide count
