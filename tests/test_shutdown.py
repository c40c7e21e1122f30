"""SIGTERM on a real server process, ours (`python -m pflash_plugin.server`) and the patched stock
`python -m llama_cpp.server` serving through the plugin, both with --shutdown_grace_s: new
requests get 503 at once (the server still listens: /health says 503 until the drain is over), a
request that fits in the grace finishes, one that does not is cancelled and its stream ends
cleanly with an error event, and the process exits cleanly (compression thread stopped, models
freed) soon after."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from plugin_env import REPO, patched_llama_cpp

GRACE_S = 1.5
TIMEOUT_S = 60  # a bound on hangs, never a measure of speed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def health(url: str) -> int | str:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return "refused"


@pytest.fixture(params=["pflash_plugin.server", "llama_cpp.server"])
def server(request, tiny_model, tmp_path):
    module = request.param
    path = [str(REPO)]
    if module == "llama_cpp.server":  # the stock server, patched, serving through our plugin
        path.insert(0, str(patched_llama_cpp(tmp_path / "site")))
    port = free_port()
    log = (tmp_path / "server.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--model", str(tiny_model), "--port", str(port),
         "--n_ctx", "4096", "--max_concurrency", "2", "--n_threads", "1", "--n_threads_batch", "1",
         "--pflash", "auto", "--pflash_threshold", "64", "--shutdown_grace_s", str(GRACE_S)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: health(url) == 200 or proc.poll() is not None, "the server started")
        assert proc.poll() is None, "the server did not start"
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stream(url: str, max_tokens: int, out: dict) -> None:
    """A streamed completion; records the last finish_reason, an error event, or a dropped stream."""
    body = {"prompt": "The river", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                    elif event["choices"] and event["choices"][0].get("finish_reason"):
                        out["finish"] = event["choices"][0]["finish_reason"]
                    out["tokens"] = out.get("tokens", 0) + 1
                elif line == "data: [DONE]":
                    out["done"] = True
    except httpx.HTTPError as error:
        out["dropped"] = repr(error)


def test_sigterm_drains_finishes_or_cancels_then_exits(server):
    proc, url, log = server
    short, long = {}, {}
    threads = [threading.Thread(target=stream, args=(url, 60, short)),
               threading.Thread(target=stream, args=(url, 4000, long))]  # cannot finish in the grace
    for thread in threads:
        thread.start()
    wait_until(lambda: long.get("tokens", 0) >= 3 and short.get("tokens"), "both streams started")
    proc.send_signal(signal.SIGTERM)
    seen: list[int | str] = []
    wait_until(lambda: seen.append(health(url)) or seen[-1] != 200, "the server stopped admitting")
    # the server listens while it drains: a probe and new work get 503, not a refused connection
    late = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5).status_code
    assert seen[-1] == 503 and "error" not in long, (seen[-1], long)  # the long request still runs
    for thread in threads:
        thread.join(TIMEOUT_S)
    code = proc.wait(TIMEOUT_S)
    log.seek(0)
    output = log.read()
    assert late == 503
    assert short.get("finish") == "length" and short.get("done")  # finished inside the grace
    # cut at the grace, not left to run: an error event (no finish reason an OpenAI client knows
    # says "cut by a shutdown"), and its stream closed cleanly
    assert long.get("error", {}).get("code") == "service_unavailable" and "finish" not in long, long
    assert "shutting down" in long["error"]["message"] and "dropped" not in long, long
    assert code in (0, -signal.SIGTERM) and "Traceback" not in output, output[-2000:]


# ---- issue 31: what the HTTP server's own graceful-shutdown timeout cuts -------------------------
# In process, so that nothing drains the engines first (as a signal would): at the timeout uvicorn
# cancels the request's task, and answered with a 500 ("Task cancelled, timeout graceful shutdown
# exceeded") or dropped the stream.

class _Served:
    """The app on a loopback uvicorn whose graceful shutdown gives requests `timeout_s`."""

    def __init__(self, tiny_model, timeout_s: float) -> None:
        import uvicorn

        from pflash_plugin.server.composition.app import create_app
        from pflash_plugin.server.config.settings import ModelSettings, ServerSettings

        model = ModelSettings(model=str(tiny_model), n_ctx=4096, max_concurrency=2, n_threads=1, n_threads_batch=1)
        self.app = create_app(ServerSettings(shutdown_grace_s=0.2), [model])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=timeout_s)  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), "the in-process server started")

    def cut(self, who: str) -> float:
        return self.app.state.metrics.cut_at_shutdown.labels(who)._value.get()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT_S)
        self.app.state.models.close()


@pytest.fixture
def served(tiny_model):
    served = _Served(tiny_model, timeout_s=0.5)
    try:
        yield served
    finally:
        if served.thread.is_alive():
            served.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_request_still_uploading_at_the_servers_timeout_gets_a_503(served, path):
    """Not yet answered (its body still arriving, or still being prepared): a 503 naming the
    shutdown, not uvicorn's 500, in the shape of the path's API; counted."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                     + b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # the rest never comes
        time.sleep(0.2)
        threading.Thread(target=served.stop, daemon=True).start()
        answer = b""
        while b"\r\n\r\n" not in answer or b"}}" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer[:300]
    error = json.loads(body)["error"]
    kind = error["type"] if path == "/v1/messages" else error["code"]
    assert kind == ("overloaded_error" if path == "/v1/messages" else "service_unavailable"), error
    assert "graceful shutdown" in error["message"], error
    assert served.cut("server") == 1


def test_a_stream_still_running_at_the_servers_timeout_ends_with_an_error_event(served):
    """Streaming: an error event, then the end of the stream (no broken connection); counted."""
    out: dict = {}
    reader = threading.Thread(target=stream, args=(served.url, 4000, out))
    reader.start()
    wait_until(lambda: out.get("tokens", 0) >= 3, "the stream started")
    served.stop()
    reader.join(TIMEOUT_S)
    assert "dropped" not in out and "finish" not in out, out
    assert out["error"]["code"] == "service_unavailable" and "graceful shutdown" in out["error"]["message"], out
    assert served.cut("server") == 1


def test_requests_the_engine_cuts_at_the_grace_are_counted(served):
    """The usual cut (the engines' grace ends first): an error event, counted where=engine, while a
    request the client itself left is not counted as cut."""
    gone = {"prompt": "The river", "max_tokens": 4000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=gone, timeout=httpx.Timeout(10, read=0.3))
    out: dict = {}
    reader = threading.Thread(target=stream, args=(served.url, 4000, out))
    reader.start()
    wait_until(lambda: out.get("tokens", 0) >= 3, "the stream started")
    served.app.state.models.drain(0.2)
    reader.join(TIMEOUT_S)
    assert out["error"]["code"] == "service_unavailable" and "finish" not in out, out
    metrics = httpx.get(served.url + "/metrics", timeout=10).text
    assert 'pflash_requests_cut_at_shutdown_total{where="engine"} 1.0' in metrics, metrics[-3000:]
