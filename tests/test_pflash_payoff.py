"""Start-up calibration of --pflash auto: compress only where PFlash measured a speedup."""
from __future__ import annotations

import pytest

from conftest import live_server
from pflash_plugin.pflash.payoff import Calibration, effective_threshold


def test_the_threshold_rises_to_the_measured_length_only_where_pflash_lost():
    wins, loses = Calibration(32704, full_s=2.3, pflash_s=0.5), Calibration(32704, full_s=0.9, pflash_s=0.9)
    assert effective_threshold(2048, wins, min_speedup=1.2) == 2048
    assert effective_threshold(2048, loses, min_speedup=1.2) == 32704
    assert effective_threshold(65536, loses, min_speedup=1.2) == 65536  # never lowered
    assert effective_threshold(2048, None, min_speedup=1.2) == 2048


def settings(tiny_model, **kw) -> dict:
    return {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 1024, "max_concurrency": 1, "n_threads": 1,
            "n_threads_batch": 1, "pflash": "auto", "pflash_threshold": 256, "pflash_keep_ratio": 0.25, **kw}


def long_prompt(n_words: int) -> str:
    return " ".join(f"line {i} tells of the river." for i in range(n_words // 6)) + "\nQuestion: what river?"


@pytest.mark.parametrize("min_speedup, compressed", [(1000.0, False), (0.001, True)])
def test_auto_compresses_only_where_the_start_up_measurement_says_it_pays(tiny_model, min_speedup, compressed):
    with live_server([settings(tiny_model, pflash_calibrate="on", pflash_min_speedup=min_speedup)]) as server:
        status = server.status("tiny")
        calibration = status["pflash_calibration"]
        assert calibration["tokens"] == 1024 - 64 and calibration["full_s"] > 0 and calibration["pflash_s"] > 0
        assert status["pflash_threshold"] == (256 if compressed else 960)
        with server.client() as client:
            reply = client.post("/v1/completions", json={"prompt": long_prompt(330), "max_tokens": 1}).json()
    report = reply["usage"]["timings"]["pflash"]
    assert 256 < report["original_tokens"] <= 960
    if compressed:
        assert report["status"] == "compressed"
    else:
        assert report["status"] == "skipped" and "raised from 256 at start" in report["reason"]


def test_no_calibration_on_the_cpu_unless_asked(tiny_model):
    with live_server([settings(tiny_model)]) as server:
        status = server.status("tiny")
    assert status["pflash_calibration"] is None and status["pflash_threshold"] == 256
