"""The gauges the inference gateway's endpoint picker reads (docs/metrics.md), scraped from a real
server on loopback under a flood, and the Kubernetes example (examples/kubernetes/) checked against
what the server exports."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import LiveServer, live_server
from mock_runner import make_request, make_scheduler, sink_of, step_once
from pflash_plugin.server.operations.metrics import Metrics

KUBERNETES = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
GAUGES = ("pflash_num_requests_waiting", "pflash_num_requests_running", "pflash_kv_cache_usage_perc",
          "pflash_num_requests_compressing", "pflash_prefix_cache_usage_perc", "pflash_cache_config_info")
HOLD = 3900  # tokens the holder reserves: 122 of the pool's 128 pages, so no flood request fits beside it
FLOOD = 6


def scrape(server: LiveServer) -> dict[str, float]:
    """One /metrics scrape: each of GAUGES (checked to be a gauge of model "tiny") by name."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    values = {}
    for name in GAUGES:
        family = families[name]
        assert family.type == "gauge", (name, family.type)
        [sample] = family.samples
        assert sample.labels["model_name"] == "tiny", sample
        values[name] = sample.value
    return values


def wait_for(server: LiveServer, done: Callable[[dict[str, float]], bool],
             seen: list[dict[str, float]]) -> dict[str, float]:
    """Scrape until `done(gauges)`; every scrape is kept in `seen`. The deadline only ends a hung test."""
    deadline = time.monotonic() + 120
    while True:
        gauges = scrape(server)
        seen.append(gauges)
        if done(gauges):
            return gauges
        assert time.monotonic() < deadline, f"gave up waiting; last scrape {gauges}"
        time.sleep(0.02)


def test_gauges_under_a_flood(tiny_model):
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 4096, "kv_pool_tokens": 4096, "kv_page_size": 32,
             "max_concurrency": 2, "max_queue": 16, "n_threads": 1, "n_threads_batch": 1}
    seen: list[dict[str, float]] = []
    with live_server([model]) as server, server.client() as client, ThreadPoolExecutor(FLOOD) as pool:
        assert scrape(server)["pflash_kv_cache_usage_perc"] == 0
        families = text_string_to_metric_families(client.get("/metrics").text)
        info = next(f for f in families if f.name == "pflash_cache_config_info")
        expected = {"model_name": "tiny", "block_size": "32", "num_gpu_blocks": "128"}
        assert info.samples[0].labels | {"model_name": "tiny"} == expected
        body = {"prompt": "hold the pool", "max_tokens": HOLD, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as holder:
            lines = holder.iter_lines()  # kept: a collected line iterator closes the stream
            next(line for line in lines if line.startswith("data: {"))
            flood = [pool.submit(client.post, "/v1/completions", json={"prompt": f"flood {i}", "max_tokens": 300})
                     for i in range(FLOOD)]
            queued = wait_for(server, lambda g: g["pflash_num_requests_waiting"] == FLOOD, seen)
            assert queued["pflash_num_requests_running"] == 1, "the holder ended early: the test proves nothing"
            assert queued["pflash_kv_cache_usage_perc"] >= 122 / 128  # the holder's reservation
            assert queued["pflash_num_requests_compressing"] == 0
        # closing the holder's stream cancels it; the flood then runs two at a time
        assert all(f.result().status_code == 200 for f in flood)
        idle = wait_for(server, lambda g: g["pflash_num_requests_running"] == g["pflash_num_requests_waiting"] == 0,
                        seen)
    assert all(0 <= g["pflash_kv_cache_usage_perc"] <= 1 for g in seen)
    assert all(0 <= g["pflash_prefix_cache_usage_perc"] <= 1 for g in seen)
    # the idle slots keep their prefix caches; those pages are free to the next request, so not in use
    assert idle["pflash_kv_cache_usage_perc"] == 0 and idle["pflash_prefix_cache_usage_perc"] > 0


def test_a_page_shared_by_a_running_request_and_an_idle_cache_is_in_use():
    scheduler, runner = make_scheduler(n_slots=2, n_pages=32, page_size=4, max_batch_tokens=16, max_ctx=64)
    prompt = list(range(10, 30))
    first = make_request(prompt, max_tokens=3)
    scheduler.add(first)
    step_once(scheduler, runner)
    step_once(scheduler, runner)
    second = make_request(prompt[:8] + [500, 501], max_tokens=20)  # shares the first's two first pages
    scheduler.add(second)
    while sink_of(first).finish is None:
        step_once(scheduler, runner)
    idle, busy = scheduler.slots
    assert (idle.request, busy.request) == (None, second) and set(idle.pages) & set(busy.pages)
    gauges = {f.name: f.samples[0].value for f in text_string_to_metric_families(
        Metrics(lambda: {"m": scheduler.stats()}).render().decode()) if f.type == "gauge"}
    assert gauges["pflash_kv_cache_usage_perc"] == len(busy.pages) / 32
    assert gauges["pflash_prefix_cache_usage_perc"] == len(set(idle.pages) - set(busy.pages)) / 32


def kubernetes_documents() -> list[dict]:
    files = sorted(KUBERNETES.glob("*.yaml"))
    assert files
    documents = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d is not None]
    assert all(d["apiVersion"] and d["kind"] and d["metadata"]["name"] for d in documents)
    return documents


def exported_gauges() -> set[str]:
    """The gauge families /metrics serves, from a scheduler's real status."""
    scheduler, _ = make_scheduler()
    families = text_string_to_metric_families(Metrics(lambda: {"m": scheduler.stats()}).render().decode())
    return {f.name for f in families if f.type == "gauge"}


def test_the_endpoint_picker_and_the_autoscaler_read_the_gauges_the_server_exports():
    documents = kubernetes_documents()
    kinds = {d["kind"] for d in documents}
    assert {"Deployment", "Service", "InferencePool", "ConfigMap", "HorizontalPodAutoscaler"} <= kinds
    [picker] = [yaml.safe_load(text) for d in documents if d["kind"] == "ConfigMap"
                for text in d["data"].values() if "EndpointPickerConfig" in text]
    [extractor] = [p for p in picker["plugins"] if p["type"] == "core-metrics-extractor"]
    engine = extractor["parameters"]["defaultEngine"]
    [specs] = [e for e in extractor["parameters"]["engineConfigs"] if e["name"] == engine]
    assert specs == {"name": engine, "queuedRequestsSpec": "pflash_num_requests_waiting",
                     "runningRequestsSpec": "pflash_num_requests_running", "kvUsageSpec": "pflash_kv_cache_usage_perc",
                     "loraSpec": "", "cacheInfoSpec": "pflash_cache_config_info"}
    exported = exported_gauges()
    assert {v for k, v in specs.items() if k.endswith("Spec") and v} <= exported
    # the model server pods carry the engine label the extractor picks its specs by
    [server] = [d for d in documents if d["kind"] == "Deployment" and "pflash_plugin.server" in str(d)]
    assert server["spec"]["template"]["metadata"]["labels"][extractor["parameters"]["engineLabelKey"]] == engine
    # the autoscaler's metric is one the adapter serves, from a series the server exports
    [hpa] = [d for d in documents if d["kind"] == "HorizontalPodAutoscaler"]
    [adapter] = [yaml.safe_load(d["data"]["config.yaml"]) for d in documents
                 if d["metadata"]["name"] == "adapter-config"]
    served = {rule["seriesQuery"].split("{")[0] for rule in adapter["rules"]}
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served <= exported
