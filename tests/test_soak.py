"""The bounded soak: bench/soak.py's workload (pflash_plugin.testing.soak) on two tiny models, about
a minute: nothing lost, hung or 5xx, and the KV pool and slots back to idle afterwards."""
from __future__ import annotations

import asyncio
from collections import Counter

from conftest import live_server
from pflash_plugin.testing import write_tiny_llama
from pflash_plugin.testing.soak import ABANDON, ALL_KINDS, FAILURES, HOSTILE, KINDS, OK, Workload, plan, soak

N, SEED = 1000, 1
PFLASH = {"pflash": "auto", "pflash_threshold": 256, "pflash_keep_ratio": 0.3, "pflash_segment_min": 4,
          "pflash_segment_max": 16}


def two_models(tiny_model, tmp_path) -> list[dict]:
    other = write_tiny_llama(tmp_path / "other.gguf", seed=3)
    return [
        {"model": str(tiny_model), "model_alias": "a", "n_ctx": 1024, "max_concurrency": 4, "max_queue": 64,
         "n_threads": 1, "n_threads_batch": 1, **PFLASH},
        {"model": str(other), "model_alias": "b", "n_ctx": 256, "max_concurrency": 2, "max_queue": 64, "n_threads": 1,
         "n_threads_batch": 1},
    ]


def soak_two_models(tiny_model, tmp_path, n: int, hostile: bool = False):
    with live_server(two_models(tiny_model, tmp_path), api_key="soak-key", max_body_bytes=2**16) as server:
        workload = Workload(server.url, "a", "b", long_words=200, over_long_words=400, api_key="soak-key",
                            max_body_bytes=2**16, max_tokens=8, concurrency=8, deadline_s=60)
        return asyncio.run(soak(workload, n=n, seed=SEED, hostile=hostile))


def test_soak_loses_nothing_and_returns_the_pool_to_idle(tiny_model, tmp_path):
    report = soak_two_models(tiny_model, tmp_path, N)
    summary = report.summary
    assert summary["failures"] == dict.fromkeys(FAILURES, 0), summary["failed_examples"]
    assert report.not_idle == {}, report.status
    # every planned request got what its kind expects, whatever the machine's speed: an answer, or
    # its 4xx; a client that leaves may still get its whole answer first
    planned = Counter(plan(N, SEED, api_key=True))
    assert summary["by_kind"].keys() == planned.keys() and len(planned) == 17
    for kind, count in planned.items():
        expected = KINDS[kind][1]
        allowed = {"ok"} if expected == OK else {"ok", "abandoned"} if expected == ABANDON else {"rejected"}
        got = summary["by_kind"][kind]
        assert got.keys() <= allowed and sum(got.values()) == count, (kind, got)
    # PFlash really compressed the long prompts it was asked to (auto: all are over the threshold)
    assert summary["pflash_compressed"] == planned["long_pflash_auto"] + planned["long_pflash_always"], summary


def test_a_hostile_mix_gets_its_400s_beside_normal_traffic_and_loses_nothing(tiny_model, tmp_path):
    """Issue 22's shapes (costly grammars and schemas, deep JSON, stop lists) among the ordinary kinds:
    each hostile one gets its 400 (the heavy stop list its answer), nothing else fails."""
    n = 400
    report = soak_two_models(tiny_model, tmp_path, n, hostile=True)
    summary = report.summary
    assert summary["failures"] == dict.fromkeys(FAILURES, 0), summary["failed_examples"]
    assert report.not_idle == {}, report.status
    planned = Counter(plan(n, SEED, api_key=True, hostile=True))
    assert set(HOSTILE) <= planned.keys()
    for kind in HOSTILE:
        expected = "ok" if ALL_KINDS[kind][1] == OK else "rejected"
        assert summary["by_kind"][kind] == {expected: planned[kind]}, (kind, summary["by_kind"][kind])
