"""When a request's headers reached the server: the mark its usage's `timings.prepare_ms` counts
from (to the engine's arrival: the body read, parsed and validated, the prompt rendered and
tokenized), the part of a client's TTFT that the engine's own `ttft_ms` leaves out (issue 48)."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ReceivedAt:
    """ASGI middleware, ahead of the body's reading: stamps `scope["state"]["received"]` (time.perf_counter)
    and, as its last part is read, `scope["state"]["body_read"]` (a media request's preparation
    splits its time there: the upload, then the parse)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["received"] = time.perf_counter()

        async def marked() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                state.setdefault("body_read", time.perf_counter())
            return message

        await self.app(scope, marked, send)


def received(http: Request) -> float | None:
    """The request's mark, None where the app has no ReceivedAt (routers mounted elsewhere)."""
    return getattr(http.state, "received", None)


def body_read(http: Request) -> float | None:
    """When the body's last part was read, None where the app has no ReceivedAt."""
    return getattr(http.state, "body_read", None)
