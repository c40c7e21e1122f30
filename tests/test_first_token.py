"""A short request's way to its first token beside long ones (issue 48): a large body is parsed off
the event loop, the routes' dependency and a short request's preparation need no worker thread,
and the usage's timings carry the marks around the engine's own TTFT (prepare_ms before the
arrival; release_ms and emit_ms after the first token)."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pflash_plugin.server.preparation.format_cache import MAX_CHARS, MAX_NODES, FormatCache, format_key, formats
from pflash_plugin.server.preparation.inline import INLINE_CHARS, INLINE_IDS
from pflash_plugin.server.preparation.inline import inline as on_loop
from pflash_plugin.server.wire import errors
from pflash_plugin.server.wire.errors import LOOP_PARSE_BYTES
from pflash_plugin.server.wire.offload import THREADS
from pflash_plugin.server.wire.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat


class HeldParse:
    """The body checks' parse (wire/errors.loads) held at a gate for bodies over LOOP_PARSE_BYTES:
    the long bodies' parse, wherever it runs, waits there until `release`."""

    def __init__(self, monkeypatch) -> None:
        self.gate, self.entered = threading.Event(), threading.Semaphore(0)
        loads = errors.loads

        def held(raw: bytes):
            if len(raw) > LOOP_PARSE_BYTES:
                self.entered.release()
                self.gate.wait(60)
            return loads(raw)

        monkeypatch.setattr(errors, "loads", held)

    def send(self, pool: ThreadPoolExecutor, url: str, n: int) -> list:
        """`n` long bodies sent at once; returns once each is held in its parse."""
        body = json.dumps({"prompt": [7] * (LOOP_PARSE_BYTES // 3), "max_tokens": 1}).encode()
        assert len(body) > LOOP_PARSE_BYTES
        pending = [pool.submit(httpx.post, url + "/v1/completions", content=body,
                               headers={"content-type": "application/json"}, timeout=120) for _ in range(n)]
        for _ in range(n):
            assert self.entered.acquire(timeout=30), "a long body never reached its parse"
        return pending


def test_a_short_request_is_answered_while_a_long_body_is_being_parsed(tiny_server, monkeypatch):
    """On the event loop, the long body's parse would hold every other request with it."""
    held = HeldParse(monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        pending = held.send(pool, tiny_server.url, 1)
        try:
            short = httpx.post(tiny_server.url + "/v1/completions", timeout=30,
                               json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            answered_while_held = not held.gate.is_set()
        finally:
            held.gate.set()
        long = pending[0].result()
    assert short.status_code == 200 and answered_while_held
    assert short.json()["usage"]["completion_tokens"] == 2
    # the long one got its own answer: its 21,845 ids are over the tiny model's context
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]


def test_a_route_needs_no_worker_thread_to_find_its_context(tiny_server, monkeypatch):
    """The routes' dependency (get_context) runs on the event loop: with every thread of the request
    path's pool holding a long body's parse (wire/offload.py), a route that has no blocking work of
    its own still answers."""
    held = HeldParse(monkeypatch)
    with ThreadPoolExecutor(THREADS) as pool:
        pending = held.send(pool, tiny_server.url, THREADS)
        try:
            models = httpx.get(tiny_server.url + "/v1/models", timeout=30)
            answered_while_held = not held.gate.is_set()
        finally:
            held.gate.set()
        assert all(p.result().status_code == 400 for p in pending)
    assert models.status_code == 200 and answered_while_held
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]


def test_a_long_body_parsed_off_the_loop_keeps_the_body_checks(tiny_server):
    """The body checks read the JSON a worker thread parsed: a lone surrogate among many ids is
    still named by its path, and a body too large to be JSON is FastAPI's own 400."""
    ids = [7] * (LOOP_PARSE_BYTES // 3)
    raw = json.dumps({"prompt": [*ids, "\udcff"], "max_tokens": 1}).encode()
    reply = httpx.post(tiny_server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == f"prompt.{len(ids)}"
    broken = b'{"prompt": [' + b"7, " * (LOOP_PARSE_BYTES // 3) + b"}"
    reply = httpx.post(tiny_server.url + "/v1/completions", content=broken,
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_a_short_request_is_prepared_without_a_worker_thread(tiny_server, monkeypatch):
    """A short completion and a short chat need no thread of the pool: with all of them holding long
    bodies' parses, both are answered (in full, streamed)."""
    held = HeldParse(monkeypatch)
    with ThreadPoolExecutor(THREADS) as pool:
        pending = held.send(pool, tiny_server.url, THREADS)
        try:
            with httpx.Client(base_url=tiny_server.url, timeout=30) as http:
                completion = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "min_tokens": 3})
                chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 3, "min_tokens": 3, "stream": True})
            answered_while_held = not held.gate.is_set()
        finally:
            held.gate.set()
        assert all(p.result().status_code == 400 for p in pending)
    assert answered_while_held and completion.status_code == 200 and chat.status_code == 200
    assert completion.json()["usage"]["completion_tokens"] == 3
    assert chat.text.rstrip().endswith("data: [DONE]")


def test_only_short_requests_with_nothing_to_compile_are_prepared_on_the_loop():
    def chat(**kw) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **kw})

    def inline(body) -> bool:
        return on_loop(body, FormatCache())

    assert inline(CompletionRequest(prompt="x" * INLINE_CHARS)) and inline(CompletionRequest(prompt=[1] * INLINE_IDS))
    assert not inline(CompletionRequest(prompt="x" * (INLINE_CHARS + 1)))
    assert not inline(CompletionRequest(prompt=[1] * (INLINE_IDS + 1)))
    assert not inline(CompletionRequest(prompt=[[1, 2], [3]]))  # a batch of prompts
    assert inline(chat()) and inline(chat(response_format={"type": "text"}))
    for heavy in ({"n": 2}, {"grammar": "root ::= \"a\""}, {"logit_bias": {"5": 1.0}},
                  {"response_format": {"type": "json_object"}},
                  {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        assert not inline(chat(**heavy)), heavy
    parts = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]
    assert not inline(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]}))
    long = [{"role": "user", "content": "x" * (INLINE_CHARS // 2)}, {"role": "assistant", "content": "y"},
            {"role": "user", "content": "z" * (INLINE_CHARS // 2)}]
    assert not inline(ChatCompletionRequest.model_validate({"messages": long}))


def test_a_schema_prepared_before_is_prepared_on_the_loop_after(tiny_server):
    """A JSON schema is checked, converted and compiled once per served model: the next request with
    the same schema takes that constraint (the same answer) and, with a short prompt, is prepared on
    the event loop like a plain one, its matcher built beside for the engine to take (format_cache.py,
    engine/constraints.py prebuild; issue 49). The same properties in another
    order are another schema (the answer's order of fields). A schema over MAX_NODES values or
    MAX_CHARS characters is never kept, so never prepared on the loop (its key is made there)."""
    served = tiny_server.app.state.models.get("tiny")
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    swapped = {**person, "properties": dict(reversed(list(person["properties"].items())))}

    def body(schema: dict) -> dict:
        return {"prompt": "a person:", "max_tokens": 30, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}

    def kept(schema: dict) -> bool:
        return on_loop(CompletionRequest.model_validate(body(schema)), formats(served))

    assert not kept(person)
    before = tiny_server.status("tiny")["constraints"]
    answers = [httpx.post(tiny_server.url + "/v1/completions", json=body(person), timeout=60) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    after = tiny_server.status("tiny")["constraints"]  # each request's own matcher, neither built by the engine
    assert (after["binds_prebuilt"] - before["binds_prebuilt"], after["binds"] - before["binds"]) == (2, 0)
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]
    assert kept(person) and not kept(swapped)
    assert not on_loop(CompletionRequest.model_validate({**body(person), "response_format": {"type": "json_object"}}),
                       formats(served))
    wide = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(MAX_NODES)}}
    long = {**person, "description": "x" * (MAX_CHARS + 1)}
    for schema in (wide, long):
        assert format_key(ResponseFormat.model_validate({"type": "json_object", "schema": schema})) is None
    assert format_key(ResponseFormat.model_validate({"type": "json_object", "schema": person})) is not None


@pytest.mark.parametrize("stream", [True, False])
def test_the_usage_timings_mark_the_request_before_and_after_the_engine(tiny_server, stream):
    """prepare_ms (headers in to the engine's arrival) is there for every request; release_ms (the
    first token to its event leaving the engine thread) too; emit_ms (that to its text written) for
    a streamed one, whose first text went out before its end."""
    body = {"prompt": "Hello", "max_tokens": 8, "min_tokens": 8, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as reply:
                chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
            timings = next(c["usage"] for c in chunks if c.get("usage"))["timings"]
        else:
            timings = http.post("/v1/completions", json=body).json()["usage"]["timings"]
    assert timings["prepare_ms"] > 0 and timings["release_ms"] > 0
    assert (timings["emit_ms"] > 0) == stream


def test_the_usage_clock_marks_each_stage_on_the_host_s_clock(tiny_model):
    """With --usage_clock, the timings carry each mark in seconds of the server's time.perf_counter
    (the host's monotonic clock): in the request's order, and inside the client's own send and
    receipt on the same clock. Without it, none."""
    from tests.conftest import live_server

    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 512, "max_concurrency": 2,
             "n_threads": 1, "n_threads_batch": 1}
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "min_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    for clock in (True, False):
        with live_server([model], usage_clock=clock) as server, httpx.Client(timeout=60) as http:
            sent = time.perf_counter()
            with http.stream("POST", server.url + "/v1/completions", json=body) as reply:
                chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
            got = time.perf_counter()
        timings = next(c["usage"] for c in chunks if c.get("usage"))["timings"]
        if not clock:
            assert "clock" not in timings
            continue
        marks = timings["clock"]
        way = ["received", "body_read", "arrival", "admitted", "scheduled", "prefill_done", "first_token",
               "first_released", "first_written"]
        assert list(marks) == [*way, "finished"]
        at = [marks[mark] for mark in way]
        assert sent <= at[0] and at == sorted(at) and at[-1] <= got  # the engine may finish before its text is out
        assert marks["first_token"] <= marks["finished"] <= got
        assert round(1000 * (marks["first_token"] - marks["arrival"]), 3) == pytest.approx(timings["ttft_ms"], abs=0.01)
