"""Start-up warm-up (server/runtime/warmup.py): the engine runs one request before the server listens
and forgets its prompt; the first requests import nothing (AnyIO's asyncio backend and numpy.random
were loaded at start, not on the event loop and the engine thread of a first request) and start no
thread (the request path's threads were started with the server: wire/offload.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

# A server of the tiny model in this process (uvicorn on a thread, port 0), the modules loaded and the threads
# running once it is up, then a burst of 6 completions over HTTP (streamed and plain): what the burst imported and
# which threads it started, as JSON.
FIRST_REQUESTS = r"""
import encodings.idna, http.client, json, sys, threading, time  # idna: http.client's own, at its first request
import uvicorn
from pflash_plugin.server.__main__ import parse_settings
from pflash_plugin.server.composition.app import create_app

server_settings, model_settings = parse_settings(["--model", sys.argv[1], "--n_ctx", "512", "--max_concurrency", "2",
                                                  "--n_threads", "1", "--n_threads_batch", "1",
                                                  "--warmup", sys.argv[2]])
server = uvicorn.Server(uvicorn.Config(create_app(server_settings, model_settings), host="127.0.0.1", port=0,
                                       log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)
port = server.servers[0].sockets[0].getsockname()[1]
modules, threads = set(sys.modules), {t.ident for t in threading.enumerate()}


def complete(stream):
    http_client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    # a logit_bias is prepared on a worker thread (preparation/inline.py), as a long prompt would be
    body = json.dumps({"prompt": [1, 5, 9, 13], "max_tokens": 3, "stream": stream, "logit_bias": {"7": 1.0}})
    http_client.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    response = http_client.getresponse()
    assert response.status == 200, response.read()
    response.read()


clients = [threading.Thread(target=complete, args=(i % 2 == 0,), name="client") for i in range(6)]  # a burst
for client in clients:
    client.start()
for client in clients:
    client.join()
started = sorted(t.name for t in threading.enumerate() if t.ident not in threads and t.name != "client")
print(json.dumps({"imported": sorted(set(sys.modules) - modules), "threads_started": started}))
server.should_exit = True
"""


def served_model(path, **kw):
    from pflash_plugin.server.config.settings import ModelSettings
    from pflash_plugin.server.runtime.models import ServedModel

    return ServedModel(ModelSettings(model=str(path), n_ctx=512, verbose=False, n_threads=1, n_threads_batch=1, **kw))


def settled_cache(served, timeout_s: float = 10.0):
    """The engine's stats once its KV holds no page (the warm-up's prompt forgotten), or the last seen."""
    end = time.monotonic() + timeout_s
    while True:
        stats = served.engine.stats()
        if stats.cache.kv_pages_used == 0 or time.monotonic() > end:
            return stats
        time.sleep(0.02)


def test_engine_runs_a_request_at_start_and_forgets_its_prompt(tiny_model):
    warm = served_model(tiny_model)
    try:
        assert warm.engine.steps >= 2  # a prefill and a decode step before any client
        stats = settled_cache(warm)
        assert stats.cache.kv_pages_used == 0 and stats.cache.prefix_cache_tokens == 0
        assert stats.running == 0 and stats.waiting == 0
    finally:
        warm.close()


def test_warmup_false_runs_nothing(tiny_model):
    cold = served_model(tiny_model, warmup=False)
    try:
        assert cold.engine.steps == 0
    finally:
        cold.close()


@pytest.mark.parametrize("n_ubatch, max_ctx, on_gpu, expected", [
    (512, 4096, True, 512),  # a GPU: a whole ubatch, whose matrix kernels a decode step does not load
    (512, 4096, False, 8),  # a CPU: a few tokens
    (512, 100, True, 98),  # room left for the answer
    (512, 3, False, 2),
])
def test_warmup_prompt_length(n_ubatch, max_ctx, on_gpu, expected):
    from pflash_plugin.server.runtime.warmup import warmup_tokens

    assert warmup_tokens(on_gpu, n_ubatch, max_ctx) == expected


@pytest.mark.parametrize("engine_warmup", ["true", "false"])  # without the engine's: numpy.random imported anyway
def test_first_requests_import_nothing_and_start_no_thread(tiny_model, engine_warmup):
    done = subprocess.run([sys.executable, "-c", FIRST_REQUESTS, str(tiny_model), engine_warmup], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    burst = json.loads(done.stdout.strip().splitlines()[-1])
    assert burst["imported"] == [], f"the first requests imported {burst['imported']}"
    # their preparation ran on threads started with the server (wire/offload.py), not on new ones each
    # holding the event loop until it took the GIL
    assert burst["threads_started"] == [], f"the first requests started threads {burst['threads_started']}"


@pytest.mark.parametrize("bos, head", [(1, [1]), (-1, [])])  # -1: llama.cpp's LLAMA_TOKEN_NULL, no BOS
def test_the_random_prompt_starts_with_the_bos_where_there_is_one(bos, head):
    from types import SimpleNamespace

    from pflash_plugin.server.runtime.inprocess import random_prompt

    prompt = random_prompt(SimpleNamespace(bos=bos, n_vocab=50), 16, seed=0)
    assert len(prompt) == 16 and prompt[:len(head)] == head and all(0 <= token < 50 for token in prompt)
