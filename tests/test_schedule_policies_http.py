"""`priority` over HTTP (vLLM's field on completions, chat and Responses) and `--schedule_policy`:
on one slot, a request of a lower priority value queued behind others takes the slot first; under
the default policy (fcfs) the field changes nothing."""
from __future__ import annotations

import threading
import time

import pytest

from conftest import LiveServer, live_server

# each request decodes 64 tokens (the tiny model, greedy: no end of generation before), so one
# answer comes back a whole run after the one before it on the one slot, whatever the client's jitter
KEEP_GOING = {"prompt": "keep going", "temperature": 0, "max_tokens": 64, "min_tokens": 64}


def _server(tiny_model, policy: str):
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 2048, "max_concurrency": 1, "max_queue": 8,
             "n_threads": 1, "n_threads_batch": 1, "schedule_policy": policy}
    return live_server([model])


@pytest.fixture(scope="module")
def priority_server(tiny_model):
    with _server(tiny_model, "priority") as server:
        yield server


def _urgent(route: str) -> tuple[str, dict]:
    """The request sent last, with priority -1, on `route`."""
    if route == "completions":
        return "/v1/completions", {**KEEP_GOING, "priority": -1}
    if route == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                                        "min_tokens": 64, "temperature": 0, "priority": -1}
    return "/v1/responses", {"input": "hi", "max_output_tokens": 64, "temperature": 0, "priority": -1}


def _wait_queued(server: LiveServer, n: int) -> None:
    deadline = time.time() + 30
    while server.status()["waiting"] < n:
        assert time.time() < deadline, f"never {n} queued: {server.status()}"
        time.sleep(0.01)


def _finish_order(server: LiveServer, route: str) -> list[str]:
    """A streamed request holds the one slot; two plain requests (priority 0) and then the urgent
    one queue behind it, each seen queued before the next is sent; the holder's client leaves (it
    is cancelled), and the order the three answers come back in (one slot: the order they started)."""
    server.wait_idle()
    done: list[str] = []
    lock = threading.Lock()

    def send(name: str, path: str, body: dict) -> None:
        with server.client() as client:
            response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        with lock:
            done.append(name)

    queued = [("first", "/v1/completions", KEEP_GOING), ("second", "/v1/completions", KEEP_GOING),
              ("urgent", *_urgent(route))]
    threads = [threading.Thread(target=send, args=item) for item in queued]
    with server.client() as holder_client:
        with holder_client.stream("POST", "/v1/completions", json={**KEEP_GOING, "max_tokens": 1900,
                                                                      "stream": True}) as holder:
            lines = holder.iter_lines()  # kept: a dropped iterator closes the stream, which cancels the holder
            next(lines)  # it holds the slot
            for k, thread in enumerate(threads):
                thread.start()
                _wait_queued(server, k + 1)
    for thread in threads:
        thread.join(timeout=60)
    return done


@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_a_more_urgent_request_queued_last_takes_the_slot_first(priority_server, route):
    assert _finish_order(priority_server, route) == ["urgent", "first", "second"]


def test_under_fcfs_priority_changes_nothing(tiny_model):
    with _server(tiny_model, "fcfs") as server:
        assert _finish_order(server, "completions") == ["first", "second", "urgent"]


def test_an_unknown_schedule_policy_is_refused_at_startup(tiny_model):
    with pytest.raises(ValueError, match="schedule_policy"):
        with _server(tiny_model, "lifo"):
            pass
