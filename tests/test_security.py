"""API key on every private route, public routes by setting, and the request-body limit (real server)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import pytest
from starlette.routing import Route

from conftest import LiveServer, live_server

KEY = "sekret-key"
LIMIT = 4096  # bytes of body


@pytest.fixture(scope="module")
def keyed_server(tiny_model) -> Iterator[LiveServer]:
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 256, "max_concurrency": 2, "n_threads": 1,
             "n_threads_batch": 1}
    with live_server([model], api_key=KEY, public_routes=["/docs"], max_body_bytes=LIMIT) as server:
        yield server


def routes(server: LiveServer) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, FastAPI's own (/docs, /openapi.json...) included."""
    def walk(items):  # FastAPI keeps an included router as one entry: its routes are inside
        for r in items:
            if isinstance(r, Route):
                yield r
            elif hasattr(r, "original_router"):
                yield from walk(r.original_router.routes)

    return [(sorted(r.methods - {"HEAD"})[0], r.path) for r in walk(server.app.routes)]


def assert_401(response) -> None:
    """A 401 in the shape of the path's API: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    assert response.status_code == 401, (response.request.method, response.request.url, response.status_code)
    body = response.json()
    error = body["error"]
    if response.request.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and error["type"] == "authentication_error" and error["message"]
    else:
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key" and error["message"]
    assert response.headers["www-authenticate"] == "Bearer"


def test_every_private_route_needs_the_key(keyed_server):
    private = [(m, p) for m, p in routes(keyed_server) if p not in ("/health", "/docs")]
    expected = {"/status", "/metrics", "/openapi.json", "/redoc", "/v1/models", "/v1/completions"}
    assert expected <= {p for _, p in private}
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
             {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}, {"x-api-key": f"{KEY}x"},
             {"x-api-key": f"Bearer {KEY}"}]
    with keyed_server.client() as client:
        for method, path in private + [("GET", "/no/such/route")]:
            for headers in wrong:
                assert_401(client.request(method, path, headers=headers, json={}))
        for method, path in private:
            response = client.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, json={})
            # 501: a llama-server feature not served here says so (POST /slots/{id}), as llama-server does
            assert response.status_code != 401 and (response.status_code < 500 or response.status_code == 501), (
                method, path, response.status_code)
            if method == "GET" and "{" not in path:  # a templated path is a request for the name "{...}"
                assert response.status_code == 200, path
        ok = client.post("/v1/completions", headers={"Authorization": f"bearer {KEY}"},
                         json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        # Anthropic's clients send the key as x-api-key: taken on every route
        message = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for path, body in [("/v1/messages", message), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})]:
            ok = client.post(path, headers={"x-api-key": KEY}, json=body)
            assert ok.status_code == 200, (path, ok.text)


def test_public_routes_need_no_key(keyed_server):
    with keyed_server.client() as client:
        assert client.get("/health").status_code == 200  # always public, though not in public_routes
        assert client.get("/docs").status_code == 200  # configured public
        assert_401(client.get("/openapi.json"))  # not configured


def test_each_route_can_be_made_public(tiny_model):
    public = ["/status", "/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"]
    model = {"model": str(tiny_model), "n_ctx": 128, "max_concurrency": 1, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model], api_key=KEY, public_routes=public) as server, server.client() as client:
        for path in public:
            assert client.get(path).status_code == 200, path
        assert_401(client.post("/extras/tokenize", json={"input": "hi"}))  # the rest stay private


def test_cors_preflight_passes_and_401_carries_cors_headers(keyed_server):
    origin = {"Origin": "https://example.org"}
    with keyed_server.client() as client:
        preflight = client.options("/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                                 "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"]
        denied = client.get("/status", headers=origin)
        assert_401(denied)
        assert denied.headers["access-control-allow-origin"]


def test_cors_never_sends_credentials_to_any_origin(keyed_server, tiny_model):
    """Issue 22: every Origin was echoed with Access-Control-Allow-Credentials: true, 401s and
    preflights included. By default any origin may call, without credentials; listed origins get
    them, others nothing; an empty list sends no CORS headers."""
    evil = {"Origin": "https://evil.example"}
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with keyed_server.client() as client:
        for response in (client.get("/status", headers=evil), client.options("/v1/completions",
                                                                              headers={**evil, **preflight})):
            assert response.headers["access-control-allow-origin"] == "*"
            assert "access-control-allow-credentials" not in response.headers
    model = {"model": str(tiny_model), "n_ctx": 128, "max_concurrency": 1, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model], cors_origins=["https://app.example"]) as server, server.client() as client:
        listed = client.get("/health", headers={"Origin": "https://app.example"})
        assert listed.headers["access-control-allow-origin"] == "https://app.example"
        assert listed.headers["access-control-allow-credentials"] == "true"
        other = client.options("/v1/completions", headers={**evil, **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with live_server([model], cors_origins=[]) as server, server.client() as client:
        assert not [h for h in client.get("/health", headers=evil).headers if h.startswith("access-control")]


def test_oversized_body_gets_413_with_and_without_content_length(keyed_server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = b'{"prompt": "' + b"a" * LIMIT + b'", "max_tokens": 1}'

    def chunked():  # no Content-Length: the server must count
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    with keyed_server.client() as client:
        declared = client.post("/v1/completions", headers=auth, content=body)
        streamed = client.post("/v1/completions", headers=auth, content=chunked())
        assert "content-length" not in streamed.request.headers
        assert streamed.request.headers["transfer-encoding"] == "chunked"
        for response in (declared, streamed):
            assert response.status_code == 413
            error = response.json()["error"]
            assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]
        small = b'{"prompt": "' + b"a " * 100 + b'", "max_tokens": 1}'
        for content in (small, iter([small[:50], small[50:]])):  # under the limit, both ways
            response = client.post("/v1/completions", headers=auth, content=content)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1
        assert_401(client.post("/v1/completions", content=body))  # the key is checked before the body is read


def test_public_routes_setting_is_validated():
    from pflash_plugin.server.config.settings import ServerSettings

    with pytest.raises(ValueError, match="must be a path"):
        ServerSettings(public_routes=["docs"])


def test_public_routes_match_behind_a_root_path(tiny_model):
    """With root_path (a proxy prefix), /api/health is /health to the routes: public; /api/status is not.
    Set as stock's FastAPI(root_path=...) set it, without that deprecated parameter (operations/root_path.py):
    the prefixed and the bare path both answer, and the OpenAPI page names the prefix."""
    model = {"model": str(tiny_model), "n_ctx": 128, "max_concurrency": 1, "n_threads": 1, "n_threads_batch": 1}
    with contextlib.ExitStack() as stack:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*root_path")  # FastAPI's deprecation of its parameter
            server = stack.enter_context(live_server([model], api_key=KEY, root_path="/api"))
        client = stack.enter_context(server.client())
        assert client.get("/api/health").status_code == 200
        assert client.get("/health").status_code == 200  # a proxy that strips the prefix
        assert_401(client.get("/api/status"))
        authorized = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/api/status", headers=authorized).status_code == 200
        assert client.get("/api/openapi.json", headers=authorized).json()["servers"] == [{"url": "/api"}]
