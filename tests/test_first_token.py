"""A short request's way to its first token beside long ones (issue 48): a large body is parsed off
the event loop, and the usage's timings carry the two marks around the engine's own TTFT
(prepare_ms before the arrival, emit_ms after the first token)."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pflash_plugin.server.wire.errors import LOOP_PARSE_BYTES


def test_a_short_request_is_answered_while_a_long_body_is_being_parsed(tiny_server, monkeypatch):
    """The long body's parse is held at a gate (json.loads, as FastAPI and the body checks call it):
    on the event loop it would hold every other request with it; a short one must get its answer."""
    gate, parsing = threading.Event(), threading.Event()
    loads = json.loads

    def held(text, *args, **kwargs):
        if len(text) > LOOP_PARSE_BYTES:
            parsing.set()
            gate.wait(60)
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", held)
    long_body = json.dumps({"prompt": [7] * (LOOP_PARSE_BYTES // 3), "max_tokens": 1}).encode()
    assert len(long_body) > LOOP_PARSE_BYTES
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, tiny_server.url + "/v1/completions", content=long_body,
                              headers={"content-type": "application/json"}, timeout=120)
        try:
            assert parsing.wait(30), "the long body never reached its parse"
            short = httpx.post(tiny_server.url + "/v1/completions", timeout=30,
                               json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            answered_while_held = not gate.is_set()
        finally:
            gate.set()
        long = pending.result()
    assert short.status_code == 200 and answered_while_held
    assert short.json()["usage"]["completion_tokens"] == 2
    # the long one got its own answer: its 2,730 ids are over the tiny model's context
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]


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
