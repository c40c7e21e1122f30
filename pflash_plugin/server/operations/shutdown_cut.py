"""Requests the HTTP server cuts at the end of its graceful shutdown answer as a shutdown should: a
503 when nothing was sent yet, an error event and a clean end when a stream had begun.

uvicorn cancels the tasks still running when `timeout_graceful_shutdown` runs out (a request still
being prepared or uploaded, a stream still writing), and answered what had not started with a 500
("Task cancelled, timeout graceful shutdown exceeded", issue 31). The engines' own cut at
--shutdown_grace_s is the usual case (dispatch.py: a 503 or an error event, counted where="engine");
this is the one past it, counted where="server", in `pflash_requests_cut_at_shutdown_total`.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from sse_starlette.sse import ServerSentEvent
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...engine.request import ErrorEvent, ErrorKind
from ...engine.scheduler import SHUTTING_DOWN
from ..wire.anthropic_errors import error_body as anthropic_error
from ..wire.anthropic_errors import under_messages
from ..wire.errors import error_response, http_of, route_path
from ..wire.protocol import error_body
from .metrics import Metrics

CUT = f"{SHUTTING_DOWN}: the request was cut at the end of its graceful shutdown"


class ShutdownCut:
    """ASGI middleware, outermost: a cancelled request's answer ends as a shutdown's. The route's
    presenter, once dispatch.py has one (`scope["state"]["presenter"]`), shapes it for its API."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent: dict[str, Any] = {}

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = message
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # answered here: the cancel is taken
                task.uncancel()
            if not sent.get("end"):
                self.metrics.cut_at_shutdown.labels("server").inc()
                await _answer(scope, receive, send, sent.get("start"))


async def _answer(scope: Scope, receive: Receive, send: Send, start: Message | None) -> None:
    """A 503 if no answer had started; an error event and the end of an SSE stream that had (any
    other answer under way is left as it is: the server closes its connection)."""
    event = ErrorEvent(ErrorKind.UNAVAILABLE, CUT)
    status, kind, code = http_of(event.kind)
    presenter = scope.get("state", {}).get("presenter")
    if start is None:
        if presenter is not None:
            response = presenter.error(event)
        elif under_messages(route_path(scope)):  # still being prepared: no presenter yet, but its API is known
            response = JSONResponse(anthropic_error(status, CUT), status)
        else:
            response = error_response(status, CUT, kind, code=code)
        await response(scope, receive, send)
        return
    if b"text/event-stream" not in dict(start.get("headers", [])).get(b"content-type", b""):
        return
    items = presenter.stream_error(event) if presenter is not None else [
        {"data": json.dumps(error_body(CUT, kind, code=kind))}]
    for item in items:
        await send({"type": "http.response.body", "body": ServerSentEvent(**item, sep="\n").encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
