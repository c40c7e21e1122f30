"""OpenAI-shaped errors, carried by the routes themselves (a route class), so that the routers
answer the same way in our app and in any app they are mounted into: an invalid body is a 400
`invalid_request_error` naming the field, never FastAPI's 422. Every error a route answers is
counted in pflash_errors_total. An unknown path or method gets OpenAI's shape too (`http_error`,
the app's handler)."""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Coroutine, Iterator, NamedTuple, Sequence

import orjson
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Scope

from ...engine.request import ErrorEvent, ErrorKind, Event, FinishEvent
from ...engine.scheduler import SHUTTING_DOWN
from .anthropic_errors import error_body as anthropic_error
from .anthropic_errors import under_messages
from .offload import offload
from .protocol import RequestError, error_body


def route_path(scope: Scope) -> str:
    """The path as the routes see it: without the app's root_path prefix."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class HttpError(NamedTuple):
    status: int
    type: str  # OpenAI's error type; Anthropic's follows from the status
    code: str  # OpenAI's error code


# The one place where the engine's reasons (a refusal, a request that failed) become HTTP: every
# route, presenter, metric label and the shutdown cut read them here. A prompt over the context is
# OpenAI's invalid_request_error with code context_length_exceeded.
_HTTP: dict[ErrorKind, HttpError] = {
    ErrorKind.INVALID: HttpError(400, "invalid_request_error", "invalid_request_error"),
    ErrorKind.TOO_LONG: HttpError(400, "invalid_request_error", "context_length_exceeded"),
    ErrorKind.BUSY: HttpError(429, "rate_limit_exceeded", "rate_limit_exceeded"),
    ErrorKind.UNAVAILABLE: HttpError(503, "service_unavailable", "service_unavailable"),
    ErrorKind.FAILED: HttpError(500, "server_error", "server_error"),
    ErrorKind.MODEL_FAILED: HttpError(503, "server_error", "server_error"),
}


def http_of(kind: ErrorKind) -> HttpError:
    """The HTTP status and error type a client gets for an engine error of this kind."""
    return _HTTP[kind]


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


_JSON_KINDS = {type(None): "null", str: "a string", list: "an array", int: "a number", float: "a number",
               bool: "a boolean"}


def validation_error_response(error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", "invalid_request_error")
    if tuple(first.get("loc", ())) == ("body",):  # the body as a whole: none, or not an object
        kind = _JSON_KINDS.get(type(error.body), "another value")
        sent = "none was sent" if first.get("type") == "missing" else f"got {kind}"
        return error_response(400, f"the body must be a JSON object ({sent})", "invalid_request_error")
    field, message = validation_message(error.errors(), error.body, skip=("body",))
    return error_response(400, f"{field}: {message}" if field else message, "invalid_request_error", field)


def validation_message(errors: Sequence[Any], body: Any, skip: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """The first validation error as the client's field and what it should be: the field's path
    in the client's body, without pydantic's names of union members (`literal['none','auto']`,
    `str`, a message's role tag), and what each member wanted, joined ("a valid string or a valid
    list"). Where a union member's error reaches deeper into that field as sent, it is the one
    the client's shape chose (content sent as a list of parts: its part's `text`, not "a valid
    string" for the whole content)."""
    fields = [client_field(e.get("loc", ()), body, e.get("type") == "missing", skip) for e in errors]
    field = fields[0] if fields else None
    for deeper in fields:
        if field is not None and deeper is not None and deeper.startswith(field + ".") \
                and deeper.count(".") > field.count("."):
            field = deeper
    wants = [_INSTANCE_OF.sub("", str(e.get("msg", "invalid"))) for e, at in zip(errors, fields) if at == field]
    unique = list(dict.fromkeys(wants or ["invalid request"]))
    said = unique[:1] + [w.removeprefix("Input should be ") for w in unique[1:]]
    return field, " or ".join(said)


_INSTANCE_OF = re.compile(r" or instance of \w+")  # pydantic's "a valid dictionary or instance of ContentPart"


def client_field(loc: Sequence[Any], body: Any, missing: bool, skip: tuple[str, ...] = ()) -> str | None:
    """A validation error's location as the client's dotted field: the keys and indexes found in
    the body; the others are pydantic's labels of union members, left out (a missing field, the
    last part, is kept)."""
    parts: list[str] = []
    value = body
    path = [p for p in loc if p not in skip]
    for i, part in enumerate(path):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif not (missing and i == len(path) - 1):
            continue
        parts.append(str(part))
    return ".".join(parts) or None


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
            if isinstance(item, _HOLDS_TEXT):  # a prompt of token ids holds none: 22K ints took 12 ms
                yield from _strings(item, f"{path}.{i}" if path else str(i))


_HOLDS_TEXT = (str, dict, list)


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
            todo += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
                     if isinstance(child, (dict, list))]  # not each token id of a prompt (22K ints: 10 ms)
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


# the start of a \uD800-\uDFFF escape, searched for only where the body has a backslash at all
# (memchr: 4 us on a 450 KB image body, where `b"\ud" in raw` took 0.3 ms, and as much for "\uD")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD]")


def may_hold_lone_surrogate(raw: bytes) -> bool:
    """Whether a JSON body may decode to a lone surrogate: through a \\uD800-\\uDFFF escape, or
    raw bytes json.loads lets through ('surrogatepass'): UTF-8's surrogate range begins with 0xED,
    and UTF-16 or UTF-32 JSON holds zero bytes. False for plain token ids and most text."""
    return b"\xed" in raw or b"\x00" in raw or b"\\" in raw and _SURROGATE_ESCAPE.search(raw) is not None


COUNT_WINDOW = 512  # bytes more_than counts from a found one


def more_than(raw: bytes, chars: bytes, limit: int) -> bool:
    """Whether `raw` holds over `limit` of `chars` (single bytes): each found with find (memchr)
    and counted from there a window at a time, so that sparse ones (an image's base64) cost a few
    finds and dense ones (a prompt's token ids) a few counts: bytes.count of two brackets over a
    whole 450 KB image body took 0.25 ms of the event loop, a find per comma of 22K token ids 0.19."""
    seen = 0
    for char in chars:
        at = raw.find(char)
        while at >= 0:
            seen += raw.count(char, at, at + COUNT_WINDOW)
            if seen > limit:
                return True
            at = raw.find(char, at + COUNT_WINDOW)
    return False


class BodyRefused(Exception):
    """A JSON body refused by its checks (a 400): nested too deep, or holding text UTF-8 cannot encode."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def loads(raw: bytes) -> Any:
    """The body's JSON as json.loads reads it, through orjson where orjson can: 0.57 ms against 1.63
    for a prompt of 22K token ids on 2 CPU cores, time the parse holds the GIL from the engine thread
    (issue 48). orjson refuses some of what json.loads takes (NaN, 1e400, lone surrogates, UTF-16,
    over 1024 levels); those are read by json.loads, so its value and its error are the answer. The
    one difference that parses: an integer past 64 bits is read as a float (a seed that large is
    rounded to a float's 53 bits, the same for every such request; an id or a count that large is a
    400 either way)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def checked_json(raw: bytes) -> Any:
    """The body's JSON once it passes the checks (BodyRefused if not; ValueError where it is not
    JSON): one piece of CPU work, run on the event loop or a worker thread as a whole."""
    try:
        body = loads(raw)
    except RecursionError:  # Python's parser ran out of stack: deeper still
        raise BodyRefused(f"the body nests JSON over {MAX_JSON_DEPTH} levels deep") from None
    # the walks only where the raw bytes allow a find: a prompt of 22K token ids cost 8 ms of the
    # event loop, which every request behind it waited out
    if more_than(raw, b"[{", MAX_JSON_DEPTH) and deeper_than(body, MAX_JSON_DEPTH):
        raise BodyRefused(f"the body nests JSON over {MAX_JSON_DEPTH} levels deep")
    field = unencodable_field(body) if may_hold_lone_surrogate(raw) else None
    if field is not None:
        raise BodyRefused(f"{field}: the text is not valid Unicode (a lone surrogate cannot be encoded as UTF-8)",
                          field)
    return body


LOOP_PARSE_BYTES = 64 * 1024  # a body over this is parsed (and checked) on a worker thread, unless
LOOP_PARSE_VALUES = 1024  # it holds no more values than this (commas): an image's base64, one long string


def parsed_on_loop(raw: bytes) -> bool:
    """Whether a body is parsed on the event loop: a small one, or a large one of few values (an
    image in a data URL: 0.3 ms of json.loads for 450 KB). json.loads holds the GIL throughout,
    wherever it runs, so a thread frees the loop only for the Python after it, and each hop to a
    thread and back waits for the GIL (up to the 5 ms switch interval on a busy process): 32 image
    chats at once on 2 CPU cores spent 22 ms a request from their body read to the route with the
    hop, 2 ms without it (bench/vision.py's prepare_parse_ms, docs/vision.md)."""
    return len(raw) <= LOOP_PARSE_BYTES or not more_than(raw, b",", LOOP_PARSE_VALUES)


async def _parsed(request: Request, raw: bytes) -> Any:
    """The body's JSON, checked, kept on the request where FastAPI reads it (Starlette's
    Request.json caches it in `_json`). A large one of many values is parsed on a worker thread: on
    the event loop, mix8's 4 bodies of 22K token ids (1 ms each on 2 CPU cores) held back the short
    requests sent with them (issue 48)."""
    request._json = checked_json(raw) if parsed_on_loop(raw) else await offload(checked_json, raw)
    return request._json


async def _body_error(request: Request) -> Response | None:
    """A 400 for a JSON body nested too deep, or holding text that cannot be encoded; checked
    before FastAPI parses the body (the parsed JSON is cached on the request and reused). A body
    that is not JSON is left to FastAPI's own error. A body sent without a JSON Content-Type (curl's
    `-d` alone sends a form's) is a 400 saying so: FastAPI reads it as bytes, and its error said
    "Input should be a valid dictionary". It is not read as JSON anyway: a browser page of any
    origin may send text/plain or a form's type without asking CORS first."""
    kind = request.headers.get("content-type")
    try:
        raw = await request.body()
        if raw and (kind is None or "json" not in kind):
            return error_response(400, f"the body must be JSON, sent with Content-Type: application/json "
                                  f"(it came with {f'Content-Type: {kind}' if kind else 'no Content-Type'})",
                                  "invalid_request_error")
        if raw:
            await _parsed(request, raw)
    except ClientDisconnect:  # gone before its body arrived (or closed for taking too long)
        return Response(status_code=499)
    except BodyRefused as refused:
        return error_response(400, refused.message, "invalid_request_error", refused.param)
    except ValueError:
        return None
    return None


class OpenAIRoute(APIRoute):
    """Turns validation errors, RequestError and HTTPException into OpenAI error bodies, and
    refuses bodies nested too deep or with text that cannot be encoded before anything reads them."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            refused = await _body_error(request)
            if refused is not None:
                return await _counted(request, refused)
            try:
                return await handler(request)
            except RequestValidationError as error:
                return await _counted(request, validation_error_response(error))
            except RequestError as error:
                response = error_response(error.status, error.message, error.type, error.param, error.code)
                return response if error.counted else await _counted(request, response)
            except HTTPException as error:
                kind = "authentication_error" if error.status_code == 401 else "invalid_request_error"
                response = JSONResponse(error_body(str(error.detail), kind), error.status_code, headers=error.headers)
                return await _counted(request, response)

        return route


async def _counted(request: Request, response: Response) -> Response:
    """`response`, an error, counted in pflash_errors_total under the model the body names (its
    JSON is parsed already, or is not JSON); "unknown" when no served model has that name. A client
    that left (499) got no answer and is not counted."""
    ctx = getattr(request.app.state, "pflash", None)
    if ctx is None or response.status_code == 499:
        return response
    try:
        body = await request.json() if request.method == "POST" and await request.body() else None
    except (ValueError, RecursionError, ClientDisconnect):
        body = None
    name = body.get("model") if isinstance(body, dict) else None
    try:
        label = ctx.models.get(name if isinstance(name, str) else None).name
    except RequestError:
        label = "unknown"
    ctx.metrics.errors.labels(label, str(response.status_code)).inc()
    return response


async def http_error(request: Request, error: Exception) -> Response:
    """An unknown path (404) or method (405), or any other HTTP error outside the routes, in
    OpenAI's shape (as OpenAI words the 404) instead of Starlette's {"detail": ...}; in
    Anthropic's under /v1/messages."""
    assert isinstance(error, StarletteHTTPException)
    status = error.status_code
    if status == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif status == 405:
        allowed = (error.headers or {}).get("allow") or (error.headers or {}).get("Allow")
        message = f"Method {request.method} is not allowed for {request.url.path}" + (
            f" (allowed: {allowed})" if allowed else "")
    else:
        message = str(error.detail)
    if under_messages(route_path(request.scope)):
        return JSONResponse(anthropic_error(status, message), status, headers=error.headers)
    return JSONResponse(error_body(message, "invalid_request_error", code=None), status, headers=error.headers)


def client_event(event: Event) -> Event:
    """An engine event as the client sees it. A request the server cancelled (only a shutdown's
    grace running out does: a client that leaves sees nothing) ends as a 503 error, streamed or
    not: "cancelled" is no finish reason OpenAI or Anthropic clients know, and "stop" or "length"
    would pass the cut answer off as whole, where the SDKs raise on an error event."""
    if not isinstance(event, FinishEvent) or event.reason != "cancelled":
        return event
    message = f"{SHUTTING_DOWN}: the request was cut after {event.usage.completion_tokens} tokens"
    return ErrorEvent(ErrorKind.UNAVAILABLE, message)
