"""OpenAI-shaped errors, carried by the routes themselves (a route class), so that the routers
answer the same way in our app and in any app they are mounted into: an invalid body is a 400
`invalid_request_error` naming the field, never FastAPI's 422."""
from __future__ import annotations

from typing import Any, Callable, Coroutine, Iterator

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from .protocol import RequestError, error_body


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


def validation_error_response(error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", "invalid_request_error")
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = first.get("msg", "invalid request")
    return error_response(400, f"{field}: {message}" if field else message, "invalid_request_error", field)


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string of a JSON value (dict keys too) with the dotted path of its field."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield path, key
            yield from _strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}.{i}" if path else str(i))


# Deeper than any OpenAI body (a JSON schema of 30 nested objects is ~64 deep), far below where
# Python's parser and the recursive code after it run out of stack (~1,000).
MAX_JSON_DEPTH = 128


def deeper_than(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests lists and objects over `limit` deep (iteratively)."""
    todo = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def unencodable_field(body: Any) -> str | None:
    """The first field holding text that UTF-8 cannot encode (JSON lets a lone surrogate such as
    "\\udcff" through; llama.cpp takes bytes), as a dotted path; None if all text is fine."""
    for path, text in _strings(body, ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    return None


async def _body_error(request: Request) -> Response | None:
    """A 400 for a JSON body nested too deep, or holding text that cannot be encoded; checked
    before FastAPI parses the body (the parsed JSON is cached on the request and reused). A body
    that is not JSON is left to FastAPI's own error."""
    if "json" not in request.headers.get("content-type", "json"):
        return None
    def too_deep() -> Response:
        return error_response(400, f"the body nests JSON over {MAX_JSON_DEPTH} levels deep", "invalid_request_error")

    try:
        body = await request.json() if await request.body() else None
    except ClientDisconnect:  # gone before its body arrived (or closed for taking too long)
        return Response(status_code=499)
    except RecursionError:  # Python's parser ran out of stack: deeper still
        return too_deep()
    except ValueError:
        return None
    if deeper_than(body, MAX_JSON_DEPTH):
        return too_deep()
    field = unencodable_field(body)
    if field is None:
        return None
    message = f"{field}: the text is not valid Unicode (a lone surrogate cannot be encoded as UTF-8)"
    return error_response(400, message, "invalid_request_error", field)


class OpenAIRoute(APIRoute):
    """Turns validation errors, RequestError and HTTPException into OpenAI error bodies, and
    refuses bodies nested too deep or with text that cannot be encoded before anything reads them."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            refused = await _body_error(request)
            if refused is not None:
                return refused
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
