"""The queue limit seen from clients: a flood on idle slots over HTTP (tiny model, real server).
Every answer is decided before its first byte: a 200 (a stream that ends with [DONE]) or a 429."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from conftest import live_server

N_CLIENTS, SLOTS, MAX_QUEUE = 30, 4, 6


@pytest.mark.parametrize("stream,n", [(False, 1), (True, 2)])
def test_a_flood_on_idle_slots_admits_exactly_slots_plus_max_queue(tiny_model, stream, n):
    settings = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 512, "max_concurrency": SLOTS,
                "max_queue": MAX_QUEUE, "n_threads": 1, "n_threads_batch": 1}
    with live_server([settings]) as server:
        engine = server.app.state.models.get("tiny").engine
        # the first step waits until every client's request has reached the engine, so all of
        # them arrive while the slots are (about to be) taken, whatever the machine's speed
        all_in, lock, submitted = threading.Event(), threading.Lock(), []
        submit, launch = engine.submit, engine.runner.launch

        def counting_submit(*requests) -> Future:
            try:
                return submit(*requests)
            finally:
                with lock:
                    submitted.append(requests)
                    if len(submitted) == N_CLIENTS:
                        all_in.set()

        def gated_launch(step):
            assert all_in.wait(60), f"only {len(submitted)} clients arrived"
            return launch(step)

        engine.submit, engine.runner.launch = counting_submit, gated_launch
        answers: list[tuple[int, str]] = []

        def client(i: int) -> None:
            with server.client(timeout=120) as http:
                body = {"model": "tiny", "prompt": f"flood {i}", "max_tokens": 4, "temperature": 0, "n": n,
                        "stream": stream}
                reply = http.post("/v1/completions", json=body)
                answers.append((reply.status_code, reply.text))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        admitted = (SLOTS + MAX_QUEUE) // n
        assert sorted(code for code, _ in answers) == [200] * admitted + [429] * (N_CLIENTS - admitted)
        if stream:  # no stream starts with 200 and then ends in an error
            streams = [text for code, text in answers if code == 200]
            assert all(text.rstrip().endswith("data: [DONE]") and '"error"' not in text for text in streams)
        status = server.wait_idle()
        assert status["kv_pages_used"] == sum(s["kv_pages"] for s in status["slots"])  # only idle caches
