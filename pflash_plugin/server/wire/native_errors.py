"""llama-server's error shape for its own routes (server-common.cpp, format_error_response):
{"error": {"code": 400, "message": ..., "type": "invalid_request_error"}}: its clients read the
status as `code`, a number, where OpenAI's is a string or null. The field a 400 is about stays in
`param` too, as on our other routes."""
from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from .errors import OpenAIRoute


def native_error(response: Response) -> Response:
    """An OpenAI error response in llama-server's shape; any other response as it is."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    error = json.loads(bytes(response.body)).get("error")
    if not isinstance(error, dict):
        return response
    body = {"code": response.status_code, "message": error.get("message", ""),
            "type": error.get("type", "invalid_request_error"), "param": error.get("param")}
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse({"error": body}, response.status_code, headers=headers)


class NativeRoute(OpenAIRoute):
    """OpenAIRoute's checks and counting, its errors in llama-server's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return native_error(await handler(request))

        return route
