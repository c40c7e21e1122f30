"""Each way the engine refuses or fails a request has one HTTP answer (server/wire/errors.py http_of):
the statuses and OpenAI error types clients have always seen (the HTTP tests check them end to end)."""
from pflash_plugin.engine.request import ErrorKind
from pflash_plugin.server.wire.errors import http_of


def test_every_kind_has_its_status_and_type():
    assert {kind: tuple(http_of(kind)) for kind in ErrorKind} == {
        ErrorKind.INVALID: (400, "invalid_request_error", "invalid_request_error"),
        ErrorKind.TOO_LONG: (400, "invalid_request_error", "context_length_exceeded"),
        ErrorKind.BUSY: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
        ErrorKind.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
        ErrorKind.FAILED: (500, "server_error", "server_error"),
        ErrorKind.MODEL_FAILED: (503, "server_error", "server_error"),
    }
