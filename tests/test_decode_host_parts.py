"""bench/decode_host_parts.py: the decode loop of many slots on the tiny model keeps llama.cpp's graph
(a stream per slot), and the uprobe split reads perf script's lines into each part's median span."""
from __future__ import annotations

import argparse

import pytest
from report_pages import bench_module


@pytest.mark.parametrize("kv", ["per_slot", "unified"])
def test_loop_decodes_every_slot_on_the_graph_before(kv: str) -> None:
    parts = bench_module("decode_host_parts.py")
    row = parts.run_loop(argparse.Namespace(slots=16, steps=12, kv=kv, vocab_extra=0, threads=1))
    assert row["decode_ms"] > 0 and row["kv"] == kv
    if kv == "per_slot":  # a stream per slot: n_kv stays, the graph too (built anew only after the prompts)
        assert row["graph_reuses_per_step"] == round(11 / 12, 3), row


def test_split_spans_each_part_from_its_first_entry_to_its_last_return() -> None:
    parts = bench_module("decode_host_parts.py")
    names = ["decode", "compat", "validate", "init_batch", "prepare", "process", "apply", "set_inputs", "compute"]
    lines = []
    for step in range(40):
        t = step * 10.0
        for offset, name in enumerate(names):  # nested in order; PLT stub and body both fire for "prepare"
            lines.append(f"{t + offset * 0.001:.6f}: probe_libllama:{name}: ")
            if name == "prepare":
                lines.append(f"{t + offset * 0.001 + 0.0001:.6f}: probe_libllama:{name}: ")
        for offset, name in enumerate(reversed(names)):
            lines.append(f"{t + 1 + offset * 0.001:.6f}: probe_libllama:{name}__return: ")
    split = parts.split("\n".join(lines))
    assert split["decode"] == pytest.approx(1000 * (1 + 0.008), abs=0.01)
    assert split["compute"] == pytest.approx(1000 * (1 - 0.008), abs=0.01)  # entered last, returned first
    assert split["prepare"] == pytest.approx(1000 * (1 + 0.004 - 0.004), abs=0.01)
    assert set(split) >= set(names) | {"decode less its parts"}
