"""Requests that once aborted the server, or got a 500, against a real server process: each answers
200 or 400, and the server stays healthy (a regression kills the child, not pytest)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pflash_plugin.testing.native_fuzz import (COMPLETIONS, alternation, nested_optionals, seed_cases, server_process,
                                               vocab_facts)

DEEP_GRAMMAR = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000  # parsed recursively: overflows the stack


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with server_process(tiny_model, tmp_path_factory.mktemp("hostile") / "server.log") as server:
        yield server


def post(server, path: str, raw: str) -> httpx.Response:
    """A body sent as written (JSON as Python reads it: -1e999 is -inf, "\\udcff" a lone surrogate)."""
    try:
        response = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    except httpx.HTTPError as error:
        pytest.fail(f"no answer ({error!r}); the server {server.death() or 'is alive'}")
    assert server.proc.poll() is None, server.death()
    return response


def healthy(server) -> bool:
    return httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_the_requests_that_aborted_the_server_answer_and_leave_it_healthy(server, tiny_model):
    _, eog = vocab_facts(tiny_model)
    answers = [post(server, path, json.dumps(body)) for path, body in seed_cases(eog)]
    assert [a.status_code for a in answers] == [200, 400, 200, 200]
    only_eog, infinite_bias, eog_at_minus_100, json_bool = [a.json() for a in answers]
    # the grammar allows "a" then only the end: min_tokens cannot hold the end back past it
    assert only_eog["choices"][0]["text"] == "a" and only_eog["choices"][0]["finish_reason"] == "stop"
    assert infinite_bias["error"]["param"] == "logit_bias"
    assert eog_at_minus_100["choices"][0]["text"] == "a"
    assert json_bool["choices"][0]["message"]["content"].strip() in ("true", "false")
    assert healthy(server)


def test_a_grammar_that_allows_nothing_ends_the_generation(server):
    """No token (not even the end) matches: llama.cpp would accept a forbidden one and abort.
    llama.cpp's grammar sampler reads pieces as C strings, so no token holds a NUL there; llguidance
    spells one with the byte token <0x00>. A token id the vocabulary lacks allows nothing in
    llama.cpp's grammar sampler (which serves it: llguidance cannot read it)."""
    for grammar, text in [('root ::= "\\x00"', "\x00"), ("root ::= <[999999]>", "")]:
        body = {"prompt": "Hi", "max_tokens": 4, "min_tokens": 2, "grammar": grammar}
        answer = post(server, COMPLETIONS, json.dumps(body))
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == text
    assert healthy(server)


@pytest.mark.parametrize("raw, param", [
    ('{"prompt": "\\udcff"}', "prompt"),
    ('{"prompt": ["ok", "\\ud800x"]}', "prompt.1"),
    ('{"prompt": "hi", "stop": ["\\udcff"]}', "stop.0"),
    ('{"prompt": "hi", "grammar": "root ::= \\"\\udcff\\""}', "grammar"),
    ('{"prompt": "hi", "logit_bias_type": "tokens", "logit_bias": {"\\udcff": 1}}', "logit_bias"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(server, raw, param):
    answer = post(server, COMPLETIONS, raw)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_a_lone_surrogate_sent_as_raw_bytes_is_a_400(server):
    """json.loads takes UTF-8's surrogate range ('surrogatepass'): no escape needed to send one."""
    raw = '{"prompt": [5, "a\udcffb"]}'.encode("utf-8", "surrogatepass")
    answer = httpx.post(server.url + COMPLETIONS, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt.1", answer.text


def test_a_lone_surrogate_in_a_chat_message_is_a_400(server):
    raw = '{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\udcff"}]}'
    answer = post(server, "/v1/chat/completions", raw)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages.1.content"


@pytest.mark.parametrize("field, value", [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("repeat_penalty", "Infinity"),
    ("logit_bias", '{"5": NaN}'), ("logit_bias", '{"5": 101}'),
])
def test_numbers_llama_cpp_cannot_use_are_a_400(server, field, value):
    answer = post(server, COMPLETIONS, f'{{"prompt": "hi", "max_tokens": 2, "{field}": {value}}}')
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text


@pytest.mark.parametrize("grammar", [
    DEEP_GRAMMAR,
    "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(80_000)) + 'r80000 ::= "a"',
    "root ::= (",
], ids=["deep-nesting", "long-rule-chain", "unparsable"])
def test_grammars_llama_cpp_cannot_take_are_a_400_before_any_stream(server, grammar):
    answer = post(server, COMPLETIONS, json.dumps({"prompt": "hi", "grammar": grammar, "stream": True}))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "grammar", answer.text


def test_the_engine_refuses_a_grammar_too_deep_for_llama_cpp(tiny_model):
    """SamplerChain's own guard, for callers that skip the server's validation (in a child
    process: without the guard, llama.cpp's parser overflows the stack)."""
    code = ("import sys\nfrom pflash_plugin.llama import GrammarError, Model, SamplerChain, SamplerParams\n"
            "try:\n    SamplerChain(Model(sys.argv[1]), SamplerParams(temperature=0, seed=0, grammar=sys.argv[2]))\n"
            "except GrammarError as error:\n    print(error)\n")
    child = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model), DEEP_GRAMMAR], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0 and "nests" in child.stdout, (child.returncode, child.stderr[-2000:])


def test_a_native_abort_leaves_its_cause_in_the_log(tiny_model, tmp_path):
    """What llama.cpp does on a failed assertion (abort) must not end the process silently: the
    log shows every thread's Python stack, and the exit status the signal, for the supervisor."""
    with server_process(tiny_model, tmp_path / "server.log") as server:
        server.proc.send_signal(signal.SIGABRT)
        assert server.proc.wait(timeout=60) == -signal.SIGABRT
        log = server.log.read_text(errors="replace")
    assert "Fatal Python error: Aborted" in log and "most recent call first" in log, log[-2000:]


@pytest.mark.parametrize("grammar, why", [
    (nested_optionals(8), "nested optionals"),
    (nested_optionals(17), "nested optionals"),
    (alternation(20_000), "large alternation"),
    ('root ::= "' + "a" * 2000 + '"{1000}', "elements"),  # 2 KB that llama.cpp holds as 2M elements
], ids=["nested-optionals-8", "nested-optionals-17", "alternation-20000", "repeated-literal"])
def test_a_grammar_that_would_stall_every_step_is_a_400_saying_why(server, grammar, why):
    started = time.monotonic()
    answer = post(server, COMPLETIONS, json.dumps({"prompt": "hi", "grammar": grammar, "max_tokens": 3}))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "grammar", answer.text
    assert why in answer.json()["error"]["message"]
    assert time.monotonic() - started < 5
    assert healthy(server)


def chat_with_schema(schema: dict) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})


def test_a_json_schema_enum_too_large_is_a_400(server):
    answer = post(server, "/v1/chat/completions", chat_with_schema({"enum": [f"value{i}" for i in range(10_000)]}))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "response_format", answer.text
    assert "parse states" in answer.json()["error"]["message"]


def test_large_real_schemas_stay_within_the_grammar_bounds(server):
    """60 optional properties, an enum of 500 values: what real tools send is not refused."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(60)}
              | {"kind": {"enum": [f"k{i}" for i in range(500)]}}}
    answer = post(server, "/v1/chat/completions", chat_with_schema(schema))
    assert answer.status_code == 200, answer.text


POST_ROUTES = ["/v1/completions", "/v1/engines/copilot-codex/completions", "/v1/chat/completions", "/v1/embeddings",
               "/extras/tokenize", "/extras/tokenize/count", "/extras/detokenize"]


@pytest.mark.parametrize("depth", [200, 1_000, 100_000])
def test_json_nested_too_deep_is_a_400_on_every_route(server, depth):
    bodies = ['{"prompt": ' + "[" * depth + "]" * depth + "}", '{"a": ' + '{"a": ' * depth + "1" + "}" * (depth + 1),
              "[" * depth + "]" * depth]
    for path in POST_ROUTES:
        for raw in bodies:
            answer = post(server, path, raw)
            assert answer.status_code == 400, (path, raw[:20], answer.text[:300])
            assert "nests JSON over 128 levels" in answer.json()["error"]["message"]
    assert healthy(server)


@pytest.mark.parametrize("stop, status, param", [
    (["x" * 1024] * 32, 200, None),
    ([f"s{i}" for i in range(33)], 400, "stop"),
    (["ok", "y" * 1025], 400, "stop.1"),
])
def test_stop_strings_are_capped_in_number_and_length(server, stop, status, param):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body in [(COMPLETIONS, {"prompt": "hi"}), ("/v1/chat/completions", chat)]:
        answer = post(server, path, json.dumps(body | {"max_tokens": 2, "stop": stop}))
        assert answer.status_code == status, answer.text
        assert status == 200 or answer.json()["error"]["param"] == param


def counted(server) -> tuple[float, float, float]:
    """(requests finished, of them cancelled, generated tokens) from /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text)}
    finished = [s for s in families["pflash_requests"].samples if s.name.endswith("_total")]
    cancelled = sum(s.value for s in finished if s.labels.get("finish_reason") == "cancelled")
    tokens = sum(s.value for s in families["pflash_generation_tokens"].samples if s.name.endswith("_total"))
    return sum(s.value for s in finished), cancelled, tokens


def test_requests_cancelled_by_a_disconnect_are_counted_with_their_tokens(server):
    """Issue 22: the counters moved only when the HTTP side received the finish, which a gone client
    never does (42 cancelled requests left no trace). 3 requests of 8 choices (4 rounds of the 2
    slots), their clients gone at the first token: all 24 choices are counted, most as cancelled."""
    finished, cancelled, tokens = counted(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "min_tokens": 400, "n": 8}
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):  # the client leaves before the answer
            httpx.post(server.url + COMPLETIONS, json=body, timeout=httpx.Timeout(10, read=0.03))
    with httpx.stream("POST", server.url + COMPLETIONS, json=body | {"stream": True}, timeout=10) as streamed:
        next(streamed.iter_lines())  # the first event, then the client leaves
    deadline = time.monotonic() + 30
    while counted(server)[0] < finished + 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    now_finished, now_cancelled, now_tokens = counted(server)
    assert now_finished == finished + 24
    assert now_cancelled >= cancelled + 12
    assert now_tokens > tokens


def test_a_grammar_whose_steps_keep_growing_in_llama_cpp_is_served_by_llguidance(server):
    """An ambiguous grammar's parse grows about 4x a token in llama.cpp's grammar sampler (ended at
    max_grammar_step_s: tests/test_engine_real.py); llguidance's Earley parse does not grow, so
    the request runs to its max_tokens in bounded time (issue 49: no bound that reads a clock)."""
    a = httpx.post(server.url + "/extras/tokenize", json={"input": "a"}, timeout=10).json()["tokens"][-1]
    body = {"prompt": "hi", "max_tokens": 40, "temperature": 0, "logit_bias": {str(a): 100},
            "grammar": 'root ::= r "x"\nr ::= "a" r "b" | "a" r "c" | "a"'}
    started = time.monotonic()
    answer = post(server, COMPLETIONS, json.dumps(body))
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"].startswith("a" * 30), choice
    assert time.monotonic() - started < 15
    assert healthy(server)
    assert post(server, COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 3})).status_code == 200
