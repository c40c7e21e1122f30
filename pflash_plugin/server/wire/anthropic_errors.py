"""Anthropic's error shape, for its routes and for the answers given outside them (the API key and
body-size middleware, unknown paths) under its path."""
from __future__ import annotations

from typing import Any

PATH_PREFIX = "/v1/messages"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def under_messages(path: str) -> bool:
    """Whether a route path is the Messages API's, whose clients read Anthropic's error shape."""
    return path.startswith(PATH_PREFIX)
