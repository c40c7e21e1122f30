"""PFlash end to end on the demo model: retrieval, usage, and compression beside live decoding."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest

from conftest import live_server
from pflash_plugin.llama import native
from pflash_plugin.testing.haystack import needle_prompt

pytestmark = pytest.mark.demo


@pytest.fixture(scope="module")
def pflash_server(demo_model):
    settings = {"model": str(demo_model), "model_alias": "demo", "n_ctx": 8192, "max_concurrency": 4,
                "pflash": "auto", "pflash_threshold": 2048, "pflash_keep_ratio": 0.2}
    with live_server([settings]) as server:
        yield server


def test_passcode_retrieved_with_pflash_and_usage_reported(pflash_server):
    prompt, code = needle_prompt(3800, 0.4, seed=21)
    with pflash_server.client(timeout=300) as client:
        n_prompt = client.post("/extras/tokenize/count", json={"input": prompt}).json()["count"]
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    assert n_prompt >= 4000
    assert code in reply["choices"][0]["text"]
    usage = reply["usage"]
    report = usage["timings"]["pflash"]
    assert usage["prompt_tokens"] == n_prompt == report["original_tokens"]
    assert report["status"] == "compressed" and report["kept_tokens"] <= 0.2 * n_prompt
    assert report["segments_kept"] < report["segments_total"] and report["layers_run"] == 6
    assert usage["timings"]["ttft_ms"] >= report["draft_ms"] > report["forward_ms"] > 0  # compression counts in TTFT
    expected_scorer = "native-cpu" if native.load() is not None else "numpy"
    assert report["scorer"] == expected_scorer == pflash_server.status("demo")["pflash_scorer"]


def test_short_chat_decodes_while_a_long_prompt_is_compressed(pflash_server):
    prompt, code = needle_prompt(3800, 0.7, seed=22)
    seen_compressing = threading.Event()

    def watch() -> None:
        deadline = time.time() + 60
        while time.time() < deadline and not seen_compressing.is_set():
            status = pflash_server.status("demo")
            if status["compressing"] and status["compressing"][0]["prompt_tokens"] >= 4000:
                seen_compressing.set()
            time.sleep(0.05)

    with pflash_server.client(timeout=300) as client, cf.ThreadPoolExecutor(3) as pool:
        watcher = pool.submit(watch)
        long_body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
        long = pool.submit(lambda: client.post("/v1/completions", json=long_body).json())
        assert seen_compressing.wait(30), "/status never showed the prompt in compression"
        short_body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        short = client.post("/v1/completions", json=short_body).json()
        still_compressing = bool(pflash_server.status("demo")["compressing"])
        reply = long.result()
        watcher.result()
    assert short["usage"]["completion_tokens"] == 8 and still_compressing  # answered during the scoring
    assert reply["usage"]["timings"]["pflash"]["status"] == "compressed"
    assert code in reply["choices"][0]["text"]


@pytest.mark.parametrize("lanes", [1, 2])
def test_passcode_retrieved_from_8k_tokens_drafted_in_windows(demo_model, lanes):
    """Windows forced at 8K (the default drafts up to 16K in one causal pass): the needle survives,
    also with the windows drafted by two contexts at once (pflash_drafter_lanes)."""
    prompt, code = needle_prompt(7400, 0.3, seed=23)
    settings = {"model": str(demo_model), "model_alias": "demo", "n_ctx": 9216, "max_concurrency": 1,
                "pflash": "auto", "pflash_keep_ratio": 0.1, "pflash_drafter_window": 2048,
                "pflash_drafter_causal_max": 0, "pflash_drafter_lanes": lanes, "n_threads": 2, "n_threads_batch": 2}
    with live_server([settings]) as server, server.client(timeout=600) as client:
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    report = reply["usage"]["timings"]["pflash"]
    assert report["status"] == "compressed" and report["original_tokens"] >= 7800
    assert report["draft_windows"] >= 4  # 8K tokens in windows of 2048
    assert code in reply["choices"][0]["text"]
