"""Speculation with a draft model (issue 47): `--draft_model PATH.gguf` (or `pflash`: PFlash's
drafter GGUF) drafts through engine/speculation/draft_model.py in the batched engine. Greedy text
is the same as without speculation; the target as its own draft has every draft kept; a draft of
another vocabulary is refused at start in one line; the server's keys resolve `pflash` and place the
draft where the target is; over HTTP a request's text is the same with speculation on and off."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import live_server
from test_engine_real import run_texts
from test_speculation_policy import free

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.engine.speculation.draft_model import DraftModelError
from pflash_plugin.engine.speculation.policy import SpeculationPolicy
from pflash_plugin.engine.speculation.setup import SpeculationConfig
from pflash_plugin.llama import ModelParams
from pflash_plugin.server.config.llama_params import SettingsRefused, speculation_config
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.testing import cached_tiny_llama

PROMPTS = ["the quick brown fox jumps over the lazy dog", "once upon a time there was a", "hello world",
           "one two three four one two"]
GREEDY = SamplingParams(max_tokens=40, temperature=0)


@pytest.fixture(scope="module")
def q4_draft() -> Path:
    """The tiny target's weights in Q4_0: same vocabulary, agrees with it most of the time."""
    return cached_tiny_llama(quant="q4_0")


def outcomes(target: Path, draft: Path | None, prompts: list[str]):
    """Each greedy request's tokens, all submitted together; the engine's speculation stats. The
    draft loads with the parameters it is given (use_mmap off here, as the server could set it)."""
    spec = SpeculationConfig(str(draft), num_pred_tokens=4, draft_params=ModelParams(use_mmap=False), n_threads=1,
                             n_threads_batch=1) if draft else None
    model, engine = load_engine(target, EngineConfig(n_slots=4, max_ctx=512, n_threads=1, n_threads_batch=1,
                                                     speculation=spec))
    try:
        if spec:
            speculation = engine.scheduler.steps.speculation
            assert speculation is not None and speculation.proposer.model.params.use_mmap is False
            # every step may draft: a draft model as dear as the tiny target never pays, and the budget
            # (test_speculation_budget.py) would stop it after a probe, leaving the equality untested
            speculation.policy.budget = free()
        requests = [Request(model.tokenize(p), GREEDY) for p in prompts]
        run_texts(engine, requests)
        if spec:  # the policy prices a draft token with what the draft model's decodes cost
            assert speculation is not None and speculation.policy.drafting > 0
        return [r.output_tokens for r in requests], engine.stats().speculation
    finally:
        engine.stop()


def test_greedy_text_is_the_same_with_a_draft_model_alone_and_four_at_once(tiny_model, q4_draft):
    for prompts in (PROMPTS[:1], PROMPTS):
        plain, _ = outcomes(tiny_model, None, prompts)
        fast, stats = outcomes(tiny_model, q4_draft, prompts)
        assert fast == plain
        assert stats.drafted > stats.accepted > 0 and stats.tokens > stats.rows


def test_the_target_as_its_own_draft_has_every_draft_kept(tiny_model):
    plain, _ = outcomes(tiny_model, None, PROMPTS[:2])
    fast, stats = outcomes(tiny_model, tiny_model, PROMPTS[:2])
    assert fast == plain
    assert stats.accepted == stats.drafted > 0


def test_closing_the_engine_frees_the_draft_model(tiny_model, q4_draft):
    _, engine = load_engine(tiny_model, EngineConfig(n_slots=1, max_ctx=256, n_threads=1, n_threads_batch=1,
                                                     speculation=SpeculationConfig(str(q4_draft))))
    speculation = engine.scheduler.steps.speculation
    assert speculation is not None
    engine.stop()
    engine.close()
    assert speculation.proposer.ctx.ptr is None and speculation.proposer.model.ptr is None


def test_a_draft_token_s_drafting_cost_is_part_of_its_price():
    """One row, a step of 10 ms and 1 ms a token: at acceptance 0.6 a row drafts while 0.6^j beats
    the price (0.1: 4 tokens); a draft model's 2 ms a draft token makes it 0.3 (2 tokens), 8 ms 0.9
    (none)."""
    policy = SpeculationPolicy(max_draft=10)
    for tokens in (1, 2, 5):
        for _ in range(3):
            policy.cost.observe(tokens, 0.009 + 0.001 * tokens)
    free = policy.draft_tokens(1, 1)
    policy.drafting = 0.002
    dear = policy.draft_tokens(1, 1)
    policy.drafting = 0.008
    assert free == 4 and dear == 2 and policy.draft_tokens(1, 1) == 0


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(tiny_model):
    other = cached_tiny_llama(vocab_extra=8)
    with pytest.raises(DraftModelError, match=r"^draft_model: .* does not share the vocabulary of the target"):
        load_engine(tiny_model, EngineConfig(n_slots=1, max_ctx=256, speculation=SpeculationConfig(str(other))))


def test_the_server_keys_resolve_pflash_and_place_the_draft_with_the_target(tiny_model, q4_draft):
    base = {"model": str(tiny_model), "n_gpu_layers": 7, "n_threads": 3, "n_threads_batch": 2}
    spec = speculation_config(ModelSettings(**base, draft_model=str(q4_draft), draft_model_num_pred_tokens=5))
    assert spec is not None and (spec.draft, spec.num_pred_tokens) == (str(q4_draft), 5)
    assert (spec.draft_params.n_gpu_layers, spec.n_threads, spec.n_threads_batch) == (7, 3, 2)
    pflash = speculation_config(ModelSettings(**base, draft_model="pflash", pflash_drafter=str(q4_draft)))
    assert pflash is not None and pflash.draft == str(q4_draft)
    with pytest.raises(SettingsRefused, match="'pflash' drafts with PFlash's drafter GGUF, and there is none") as no:
        speculation_config(ModelSettings(**base, draft_model="pflash"))
    assert no.value.key == "draft_model"
    with pytest.raises(SettingsRefused, match="no such file: nowhere.gguf"):
        speculation_config(ModelSettings(**base, draft_model="nowhere.gguf"))


def test_over_http_a_draft_model_speculates_and_the_text_is_the_same(tiny_model, q4_draft):
    """One server with --draft_model: a greedy completion with speculation on and with it turned off
    (the request's "speculative": false) gives the same text, and /metrics counts kept drafts."""
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 512, "max_concurrency": 2,
             "n_threads": 1, "n_threads_batch": 1, "draft_model": str(q4_draft), "draft_model_num_pred_tokens": 4}
    with live_server([model]) as server, server.client() as client:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0}
        on = client.post("/v1/completions", json=body)
        off = client.post("/v1/completions", json={**body, "speculative": False})
        assert on.status_code == off.status_code == 200
        assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
        metrics = httpx.get(server.url + "/metrics").text
    accepted = [line for line in metrics.splitlines() if line.startswith("pflash_spec_decode_num_accepted_tokens")]
    assert accepted and float(accepted[0].split()[-1]) > 0
