"""Admission over HTTP (tiny model, real server on loopback): one rule, decided by the engine
thread before the first byte of the answer. What fits the free slots is admitted whatever
max_queue is; what can never fit is a 400 saying why; what is refused for load is a 429, never a
200 whose stream then ends in an error."""
from __future__ import annotations

import httpx
import pytest

from conftest import LiveServer, live_server

LONG = 3500  # tokens: a request that holds its slot until it is cancelled


def model(**kw) -> dict:
    return {"model": kw.pop("path"), "model_alias": "tiny", "n_ctx": 4096, "n_threads": 1, "n_threads_batch": 1, **kw}


def completion(server: LiveServer, n: int, stream: bool) -> httpx.Response:
    with server.client() as client:
        return client.post("/v1/completions", json={"prompt": "admit me", "max_tokens": 3, "n": n, "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
def test_requests_that_fit_free_slots_are_admitted_with_max_queue_0(tiny_model, stream):
    with live_server([model(path=str(tiny_model), max_concurrency=2, max_queue=0)]) as server:
        for n in (1, 2):
            reply = completion(server, n, stream)
            assert reply.status_code == 200, reply.text
            assert reply.text.rstrip().endswith("data: [DONE]") if stream else len(reply.json()["choices"]) == n


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("slots,queue,n", [(2, 64, 67), (2, 4, 10)])
def test_more_choices_than_slots_plus_queue_is_a_400_saying_why(tiny_model, stream, slots, queue, n):
    with live_server([model(path=str(tiny_model), max_concurrency=slots, max_queue=queue)]) as server:
        reply = completion(server, n, stream)
        assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
        message = reply.json()["error"]["message"]
        assert f"{n} choices" in message and "max_concurrency" in message and "max_queue" in message


def test_a_stream_refused_for_load_is_a_429_before_any_byte(tiny_model):
    with live_server([model(path=str(tiny_model), max_concurrency=2, max_queue=4)]) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"prompt": "keep going", "max_tokens": LONG, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as holder:
                lines = holder.iter_lines()  # kept: a collected line iterator closes the stream
                next(line for line in lines if line.startswith("data: {"))
                refused = completion(server, 6, stream=True)  # 1 running + 6 > 2 slots + 4 queued
                admitted = completion(server, 5, stream=True)  # 1 + 5 fits
                holding = server.status()["running"]
        assert holding == 1, "the long request ended early: the test proves nothing"
        assert refused.status_code == 429 and refused.headers["content-type"] == "application/json"
        assert refused.json()["error"]["type"] == "rate_limit_exceeded" and refused.headers["retry-after"]
        assert admitted.status_code == 200 and admitted.text.rstrip().endswith("data: [DONE]")
        assert server.wait_idle()["running"] == 0
