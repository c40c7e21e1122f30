"""PFlash as an operator watches it: /metrics counts compressed, skipped (by reason) and failed
prompts, the tokens saved, draft seconds and kept ratios; /status shows the mode and keep ratio;
usage.timings separates the compression from the queue."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import NOTES, live_server



def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels without model_name)."""
    with server.client() as client:
        text = client.get("/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def moved(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}


@pytest.fixture(scope="module")
def server(tiny_model):
    settings = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 2048, "max_concurrency": 2,
                "n_threads": 1, "n_threads_batch": 1, "pflash": "auto", "pflash_threshold": 64,
                "pflash_keep_ratio": 0.3, "pflash_segment_min": 4, "pflash_segment_max": 16}
    with live_server([settings]) as live:
        yield live


def test_a_compressed_request_moves_the_compressed_counter_by_one(server):
    before = scrape(server)
    with server.client(timeout=120) as client:
        body = client.post("/v1/completions", json={"prompt": NOTES + " When does the bridge open?",
                                                     "max_tokens": 2}).json()
    report = body["usage"]["timings"]["pflash"]
    assert report["status"] == "compressed"
    change = moved(before, scrape(server))
    assert change[("pflash_prompts_compressed_total", ())] == 1
    assert change[("pflash_prompt_tokens_saved_total", ())] == report["original_tokens"] - report["kept_tokens"]
    assert change[("pflash_kept_ratio_count", ())] == 1
    assert change[("pflash_kept_ratio_sum", ())] == pytest.approx(report["keep_ratio"])
    assert change[("pflash_draft_seconds_count", ())] == 1
    assert change[("pflash_draft_seconds_sum", ())] == pytest.approx(report["draft_ms"] / 1000.0)
    assert not any(name.startswith(("pflash_prompts_skipped", "pflash_prompts_failed")) for name, _ in change)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_one_compression_counts_once_whatever_n_is(server, path):
    """n samples share one compression job: the compressed counter and the draft seconds move once."""
    before = scrape(server)
    prompt = NOTES + " When does the bridge open?"
    body = {"prompt": prompt, "max_tokens": 2, "n": 3} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    with server.client(timeout=120) as client:
        reply = client.post(path, json=body).json()
    report = reply["usage"]["timings"]["pflash"]
    assert report["status"] == "compressed" and len(reply.get("choices", [None])) == body.get("n", 1)
    change = moved(before, scrape(server))
    assert change[("pflash_prompts_compressed_total", ())] == 1
    assert change[("pflash_draft_seconds_count", ())] == 1
    assert change[("pflash_draft_seconds_sum", ())] == pytest.approx(report["draft_ms"] / 1000.0)
    assert change[("pflash_prompt_tokens_saved_total", ())] == report["original_tokens"] - report["kept_tokens"]
    assert change[("pflash_requests_total", (("finish_reason", "length"),))] == body.get("n", 1)


def test_skipped_prompts_are_counted_by_reason(server):
    before = scrape(server)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with server.client(timeout=120) as client:
        short = client.post("/v1/completions", json={"prompt": "a short one", "max_tokens": 2}).json()
        tools = client.post("/v1/chat/completions", json={
            "max_tokens": 2, "messages": [{"role": "user", "content": NOTES}], "tools": [tool]}).json()
    assert short["usage"]["timings"]["pflash"]["status"] == tools["usage"]["timings"]["pflash"]["status"] == "skipped"
    change = moved(before, scrape(server))
    assert change[("pflash_prompts_skipped_total", (("reason", "below_threshold"),))] == 1
    assert change[("pflash_prompts_skipped_total", (("reason", "tools_or_json"),))] == 1
    assert ("pflash_prompts_compressed_total", ()) not in change


def test_status_shows_the_mode_and_keep_ratio(server, tiny_server):
    status = server.status()
    assert status["pflash"] == "auto" and status["pflash_keep_ratio"] == 0.3 and status["pflash_threshold"] == 64
    assert tiny_server.status()["pflash"] == "off" and "pflash_keep_ratio" not in tiny_server.status()


def test_compression_time_is_compress_ms_not_queue_ms(server):
    with server.client(timeout=120) as client:
        timings = client.post("/v1/completions", json={"prompt": NOTES, "max_tokens": 2}).json()["usage"]["timings"]
        short = client.post("/v1/completions", json={"prompt": "short", "max_tokens": 2}).json()["usage"]["timings"]
    assert timings["pflash"]["status"] == "compressed"
    # the compression (waiting for the thread, drafting, selection) is inside compress_ms
    assert timings["compress_ms"] >= timings["pflash"]["draft_ms"] > 0
    # the three are parts of the time to first token (each rounded to 1 us)
    assert timings["queue_ms"] + timings["compress_ms"] + timings["prefill_ms"] <= timings["ttft_ms"] + 0.005
    assert short["compress_ms"] == 0.0
