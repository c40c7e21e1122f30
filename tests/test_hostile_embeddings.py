"""Embedding floods against a real server process (issue 22): they get a queue of their own with a
429, cannot starve completions of the worker pool, stop for clients that left, and a SIGTERM while
they wait ends the process cleanly instead of calling into a freed context."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pflash_plugin.testing.native_fuzz import COMPLETIONS, server_process

WORDS = " ".join(["word"] * 400)  # 401 tokens of the tiny model (the context is 512): ~7 ms an input
FLOOD = {"input": [WORDS] * 24}  # about 0.17 s a request


def embed(server, body: dict, timeout: float = 120) -> int | None:
    """The answer's status; None where the client gave up or the connection ended."""
    try:
        return httpx.post(server.url + "/v1/embeddings", json=body, timeout=timeout).status_code
    except httpx.HTTPError:
        return None


def flood(server, pool: ThreadPoolExecutor, n: int, timeout: float = 120) -> list:
    return [pool.submit(embed, server, FLOOD, timeout) for _ in range(n)]


def test_a_sigterm_with_embeddings_queued_ends_the_process_cleanly(tiny_model, tmp_path):
    """60 requests (about 10 s of work) and SIGTERM after 1 s with a grace of 0.5 s: the waiting
    ones get a 503 (before: the process segfaulted once uvicorn's graceful timeout freed the context
    under them)."""
    with server_process(tiny_model, tmp_path / "server.log", "--embedding", "true",
                        "--shutdown_grace_s", "0.5") as server:
        with ThreadPoolExecutor(60) as pool:
            answers = flood(server, pool, 60)
            time.sleep(1.0)
            server.proc.send_signal(signal.SIGTERM)
            statuses = [a.result() for a in answers]
            exit_code = server.proc.wait(timeout=60)
    log = server.log.read_text(errors="replace")
    assert exit_code in (0, -signal.SIGTERM) and "Fatal Python error" not in log, log[-3000:]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 20, statuses


def test_embeddings_past_max_queue_get_a_429(tiny_model, tmp_path):
    with server_process(tiny_model, tmp_path / "server.log", "--embedding", "true", "--max_queue", "3") as server:
        with ThreadPoolExecutor(20) as pool:
            statuses = [a.result() for a in flood(server, pool, 20)]
        assert set(statuses) == {200, 429} and statuses.count(200) >= 4, statuses
        refused = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
        assert refused.status_code == 200  # the queue is empty again


def test_an_embedding_flood_neither_starves_completions_nor_outlives_its_clients(tiny_model, tmp_path):
    """60 embedding requests once held all 40 threads of the worker pool that completions prepare
    on (a completion waited for the whole flood), and ran on for clients long gone."""
    with server_process(tiny_model, tmp_path / "server.log", "--embedding", "true") as server:
        completion = {"prompt": "hi", "max_tokens": 3}
        idle = _timed(lambda: httpx.post(server.url + COMPLETIONS, json=completion, timeout=60))
        with ThreadPoolExecutor(60) as pool:
            answers = flood(server, pool, 60)
            time.sleep(0.5)
            beside = _timed(lambda: httpx.post(server.url + COMPLETIONS, json=completion, timeout=60))
            assert [a.result() for a in answers].count(200) == 60
        assert beside < max(2.0, 10 * idle), (beside, idle)  # 7.2 s before

        with ThreadPoolExecutor(60) as pool:  # clients that give up after 0.3 s
            statuses = [a.result() for a in flood(server, pool, 60, timeout=0.3)]
        assert statuses.count(None) >= 50, statuses
        alone = _timed(lambda: httpx.post(server.url + "/v1/embeddings", json={"input": WORDS}, timeout=60))
        assert alone < 2.5, alone  # not behind the ~10 s the gone clients had queued


def _timed(call) -> float:
    started = time.monotonic()
    answer = call()
    assert answer.status_code == 200, answer.text
    return time.monotonic() - started
