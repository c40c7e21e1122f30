"""The server's startup heap is frozen out of the cyclic GC while it serves, and unfrozen when it stops
(operations/gc_heap.py): a full collection over it stopped every thread for 42-47 ms on 2 CPU cores."""
from __future__ import annotations

import gc

from fastapi.testclient import TestClient

from pflash_plugin.server.composition.app import create_app
from pflash_plugin.server.config.settings import ModelSettings, ServerSettings


def test_the_startup_heap_is_frozen_while_the_server_runs(tiny_model):
    model = ModelSettings(model=str(tiny_model), n_ctx=256, max_concurrency=1, n_threads=1, n_threads_batch=1,
                          verbose=False)
    app = create_app(ServerSettings(), [model])
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() > 10_000  # the app, its models' objects, the libraries'
    assert gc.get_freeze_count() == 0
