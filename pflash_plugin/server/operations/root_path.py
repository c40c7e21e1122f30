"""`--root_path` as stock's `FastAPI(root_path=...)` applies it, without that parameter (FastAPI
0.165 warns that it is deprecated: its removal would stop the server at start). FastAPI's own `__call__` sets the
scope's root_path before anything else runs: this middleware, outermost, does the same, so a route
answers at `/api/v1/models` (a proxy that keeps the prefix) and at `/v1/models` (one that strips it),
and the OpenAPI page lists the prefix as its server, as stock's do."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class RootPath:
    """ASGI middleware: the scope's root_path is `root_path` for HTTP and WebSocket requests."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope["root_path"] = self.root_path
        await self.app(scope, receive, send)
