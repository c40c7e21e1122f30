"""The queue limit seen from clients: a flood on idle slots over HTTP (tiny model, real server)."""
from __future__ import annotations

import threading

from conftest import live_server

N_CLIENTS, SLOTS, MAX_QUEUE = 30, 4, 6


def test_a_flood_on_idle_slots_admits_exactly_slots_plus_max_queue(tiny_model):
    settings = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 512, "max_concurrency": SLOTS,
                "max_queue": MAX_QUEUE, "n_threads": 1}
    with live_server([settings]) as server:
        engine = server.app.state.models.get("tiny").engine
        # the first step waits until every client's request has reached the engine, so all of
        # them arrive while the slots are (about to be) taken, whatever the machine's speed
        all_in, lock, submitted = threading.Event(), threading.Lock(), []
        submit, execute = engine.submit, engine.runner.execute

        def counting_submit(*requests) -> None:
            try:
                submit(*requests)
            finally:
                with lock:
                    submitted.append(requests)
                    if len(submitted) == N_CLIENTS:
                        all_in.set()

        def gated_execute(step):
            assert all_in.wait(60), f"only {len(submitted)} clients arrived"
            return execute(step)

        engine.submit, engine.runner.execute = counting_submit, gated_execute
        codes: list[int] = []

        def client(i: int) -> None:
            with server.client(timeout=120) as http:
                body = {"model": "tiny", "prompt": f"flood {i}", "max_tokens": 4, "temperature": 0}
                codes.append(http.post("/v1/completions", json=body).status_code)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(codes) == [200] * (SLOTS + MAX_QUEUE) + [429] * (N_CLIENTS - SLOTS - MAX_QUEUE)
        status = server.wait_idle()
        assert status["kv_pages_used"] == sum(s["kv_pages"] for s in status["slots"])  # only idle caches
