"""Engine health and shutdown as the server shows them (tiny model, real server on loopback)."""
from __future__ import annotations

import httpx

from conftest import live_server


def test_health_is_503_naming_the_model_once_its_engine_stopped_and_close_frees_the_contexts(tiny_model):
    settings = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 256, "max_concurrency": 2,
                "n_threads": 1, "n_threads_batch": 1, "embedding": True}
    with live_server([settings]) as server:
        served = server.app.state.models.get("tiny")
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        served.engine.shutdown(0.0)  # what a shutdown (or a failed llama.cpp) leaves behind
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "stopped" and health.json()["reason"].startswith("model tiny:")
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        server.app.state.models.close()
        # the engine's context and the embedder's are freed (the compression thread, if any, first)
        assert served.engine.runner.ctx.ptr is None and served.embedder.ctx.ptr is None
