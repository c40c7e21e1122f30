"""The error a request's checks raise after validation (the routes answer it in their API's shape)."""
from __future__ import annotations


class RequestError(Exception):
    """A bad request caught after validation: becomes an OpenAI error body. `counted`: already in
    pflash_errors_total (a model's refusal is counted where it is made)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, counted: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.counted = counted
