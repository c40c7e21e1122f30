"""A request with a large body waits, a bounded time, before its body is read, while a request with a
small body is between its headers and its engine or a first token is a step away
(server/operations/small_first.py); not at all with the bound at 0."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx

from pflash_plugin.server.operations.small_first import SmallFirst

from conftest import live_server

SMALL = 120  # a Content-Length


def test_a_large_body_waits_until_the_small_ones_have_left_and_no_longer_than_its_bound():
    async def run() -> None:
        gate, idle = SmallFirst(), lambda: False
        small: dict[str, object] = {}
        assert not gate.enter(small, SMALL)  # counted, and not one that waits
        assert gate.enter({}, 200_000)  # a large one: waits
        assert not gate.enter({}, None)  # a chunked body: neither
        assert gate.pending == 1
        asyncio.get_running_loop().call_later(0.3, gate.leave, small)
        start = time.perf_counter()
        await gate.after_small(3.0, idle)
        assert 0.25 <= time.perf_counter() - start < 2.0  # until the small one left
        gate.leave(small)  # twice: counted once
        assert gate.pending == 0
        step = {"first_token_next": True}  # none pending, a first token a step away: until its step is done
        asyncio.get_running_loop().call_later(0.3, step.update, {"first_token_next": False})
        start = time.perf_counter()
        await gate.after_small(3.0, lambda: step["first_token_next"])
        assert 0.25 <= time.perf_counter() - start < 2.0
        gate.enter({}, SMALL)  # one that never leaves: the bound
        start = time.perf_counter()
        await gate.after_small(0.3, idle)
        assert 0.25 <= time.perf_counter() - start < 2.0
        start = time.perf_counter()
        await gate.after_small(0.0, lambda: True)  # off
        assert time.perf_counter() - start < 0.1
    asyncio.run(run())


def _withheld(port: int, body: bytes) -> socket.socket:
    """A small completion request whose headers are sent and whose body is not (yet)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    return sock


def test_over_http_a_large_body_waits_for_a_small_request_ahead_of_its_engine_and_a_first_token(tiny_server):
    ctx = tiny_server.app.state.pflash
    small = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    large = {"prompt": "hi", "max_tokens": 1, "user": "x" * 100_000}  # over 64 KB, prepared on the loop (no 2nd wait)
    with tiny_server.client() as client:
        def took(bound_ms: float, release_after_s: float | None, withheld: bool = True, door: bool = True) -> float:
            ctx.settings.polite_prepare_ms, ctx.settings.polite_door = bound_ms, door
            sock = _withheld(tiny_server.port, small) if withheld else None
            try:
                time.sleep(0.2)  # its headers read: it counts
                if sock and release_after_s is not None:
                    threading.Timer(release_after_s, sock.sendall, (small,)).start()
                start = time.perf_counter()
                reply = client.post("/v1/completions", json=large)
                assert reply.status_code == 200, reply.text
                return time.perf_counter() - start
            finally:
                if sock:
                    sock.close()
        activity = ctx.models.get(None).engine.activity
        try:
            held = took(1000.0, None)  # the small one never sends its body: the bound
            released = took(3000.0, 0.3)  # it does, 0.3 s on: the large one goes once its engine has it
            off = took(0.0, None)
            closed = took(1000.0, None, door=False)  # --polite_door false (the default): no wait at the door
            activity.first_token_next = lambda: True  # as if a first token were always a step away
            flagged = took(600.0, None, withheld=False)
        finally:
            del activity.first_token_next
            ctx.settings.polite_prepare_ms, ctx.settings.polite_door = 100.0, False
    assert held >= 1.0 and 0.3 <= released < 2.5 and off < 0.8 and closed < 0.8 and flagged >= 0.6


def test_a_small_request_counts_until_its_engine_has_it_even_queued_for_a_slot(tiny_model):
    """One queued behind a running request is not worth a large body's wait: it counts until the
    engine has taken it, and its first token is not a step away."""
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 4096, "max_concurrency": 1, "max_queue": 4,
             "n_threads": 1, "n_threads_batch": 1}
    with live_server([model]) as server:
        ctx = server.app.state.pflash
        long = {"prompt": "hi", "max_tokens": 4000, "min_tokens": 4000, "stream": True}
        small = {"prompt": "hi", "max_tokens": 2, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the stream, which cancels it
                assert next(line for line in lines if line.startswith("data: {"))  # it holds the one slot
                first: list[float] = []

                def queued() -> None:
                    with client.stream("POST", "/v1/completions", json=small) as reply:
                        next(line for line in reply.iter_lines() if line.startswith("data: {"))
                        first.append(time.perf_counter())
                behind = threading.Thread(target=queued)
                behind.start()
                deadline = time.time() + 10
                while server.status()["waiting"] == 0 and time.time() < deadline:
                    time.sleep(0.01)
                assert server.status()["waiting"] == 1  # queued for the slot
                assert ctx.small_first.pending == 0 and not ctx.first_token_next()
            behind.join(30)  # the long one's stream closed: cancelled, the slot is the small one's
            assert first and ctx.small_first.pending == 0
