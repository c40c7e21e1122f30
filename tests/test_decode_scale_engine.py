"""bench/gpu/decode_scale.py's engine arm on the CPU with the tiny model: each step's parts (the
llama_decode call, the wait for the device, the host's work) add up to the step, and llama.cpp's graph
reuses per step are counted (a decode step of the same slots runs on the graph built before)."""
from __future__ import annotations

import argparse

import pytest
from report_pages import bench_module

from pflash_plugin.testing import cached_tiny_llama


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_arm_splits_each_step(overlap: bool) -> None:
    decode_scale = bench_module("gpu/decode_scale.py")
    args = argparse.Namespace(target=str(cached_tiny_llama()), slots=8, tokens=24, gpu_layers=0, limit_s=120.0)
    row = decode_scale.engine_steps(args, "greedy", "off", overlap)
    parts = row["parts_ms"]
    assert {"plan", "batch", "decode", "wait", "sample", "take", "text", "emit", "stats", "activity",
            "other"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(row["step_ms"], abs=0.01)
    assert parts["decode"] > 0 and parts["sample"] > 0
    # every step past the prompts' prefill decodes the same 8 slots: llama.cpp keeps its graph
    assert row["graph_reuses_per_step"] >= (row["steps"] - 4) / row["steps"], row
    beside = sum(parts[p] for p in ("text", "emit", "stats")) if overlap else 0.0
    assert row["serial_host_ms"] == pytest.approx(row["step_ms"] - parts["wait"] - beside, abs=0.01)
    assert "decode_ms" in row if not overlap else "decode_ms" not in row
    assert row["kv_unified"] is False  # a stream per slot: the layout whose graph every decode step keeps
    # the steady steps (8 rows, each on the graph before) apart from the prompts' prefill and the first decode
    assert row["steps"] - 4 <= row["steady_steps"] < row["steps"] and 0 < row["other_steps_share"] < 1, row
    assert row["steady_parts_ms"]["decode"] > 0 and 0 < row["steady_step_ms"] and 0 < row["steady_step_mean_ms"]
    table = decode_scale.table({"results": {"engine": [row]}})
    assert "graph reuses/step" in table and "| wait ms |" in table
    assert "| engine, steady steps: mode |" in table


def test_engine_arm_over_two_contexts_gives_the_same_greedy_tokens():
    """The slots split over two contexts of one model, each with its engine thread: every request runs to
    its end with the tokens one context gives, each context steps its half, both on their graphs."""
    decode_scale = bench_module("gpu/decode_scale.py")
    args = argparse.Namespace(target=str(cached_tiny_llama()), slots=8, tokens=16, gpu_layers=0, limit_s=120.0)
    one = decode_scale.engine_steps(args, "greedy", "off", True)
    two = decode_scale.engine_contexts(args, "greedy", 2)
    assert two["outputs"] == one["outputs"] and two["contexts"] == 2
    assert len(two["steps_per_context"]) == 2 and all(n >= 16 for n in two["steps_per_context"])
    assert two["graph_reuses_per_step"] >= 0.8
    assert "| greedy | 2 |" in decode_scale.table({"results": {"engine": [one, two]}})


def test_engine_arm_samples_on_the_threads_it_is_given(monkeypatch):
    """`--engine-sample-threads`: the run's argmax takes that many threads (the same tokens), and the
    engine's own count comes back afterwards."""
    from pflash_plugin.llama import native
    from pflash_plugin.llama.context import Context

    decode_scale = bench_module("gpu/decode_scale.py")
    args = argparse.Namespace(target=str(cached_tiny_llama()), slots=4, tokens=8, gpu_layers=0, limit_s=120.0)
    own = Context.host_threads
    passed: list[int] = []
    real = native.sample_rows
    monkeypatch.setattr(native, "sample_rows", lambda logits, table, n: passed.append(n) or real(logits, table, n))
    given = decode_scale.engine_steps(args, "greedy", "off", True, threads=3)
    assert set(passed) == {3} and given["sample_threads"] == 3
    assert Context.host_threads is own
    passed.clear()
    plain = decode_scale.engine_steps(args, "greedy", "off", True)
    assert plain["outputs"] == given["outputs"] and 3 not in passed
    assert plain["sample_threads"] in passed
