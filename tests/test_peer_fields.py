"""The peers' request fields, applied over HTTP (wire/peer_fields.py): llama-server's DRY, XTC,
top-n-sigma, dynamic temperature and json_schema; vLLM's stop_token_ids, repetition_penalty and
guided decoding. Each was accepted and ignored before; each test fails with its field ignored."""
from __future__ import annotations

import json
import re

import pytest

from pflash_plugin.llama import DRY_TEMPLATES, Dry, Model
from pflash_plugin.llama.sampler import SamplerChain, SamplerParams

CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "temperature": 0}
# every candidate left to the sampler under test (stock's defaults truncate and penalize first)
OPEN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": 3}


def _longest_repeat(ids: list[int]) -> int:
    """The longest run of tokens that occurs twice in `ids`."""
    def runs(n: int) -> list[tuple[int, ...]]:
        return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    n = 0
    while len(set(runs(n + 1))) < len(runs(n + 1)):
        n += 1
    return n


def _chosen(client, **body) -> list[int]:
    """The tokens a /completion request generated (llama-server's route, which takes its own fields)."""
    reply = client.post("/completion", json={"prompt": "one two", "n_predict": 32, "return_tokens": True, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def test_dry_breaks_a_greedy_loop(tiny_server):
    with tiny_server.client() as client:
        plain = _chosen(client, temperature=0)
        dry = _chosen(client, temperature=0, dry_multiplier=8.0, dry_base=2.0, dry_allowed_length=2,
                      dry_penalty_last_n=256)
    assert _longest_repeat(plain) >= 10  # the tiny model loops on two tokens
    assert _longest_repeat(dry) <= 3


def test_xtc_top_n_sigma_and_dynatemp_change_the_draw(tiny_server):
    a, b = 500, 600  # two tokens made the likeliest by a bias (the tiny model's own rows are flat)
    with tiny_server.client() as client:
        def drawn(**body) -> list[int]:
            return _chosen(client, n_predict=16, **OPEN, **body)
        two = {"logit_bias": [[a, 30.0], [b, 29.0]], "temperature": 1.0}
        # XTC removes every token above its threshold but the least likely of them: b, never a
        assert drawn(**two).count(a) > 8
        assert set(drawn(**two, xtc_probability=1.0, xtc_threshold=0.1)) == {b}
        # top-n-sigma keeps only the logits near the best: at temperature 2 the draw is greedy
        hot = drawn(temperature=2.0)
        greedy = drawn(temperature=0)
        assert hot != greedy and drawn(temperature=2.0, top_n_sigma=0.001) == greedy
        # dynamic temperature: 0.05 +- 5 set by the row's entropy (high here): no longer the biased token
        one = {"logit_bias": [[a, 5.0]], "temperature": 0.05}
        assert set(drawn(**one)) == {a}
        assert drawn(**one, dynatemp_range=5.0).count(a) < 8


def test_stop_token_ids_end_the_answer_with_the_token_kept(tiny_server):
    with tiny_server.client() as client:
        tokens = _chosen(client, temperature=0, n_predict=12)
        stop = tokens[4]
        first = tokens.index(stop)
        body = {"prompt": "one two", "max_tokens": 12, "temperature": 0}
        full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        cut = client.post("/v1/completions", json={**body, "stop_token_ids": [stop]}).json()
        held = client.post("/v1/completions", json={**body, "stop_token_ids": [stop], "min_tokens": first + 2}).json()
        outside = client.post("/v1/completions", json={**body, "stop_token_ids": [10 ** 7]})
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == first + 1
    assert full.startswith(cut["choices"][0]["text"]) and cut["choices"][0]["text"]
    assert held["usage"]["completion_tokens"] > first + 1  # before min_tokens a stop token is text
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "stop_token_ids"


def test_repetition_penalty_is_repeat_penalty(tiny_server):
    body = {"prompt": "one two", "max_tokens": 24, "temperature": 0}
    with tiny_server.client() as client:
        def text(**more) -> str:
            return client.post("/v1/completions", json={**body, **more}).json()["choices"][0]["text"]
        assert text(repetition_penalty=1.5) == text(repeat_penalty=1.5) != text(repeat_penalty=1.0)
        both = client.post("/v1/completions", json={**body, "repeat_penalty": 1.3, "repetition_penalty": 1.2})
    assert both.status_code == 400 and both.json()["error"]["param"] == "repetition_penalty"


@pytest.mark.parametrize("guide, check", [
    ({"guided_choice": ["yes", "no way", 'q"\\\n']}, lambda text: text in ("yes", "no way", 'q"\\\n')),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda text: text in ("alpha", "beta")),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
    ({"guided_json": json.dumps({"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]})},
     lambda text: isinstance(json.loads(text)["b"], bool)),
    ({"structured_outputs": {"json_object": True}}, lambda text: text.startswith("{")),  # cut by max_tokens
    ({"json_schema": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}},
     lambda text: isinstance(json.loads(text)["b"], bool)),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda text: re.fullmatch("x[0-9][0-9]", text)),
])
def test_guided_decoding_constrains_chat(tiny_server, guide, check):
    with tiny_server.client() as client:
        reply = client.post("/v1/chat/completions", json={**CHAT, **guide})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert check(choice["message"]["content"])
    assert choice["finish_reason"] == "stop" or "json_object" in guide.get("structured_outputs", {})


def test_llama_server_json_schema_on_its_own_route(tiny_server):
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    with tiny_server.client() as client:
        reply = client.post("/completion", json={"prompt": "x", "n_predict": 20, "temperature": 0,
                                                 "json_schema": schema, "dry_multiplier": 0.5}).json()
    assert isinstance(json.loads(reply["content"])["b"], bool)
    assert reply["generation_settings"]["dry_multiplier"] == 0.5


@pytest.mark.parametrize("body, param", [
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"guided_choice": ["a"], "grammar": 'root ::= "a"'}, "guided_choice"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"dry_multiplier": 1.0, "dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"dry_multiplier": 1.0, "dry_sequence_breakers": ["x" * 41]}, "dry_sequence_breakers.0"),
    ({"dry_penalty_last_n": 1 << 30}, "dry_penalty_last_n"),
    ({"xtc_probability": 1.5}, "xtc_probability"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
])
def test_bad_peer_fields_are_400s(tiny_server, body, param):
    with tiny_server.client() as client:
        reply = client.post("/v1/chat/completions", json={**CHAT, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_vllm_fields_that_ask_nothing_are_accepted(tiny_server):
    neutral = {"use_beam_search": False, "skip_special_tokens": True, "truncate_prompt_tokens": 400, "best_of": 2,
               "n": 2}
    with tiny_server.client() as client:
        chat = client.post("/v1/chat/completions", json={**CHAT, **neutral})
        more = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "best_of": 3, "n": 2})
    assert chat.status_code == 200, chat.text
    assert more.status_code == 400 and more.json()["error"]["param"] == "best_of"


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_server):
    body = {"prompt": "one two", "max_tokens": 24, "temperature": 0}
    with tiny_server.client() as client:
        full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = full[5:8]
        kept = client.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True}).json()
        streamed = client.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True,
                                                        "stream": True}).text
    end = full.index(stop) + len(stop)
    assert kept["choices"][0]["text"] == full[:end] and kept["choices"][0]["finish_reason"] == "stop"
    pieces = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in pieces if c["choices"]) == full[:end]


def test_dry_samplers_are_cloned_from_one_template(tiny_model):
    model = Model(tiny_model)
    dry = Dry(1.0, sequence_breakers=("zq",))
    for _ in range(3):
        SamplerChain(model, SamplerParams(dry=dry), history=[1, 2, 3]).close()
    assert list(DRY_TEMPLATES._by_model[model]) == [dry]
