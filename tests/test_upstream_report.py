"""bench/gpu/upstream_report.py on the committed H200 data: the decode medians and their ratio, a peer's
runs over the time limit shown as such, and the seed workloads merged over the result files."""
from __future__ import annotations

import json
import statistics
import sys

from report_pages import REPO, bench_module, tables


def test_the_page_shows_the_medians_the_ratio_and_runs_over_the_limit(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "bench" / "gpu"))  # the report imports concurrent_report beside it
    report = bench_module("gpu/upstream_report.py")
    monkeypatch.setattr(sys, "argv", ["upstream_report.py", "--out-dir", str(tmp_path), "--no-plot"])
    report.main()
    decode, workloads = tables((tmp_path / "upstream_gpu.md").read_text())
    rows = [r for r in json.loads(report.DECODE.read_text())["results"]["servers"] if r.get("kind") == "throughput"]

    def median(server: str) -> float:
        return statistics.median(r["tok_s"] for r in rows
                                 if (r["server"], r["mode"], r["clients"]) == (server, "greedy", 64))

    greedy64 = next(r for r in decode if (r["mode"], r["clients"]) == ("greedy", "64"))
    assert float(greedy64["ours"].replace(",", "")) == round(median("ours-host-sampling"))
    assert greedy64["ours / upstream"] == f"**{median('ours-host-sampling') / median('upstream'):.2f}x**"
    seeded64 = next(r for r in decode if (r["mode"], r["clients"]) == ("seeded", "64"))
    assert seeded64["upstream example"] == "over the limit in 3 of 3" and seeded64["ours / upstream"] == "**-**"
    qa8_wall = next(r for r in workloads if r["workload"].startswith("qa8") and r["measure"] == "wall (s)")
    assert "(reps 2/2/2)" in qa8_wall["workload"]  # rep 1 from the second file, rep 0 from the first
