"""SIGTERM on a real `python -m pflash_plugin.server` process: new requests are refused at once,
a request that fits in the grace period finishes, one that does not is cancelled when it ends, and
the process exits cleanly (compression thread stopped, models freed) soon after."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

GRACE_S = 1.5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server(tiny_model, tmp_path):
    port = free_port()
    log = (tmp_path / "server.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pflash_plugin.server", "--model", str(tiny_model), "--port", str(port),
         "--n_ctx", "4096", "--max_concurrency", "2", "--n_threads", "1", "--pflash", "auto",
         "--pflash_threshold", "64", "--shutdown_grace_s", str(GRACE_S)],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the server did not start")
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def stream(url: str, max_tokens: int, out: dict) -> None:
    """A streamed completion; records the last finish_reason, an error event, or a dropped stream."""
    body = {"prompt": "The river", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                    elif event["choices"] and event["choices"][0].get("finish_reason"):
                        out["finish"] = event["choices"][0]["finish_reason"]
                    out["tokens"] = out.get("tokens", 0) + 1
    except httpx.HTTPError as error:
        out["dropped"] = repr(error)
    out["ended"] = time.monotonic()


def test_sigterm_drains_finishes_or_cancels_then_exits(server):
    proc, url, log = server
    short, long = {}, {}
    threads = [threading.Thread(target=stream, args=(url, 60, short)),
               threading.Thread(target=stream, args=(url, 4000, long))]  # cannot finish in the grace
    for thread in threads:
        thread.start()
    deadline = time.time() + 30
    while (long.get("tokens", 0) < 3 or not short.get("tokens")) and time.time() < deadline:
        time.sleep(0.02)
    assert long.get("tokens", 0) >= 3 and short.get("tokens"), "the streams never started"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # no new work once draining: refused on a new connection, or 503 on one still open
        late = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5).status_code
    except httpx.HTTPError:
        late = "refused"
    for thread in threads:
        thread.join(timeout=30)
    code = proc.wait(timeout=30)
    log.seek(0)
    output = log.read()
    assert late in (503, "refused")
    assert short.get("finish") == "length"  # finished inside the grace
    assert long.get("finish") == "cancelled" and "dropped" not in long  # cut at the grace, the stream closed cleanly
    assert long["ended"] - sent < GRACE_S + 4.0  # cancelled at the grace, not left to run
    assert code in (0, -signal.SIGTERM) and "Traceback" not in output, output[-2000:]
