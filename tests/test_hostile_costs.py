"""Issue 49: no request costs a hundred normal ones. Histories joined in linear time, sizes checked
before the work they bound (render, tokenize), pflash.query capped before it is tokenized, the
tokenizing routes in a pool of their own with a 429 past its queue, chat max_tokens below 1 a
400, and the grammar's per-token bound in CPU time, which a loaded machine does not move."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from llama_cpp import llama_grammar

from conftest import TINY_PFLASH, live_server
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import ErrorEvent, FinishEvent, Request, SamplingParams
from pflash_plugin.llama.sampler import SlowSteps
from pflash_plugin.server.wire.protocol import RequestError
from pflash_plugin.server.runtime.tokenizer_pool import TokenizerPool
from pflash_plugin.server.preparation.tool_requests import plain_history
from pflash_plugin.testing import cached_tiny_llama


# Bounds on time here catch a cost that grows again (quadratic: 91 s); the targets themselves
# (5 s, 3 s) are measured by bench/hostile_costs.py on a quiet machine (docs/hardening.md)
SLOW_S = 20


def compact(body: dict) -> dict:
    """Keyword arguments posting `body` as compact JSON (8 MB bodies stay under max_body_bytes)."""
    return {"content": json.dumps(body, separators=(",", ":")), "headers": {"content-type": "application/json"}}


@pytest.fixture(scope="module")
def server(tiny_model):
    """A model whose template renders no tools (earlier calls become text: plain_history)."""
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 1024, "max_concurrency": 2,
             "n_threads": 1, "n_threads_batch": 1, **TINY_PFLASH}
    with live_server([model], tokenizer_threads=1, tokenizer_queue=0) as live:
        yield live


def test_a_run_of_tool_results_is_joined_in_linear_time():
    """40K results in one run: joined one at a time (each join copying all before it) this took
    seconds; once, at the run's end, milliseconds."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    results = [{"role": "tool", "tool_call_id": "c", "content": f"result {i:05d}"} for i in range(40_000)]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                *results, {"role": "assistant", "content": "done"}, {"role": "tool", "content": "late"}]
    started = time.perf_counter()
    plain = plain_history(messages)
    assert time.perf_counter() - started < 1.0
    assert [m["role"] for m in plain] == ["user", "assistant", "user", "assistant", "user"]
    joined = plain[2]["content"].split("\n")
    assert joined[:3] == ["<tool_response>", "result 00000", "</tool_response>"] and len(joined) == 3 * 40_000
    assert joined[-2] == "result 39999" and plain[4]["content"] == "<tool_response>\nlate\n</tool_response>"
    assert "tool_calls" not in plain[1] and '"name": "f"' in plain[1]["content"]


def test_200k_tool_results_are_refused_before_they_are_converted(server):
    """Issue 49's 8.2 MB count_tokens took 91 s; each result takes a token at least, so 200K are
    over max_ctx, said before the conversion, the render or the tokenizer."""
    blocks = [{"type": "tool_result", "tool_use_id": "t"} for _ in range(200_000)]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": blocks}]
    started = time.perf_counter()
    reply = httpx.post(server.url + "/v1/messages/count_tokens", timeout=60,
                       **compact({"model": "tiny", "messages": messages}))
    assert time.perf_counter() - started < SLOW_S
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "200,002 messages, tool uses and tool results" in error["message"], error


def test_235k_tool_messages_are_refused_before_they_are_converted(server):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                *({"role": "tool", "tool_call_id": "c"} for _ in range(235_000))]
    started = time.perf_counter()
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, **compact({"messages": messages}))
    assert time.perf_counter() - started < SLOW_S
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
    assert "235,002 messages are over max_ctx" in reply.json()["error"]["message"]


# refuses every conversation with an assistant turn (the server's start-up check renders system + user)
REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                     "{{ raise_exception('this template renders nothing') }}{% endif %}{{ m['content'] }}{% endfor %}")


def test_responses_input_items_are_counted_before_they_are_converted(server):
    items = [{"type": "function_call_output", "call_id": "c", "output": ""} for _ in range(100_000)]
    reply = httpx.post(server.url + "/v1/responses", timeout=60, **compact({"input": items}))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input", reply.text
    assert "100,000 input items are over max_ctx" in reply.json()["error"]["message"]


def test_a_conversation_too_long_for_max_ctx_is_refused_before_the_template_renders_it():
    """A template that refuses every conversation with an assistant turn: what a long one is told is
    its length, so the template never ran (a short one is told what the template said)."""
    model = {"model": str(cached_tiny_llama(chat_template=REFUSING_TEMPLATE)), "model_alias": "refusing",
             "n_ctx": 256, "max_concurrency": 1, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model]) as live:
        def refusal(content: str) -> str:
            body = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": content}],
                    "max_tokens": 2}
            reply = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 400, reply.text
            return reply.json()["error"]["message"]

        assert "2,000,000 characters are over max_ctx" in refusal("word " * 200_000)
        assert "this template renders nothing" in refusal("word")


def test_four_7mb_pflash_queries_are_refused_before_they_are_tokenized(server):
    """Tokenized whole, each took 3.1-3.4 s and 430 MB (four at once, 15.9 s each): the text is
    over 256 tokens whatever its tokens are, which its length says."""
    body = {"messages": [{"role": "user", "content": "Summarize the notes."}], "max_tokens": 2,
            "pflash": {"mode": "always", "query": "q" * 7_000_000}}

    def post(_: int) -> tuple[int, float, dict]:
        started = time.perf_counter()
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        return reply.status_code, time.perf_counter() - started, reply.json()

    with ThreadPoolExecutor(4) as pool:
        for status, took, answer in pool.map(post, range(4)):
            assert status == 400 and answer["error"]["param"] == "pflash.query", answer
            assert "7,000,000 characters are over 256 tokens" in answer["error"]["message"], answer
            assert took < SLOW_S


def test_a_short_pflash_query_still_scores(server):
    body = {"messages": [{"role": "user", "content": "Summarize: " + "the bridge opens at dawn. " * 40}],
            "max_tokens": 2, "pflash": {"mode": "always", "query": "when does the bridge open?"}}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text


def test_the_tokenizer_pool_refuses_past_its_queue():
    """One thread and no queue: a second job while the first runs is a 429; once it ends, the next is taken."""
    pool, release = TokenizerPool(workers=1, max_queue=0), threading.Event()

    async def scenario() -> tuple[RequestError, int]:
        first = asyncio.ensure_future(pool.run(release.wait, 10))
        await asyncio.sleep(0.05)
        with pytest.raises(RequestError) as refused:
            await pool.run(len, "x")
        release.set()
        await first
        return refused.value, await pool.run(len, "abc")

    try:
        refused, taken = asyncio.run(scenario())
    finally:
        release.set()
        pool.close()
    assert refused.status == 429 and refused.type == "rate_limit_exceeded" and "tokenizer is busy" in refused.message
    assert taken == 3


@pytest.mark.parametrize("path", ["/extras/tokenize", "/v1/messages/count_tokens"])
def test_a_tokenizing_flood_gets_429_in_its_apis_shape(server, path):
    """One tokenizer thread, no queue (the fixture's settings): of 12 requests at once, those that
    find it busy get a 429 with Retry-After, in OpenAI's or Anthropic's shape; the rest are answered."""
    text = "the bridge opens at dawn " * 2_000
    body = {"input": text} if path.startswith("/extras") else {"model": "tiny", "messages": [
        {"role": "user", "content": text}]}
    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda _: httpx.post(server.url + path, json=body, timeout=60), range(12)))
    busy = [r for r in replies if r.status_code == 429]
    assert busy and all(r.status_code in (200, 400, 429) for r in replies), [r.status_code for r in replies]
    assert all(r.headers.get("retry-after") == "1" for r in busy)
    error = busy[0].json()
    if path.startswith("/extras"):
        assert error["error"]["code"] == "rate_limit_exceeded", error
    else:
        assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error", error
    assert httpx.post(server.url + path, json=body, timeout=60).status_code in (200, 400)  # served again


@pytest.mark.parametrize("field, value", [("max_tokens", -1), ("max_tokens", 0), ("max_completion_tokens", 0)])
def test_chat_max_tokens_below_one_is_a_400(server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field and f"{field} must be at least 1" in reply.json()["error"]["message"]


def test_completions_max_tokens_zero_runs_to_the_context_end_as_in_llama_cpp(server):
    """Stock llama_cpp's completions take max_tokens 0 (its field allows >= 0) as "to n_ctx"."""
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0, "temperature": 0},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    negative = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=60)
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "max_tokens"


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


def test_a_loaded_machine_never_ends_a_schema_request(tiny_model):
    """The grammar's per-token bound counts CPU time: a thread that holds the GIL for 50 ms at a
    time makes every step wait on the clock (well past the bound here), never on the CPU."""
    grammar = llama_grammar.json_schema_to_gbnf(json.dumps(PERSON))
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=1, max_ctx=256, n_threads=1, n_threads_batch=1))
    done, ends = threading.Event(), []
    request = Request(model.tokenize("Person:"), SamplingParams(max_tokens=24, temperature=0, grammar=grammar,
                                                                 max_grammar_step_s=0.03))
    request.sink = lambda event: isinstance(event, (FinishEvent, ErrorEvent)) and (ends.append(event), done.set())
    stop, interval = threading.Event(), sys.getswitchinterval()

    def hog() -> None:
        while not stop.is_set():
            pass

    sys.setswitchinterval(0.05)
    hogger = threading.Thread(target=hog, daemon=True)
    hogger.start()
    try:
        engine.submit(request)
        assert done.wait(120)
    finally:
        stop.set()
        hogger.join()
        sys.setswitchinterval(interval)
        engine.stop()
    assert isinstance(ends[0], FinishEvent), ends[0]
    assert len(request.output_tokens) > 3


def test_one_slow_grammar_step_is_a_pause_and_two_in_a_row_end_the_grammar():
    """A garbage collection of the server's heap (or a hypervisor's steal) can put one step past the
    bound; a grammar whose states grow runs past it on every later step."""
    guard = SlowSteps(1.0)
    assert [guard.over(took) for took in (1.34, 0.1, 1.2, 0.003, 1.5, 1.6, 2.4)] == [
        False, False, False, False, False, True, True]


def test_a_grammar_request_over_the_bound_at_every_step_gets_one_token_then_its_400(tiny_model):
    grammar = llama_grammar.json_schema_to_gbnf(json.dumps(PERSON))
    model, engine = load_engine(tiny_model, EngineConfig(n_slots=1, max_ctx=256, n_threads=1, n_threads_batch=1))
    done, ends = threading.Event(), []
    request = Request(model.tokenize("Person:"), SamplingParams(max_tokens=24, temperature=0, grammar=grammar,
                                                                 max_grammar_step_s=1e-9))
    request.sink = lambda event: isinstance(event, (FinishEvent, ErrorEvent)) and (ends.append(event), done.set())
    try:
        engine.submit(request)
        assert done.wait(60)
    finally:
        engine.stop()
    assert isinstance(ends[0], ErrorEvent) and "the second in a row" in ends[0].message
    assert len(request.output_tokens) == 1
