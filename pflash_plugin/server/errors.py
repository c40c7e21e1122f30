"""OpenAI-shaped errors, carried by the routes themselves (a route class), so that the routers
answer the same way in our app and in any app they are mounted into: an invalid body is a 400
`invalid_request_error` naming the field, never FastAPI's 422."""
from __future__ import annotations

from typing import Any, Callable, Coroutine

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.responses import Response

from .protocol import RequestError, error_body


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


def validation_error_response(error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", "invalid_request_error")
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = first.get("msg", "invalid request")
    return error_response(400, f"{field}: {message}" if field else message, "invalid_request_error", field)


class OpenAIRoute(APIRoute):
    """Turns validation errors, RequestError and HTTPException into OpenAI error bodies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as error:
                return validation_error_response(error)
            except RequestError as error:
                return error_response(error.status, error.message, error.type, error.param, error.code)
            except HTTPException as error:
                kind = "authentication_error" if error.status_code == 401 else "invalid_request_error"
                return JSONResponse(error_body(str(error.detail), kind), error.status_code, headers=error.headers)

        return route
