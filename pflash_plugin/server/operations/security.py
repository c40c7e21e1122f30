"""API key and request-size limits, as ASGI middleware.

Middleware rather than per-route dependencies: it also guards the routes that FastAPI adds itself
(/docs, /redoc, /openapi.json), any route added later, and unknown paths, so a route is private
unless it is listed public. It sits inside the CORS middleware, so that browser preflights are
answered and the 401/413 responses carry CORS headers.
"""
from __future__ import annotations

import hmac
from typing import Iterable

from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config.settings import ServerSettings
from ..wire import anthropic_errors
from ..wire.errors import route_path
from ..wire.protocol import error_body

ALWAYS_PUBLIC = frozenset({"/health"})


def install_security(app: FastAPI, settings: ServerSettings) -> None:
    """Add the API key check (when `api_key` is set) and the body-size limit, innermost of the user
    middleware: the key is checked before a body is read, the body is bounded before a route reads it."""
    if app.middleware_stack is not None:
        raise RuntimeError("install_security must run before the app starts")
    if settings.api_key is not None:
        public = ALWAYS_PUBLIC | set(settings.public_routes)
        app.user_middleware.append(Middleware(ApiKeyMiddleware, api_key=settings.api_key, public_paths=public))
    app.user_middleware.append(Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes))


async def _reject(scope: Scope, receive: Receive, send: Send, status: int, message: str, type_: str, code: str,
                  headers: dict[str, str] | None = None) -> None:
    """An error in the shape of the API the path belongs to: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    anthropic = anthropic_errors.under_messages(route_path(scope))
    body = anthropic_errors.error_body(status, message) if anthropic else error_body(message, type_, None, code)
    await JSONResponse(body, status, headers=headers)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes:
    """The first value of a header (as the routes read it), or empty."""
    return next((value for key, value in scope["headers"] if key == name), b"")


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>` (the scheme of stock llama_cpp.server) or
    `x-api-key: <api_key>` (Anthropic's), compared in constant time; the paths in `public_paths`
    are answered without it."""

    def __init__(self, app: ASGIApp, api_key: str, public_paths: Iterable[str]) -> None:
        self.app, self.key, self.public = app, api_key.encode("utf-8"), frozenset(public_paths)

    def authorized(self, scope: Scope) -> bool:
        scheme, _, credentials = _header(scope, b"authorization").partition(b" ")
        # compare_digest even when the scheme is wrong: the time taken says nothing about the key
        bearer = hmac.compare_digest(credentials, self.key) & (scheme.lower() == b"bearer")
        # Anthropic's clients send the key as x-api-key
        return hmac.compare_digest(_header(scope, b"x-api-key"), self.key) | bearer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self.public or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        await _reject(scope, receive, send, 401,
                      "Invalid API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                      "authentication_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: by its Content-Length before reading it, and by counting while
    reading a body that declares no length (chunked). The body is read here and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.too_large(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self.too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _reject(scope, receive, send, 413,
                      f"request body over {self.max_bytes} bytes (the server's max_body_bytes)",
                      "invalid_request_error", "request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands over the body already read, then the client's later messages (disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
