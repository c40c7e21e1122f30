"""The server layer: routers mounted into another FastAPI app, and cancellation when a client
leaves (non-streamed, and streamed before its SSE generator starts): slots and pages come back."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI

from conftest import LiveServer, _free_port, live_server

LONG = 3500  # tokens "keep going" decodes greedily on the tiny model (no end of generation before)


@pytest.fixture(scope="module")
def roomy_server(tiny_model):
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 4096, "max_concurrency": 2, "n_threads": 1,
             "n_threads_batch": 1}
    with live_server([model]) as server:
        yield server


def assert_back_to_idle(server: LiveServer, before: dict) -> None:
    """Idle again, fewer steps after `before` (an idle /status) than the request would have run to
    its end (so it was cancelled, however fast the machine), and no pages left behind."""
    status = server.wait_idle(timeout=120)
    assert status["running"] == 0 and status["waiting"] == 0, status
    assert status["steps"] - before["steps"] < LONG, "the request ran to its end: it was never cancelled"
    idle_pages = before["kv_pages_used"]
    cached_pages = sum(-(-s["kv_tokens"] // status["kv_page_size"]) for s in status["slots"])
    assert status["kv_pages_used"] <= idle_pages + cached_pages, status


def test_non_streamed_request_is_cancelled_when_its_client_gives_up(roomy_server):
    before = roomy_server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        with roomy_server.client(timeout=0.5) as client:
            client.post("/v1/completions", json={"prompt": "keep going", "max_tokens": LONG, "temperature": 0})
    assert_back_to_idle(roomy_server, before)


async def _post_and_leave(app, body: dict) -> None:
    """Drive the app as an ASGI server would for a client that sends its request and is gone at
    once; `send` yields (as a server's does under back-pressure), so the disconnect is seen before
    the SSE generator gets its first turn."""
    payload = json.dumps(body).encode()
    pending = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        return pending.pop() if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(0.01)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    await asyncio.sleep(0.5)  # keep this loop alive while the engine reports the cancel to it


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_before_the_first_byte_is_cancelled(roomy_server, stream):
    before = roomy_server.wait_idle()
    body = {"prompt": "keep going", "max_tokens": LONG, "temperature": 0, "stream": stream}
    asyncio.run(_post_and_leave(roomy_server.app, body))
    assert_back_to_idle(roomy_server, before)
    with roomy_server.client() as client:
        assert client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3}).status_code == 200


def test_routers_mount_into_another_app(tiny_model):
    from pflash_plugin.server.composition.app import ROUTERS
    from pflash_plugin.server.runtime.context import ServerContext, attach
    from pflash_plugin.server.runtime.models import ModelRegistry
    from pflash_plugin.server.config.settings import ModelSettings, ServerSettings

    host = FastAPI()

    @host.get("/own")
    async def own() -> dict:
        return {"mine": True}

    models = ModelRegistry([ModelSettings(model=str(tiny_model), model_alias="tiny", n_ctx=256, max_concurrency=2,
                                          n_threads=1, n_threads_batch=1, verbose=False)])
    attach(host, ServerContext.build(ServerSettings(), models))
    for router in ROUTERS:
        host.include_router(router, prefix="/llm")
    server = LiveServer(host, _free_port()).start()
    try:
        with server.client() as client:
            assert client.get("/own").json() == {"mine": True}
            reply = client.post("/llm/v1/completions", json={"prompt": "mounted", "max_tokens": 4})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            chat = client.post(
                "/llm/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
            )
            assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
            bad = client.post("/llm/v1/completions", json={"prompt": "x", "top_p": 9})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"  # the routes carry their errors
            assert client.get("/llm/status").json()["models"]["tiny"]["running"] == 0
    finally:
        server.stop()
        models.close()


def test_engine_events_reach_the_loop_once_per_step_and_in_order():
    """A step's events (one per running request) wake the event loop once, at the step's flush."""
    import asyncio
    import threading

    from pflash_plugin.server.output.dispatch import _Mailbox

    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wakeups
            wakeups += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        box, queue = _Mailbox(loop), asyncio.Queue()

        def step(items: range) -> None:  # what Scheduler.emit does with sinks and flushes
            for i in items:
                box.stage(queue, i)
                box.wake() if i == items[-1] else None

        for items in (range(50), range(50, 60)):
            engine = threading.Thread(target=step, args=(items,))
            engine.start()
            engine.join()
            await asyncio.sleep(0.01)  # the loop runs the hand-over
        box.wake()  # nothing staged: no wake-up
        return [queue.get_nowait() for _ in range(queue.qsize())], wakeups

    got, wakeups = asyncio.run(main())
    assert got == list(range(60)) and wakeups == 2
