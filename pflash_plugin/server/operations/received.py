"""When a request's headers reached the server: the mark its usage's `timings.prepare_ms` counts
from (to the engine's arrival: the body read, parsed and validated, the prompt rendered and
tokenized), the part of a client's TTFT that the engine's own `ttft_ms` leaves out (issue 48)."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send


class ReceivedAt:
    """ASGI middleware, ahead of the body's reading: stamps `scope["state"]["received"]` (time.perf_counter)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["received"] = time.perf_counter()
        await self.app(scope, receive, send)


def received(http: Request) -> float | None:
    """The request's mark, None where the app has no ReceivedAt (routers mounted elsewhere)."""
    return getattr(http.state, "received", None)
