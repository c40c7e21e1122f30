"""bench/gpu/spec_cost.py on the CPU with tiny shapes: every (rows, k) is timed, each cost is the
least step where asked, and the speedup model follows from the costs (checked here against the
formula on the results it wrote)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from report_pages import bench_module

from pflash_plugin.testing import cached_tiny_llama


def test_the_bench_times_each_k_and_models_the_speedup(tmp_path: Path, tiny_model: Path):
    bench = bench_module("gpu/spec_cost.py")
    out = tmp_path / "spec.json"
    draft = cached_tiny_llama(quant="q4_0")
    bench.main(["--target", str(tiny_model), "--draft", str(draft), "--rows", "1", "2", "--ks", "2", "3",
                "--steps", "2", "--reps", "2", "--context", "40", "--threads", "1", "--aggregate", "min",
                "--out", str(out)])
    data = json.loads(out.read_text())
    assert {(r["rows"], r["k"]) for r in data["cost"]} == {(n, k) for n in (1, 2) for k in (0, 2, 3)}
    assert len(data["results"]) == 12
    cost = {(r["rows"], r["k"]): r for r in data["cost"]}
    reps = [r for r in data["results"] if (r["rows"], r["k"]) == (2, 3)]
    assert cost[(2, 3)]["verify_ms"] == min(r["verify_min_ms"] for r in reps) <= min(r["verify_ms"] for r in reps)
    assert all(r["verify_ms"] > 0 and r["accept_greedy_ms"] > 0 for r in data["cost"])
    assert all((r["draft_ms"] > 0) == (r["k"] > 0) for r in data["cost"])
    row = next(r for r in data["speedups"] if r["rows"] == 2 and r["alpha"] == 0.8)
    c0, c3 = cost[(2, 0)], cost[(2, 3)]
    want = (1 - 0.8 ** 4) / 0.2 * (c0["verify_ms"] + c0["accept_greedy_ms"]) / (
        c3["verify_ms"] + c3["draft_ms"] + c3["accept_greedy_ms"])
    assert row["speedup"]["3"] == pytest.approx(want, abs=1e-3)
    assert row["speedup"]["0"] == 1.0 and row["best_speedup"] == max(row["speedup"].values())


def test_a_draft_of_another_vocabulary_is_refused(tmp_path: Path, tiny_model: Path):
    bench = bench_module("gpu/spec_cost.py")
    other = cached_tiny_llama(vocab_extra=8)
    with pytest.raises(ValueError, match="does not share the vocabulary"):
        bench.main(["--target", str(tiny_model), "--draft", str(other), "--out", str(tmp_path / "x.json")])


def test_the_report_writes_its_section_from_the_data_and_keeps_the_rest_of_the_page(tmp_path: Path, tiny_model: Path):
    bench, report = bench_module("gpu/spec_cost.py"), bench_module("gpu/spec_cost_report.py")
    out = tmp_path / "spec_cost_cpu.json"
    bench.main(["--target", str(tiny_model), "--draft", str(tiny_model), "--rows", "1", "--ks", "1", "4",
                "--steps", "2", "--reps", "1", "--context", "24", "--threads", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    page = tmp_path / "speculation.md"
    page.write_text("# Speculative decoding\n\nprompt lookup's part\n\n## Later\n\nkept\n")
    for _ in range(2):  # a second run replaces the section
        report.main([str(out), "--page", str(page)])
    text = page.read_text()
    assert text.count(report.HEADING) == 1 and "prompt lookup's part" in text and "## Later\n\nkept" in text
    four = next(c for c in data["cost"] if c["k"] == 4)
    row = next(line for line in text.splitlines() if line.startswith("| 4 |"))
    speed = next(s for s in data["speedups"] if s["alpha"] == 0.7)["speedup"]["4"]
    assert f"| {four['verify_ms']:.2f} | {four['draft_ms']:.2f} |" in row and f"{speed:.2f}x" in row
