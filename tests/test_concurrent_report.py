"""bench/gpu/concurrent_report.py on two results files shaped as bench/gpu/concurrent_gpu.py writes
them (group `seed`, two device calls: reps 0-1 and rep 2, one row of the first redone in the
second): the page's medians, the merge, and each of issue 28's targets met or missed by its data."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from report_pages import bench_module, tables

# per (arm, workload): wall, mean TTFT, short TTFT (mix8), the server's mean and short TTFT (ours);
# each rep moves them by its own factor
BASE = {
    ("full", "qa8"): (12.0, 6.5, None, 6.4, None), ("pflash", "qa8"): (2.4, 1.3, None, 1.1, None),
    ("llama-server", "qa8"): (11.6, 6.9, None, None, None), ("serial-pflash", "qa8"): (2.5, 1.2, None, 1.2, None),
    ("full", "mix8"): (6.4, 4.0, 1.9, 3.9, 1.8), ("pflash", "mix8"): (1.5, 1.0, 0.07, 0.9, 0.04),
    ("llama-server", "mix8"): (6.2, 4.1, 0.05, None, None), ("serial-pflash", "mix8"): (2.0, 1.2, 0.3, 1.1, 0.28),
    ("full", "cd4"): (66.0, 27.0, None, 26.9, None), ("pflash", "cd4"): (15.0, 3.3, None, 3.1, None),
    ("llama-server", "cd4"): (64.0, 27.0, None, None, None), ("serial-pflash", "cd4"): (30.0, 13.0, None, 12.9, None),
}
FACTORS = {0: 1.0, 1: 0.9, 2: 1.2}
KEYS = ("wall_s", "ttft_mean_s", "short_ttft_mean_s", "server_ttft_mean_s", "server_short_ttft_mean_s")


def report_module():
    return bench_module("gpu/concurrent_report.py")


def row(arm: str, workload: str, rep: int, factor: float) -> dict:
    values = dict(zip(KEYS, BASE[(arm, workload)]))
    out = {"arm": arm, "rep": rep, "workload": workload, "seed": f"{arm}/{workload}/{rep}"}
    out |= {k: round(v * factor, 4) for k, v in values.items() if v is not None}
    if "server_ttft_mean_s" in out:
        out["compressed"] = 0 if arm == "full" else 4
    if workload != "cd4":  # rows of an older run lack it
        out["itl_mean_ms"] = round(25.0 * factor, 2)
    return out


def results(reps: list[int], factors: dict[int, float]) -> dict:
    rows = [{"server": "ours-4", "kind": "start", "ready_s": 9.0}]
    rows += [row(arm, workload, rep, factors[rep]) for rep in reps for arm, workload in BASE]
    return {"machine": {"gpus": ["NVIDIA H200, 143771 MiB, 580.159.04"], "argv": ["bench/gpu/concurrent_gpu.py",
                                                                                  f"--first_rep {reps[0]}"]},
            "results": {"seed": rows}}


def write_calls(tmp_path: Path) -> list[Path]:
    """Call 1: reps 0 and 1 (rep 1 with a factor of 5, a run to be replaced); call 2: rep 2 and rep 1 again."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps(results([0, 1], {0: FACTORS[0], 1: 5.0})))
    second.write_text(json.dumps(results([2, 1], FACTORS)))
    return [first, second]


def median(arm: str, workload: str, key: str) -> float:
    return statistics.median(round(dict(zip(KEYS, BASE[(arm, workload)]))[key] * f, 4) for f in FACTORS.values())


def test_the_page_has_the_medians_of_both_calls_and_checks_the_targets(tmp_path):
    paths = write_calls(tmp_path)
    (tmp_path / "concurrent_gpu.md").write_text("old page\n<!-- notes -->\nkept by hand\n")
    report_module().main(["--data", *map(str, paths), "--out-dir", str(tmp_path), "--no-plot"])
    page = (tmp_path / "concurrent_gpu.md").read_text()
    assert page.endswith("<!-- notes -->\nkept by hand\n") and "old page" not in page
    assert "Medians of 3 rep(s) per cell" in page and "`first.json`, `second.json`" in page

    main, targets, ratios, reps = tables(page)
    by_workload = {r["workload: wall / mean TTFT (mix8: short TTFT), the server's TTFT in brackets"].split(":")[0]: r
                   for r in main}
    assert by_workload["qa8"]["ours, PFlash"] == f"{median('pflash', 'qa8', 'wall_s'):.2f} s / " \
        f"{median('pflash', 'qa8', 'ttft_mean_s'):.2f} s ({median('pflash', 'qa8', 'server_ttft_mean_s'):.2f} s)"
    peer_mix8 = median("llama-server", "mix8", "wall_s"), median("llama-server", "mix8", "short_ttft_mean_s")
    assert by_workload["mix8"]["llama-server, full prefill"] == f"{peer_mix8[0]:.2f} s / {peer_mix8[1]:.3f} s"
    assert by_workload["cd4"]["ours, full prefill"].startswith(f"{median('full', 'cd4', 'wall_s'):.2f} s / ")

    verdict = {r["target"]: (r["measured"], r[""]) for r in targets}
    cd4_ttft = median("pflash", "cd4", "server_ttft_mean_s")
    assert verdict["cd4, PFlash: mean TTFT (server's) <= 3 s"] == (f"{cd4_ttft:.2f} s", "missed")
    cd4_speedup = median("llama-server", "cd4", "wall_s") / median("pflash", "cd4", "wall_s")
    assert verdict["cd4, PFlash: llama-server full wall / PFlash wall >= 4x"] == (f"{cd4_speedup:.3f}x", "**met**")
    assert verdict["qa8, PFlash: wall <= 2.5 s"][1] == "**met**"
    assert verdict["qa8, PFlash: mean TTFT (server's) <= 1.2 s"][1] == "**met**"
    assert verdict["mix8, PFlash: short TTFT (server's) <= 0.05 s"] == ("0.040 s", "**met**")
    assert verdict["cd4, full: ours / llama-server, wall <= 1.05x"] == (f"{66 / 64:.3f}x", "**met**")
    assert verdict["mix8, full: ours / llama-server, short TTFT <= 1.05x"] == (f"{1.9 / 0.05:.3f}x", "missed")
    assert len(verdict) == 5 + 7

    assert {r["workload"]: r["llama-server full / ours PFlash, wall"] for r in ratios}["cd4"] == f"{cd4_speedup:.1f}x"
    assert len(reps) == len(BASE) * 3  # rep 1 once: the second call's
    redone = [r for r in reps if (r["workload"], r["arm"], r["rep"]) == ("qa8", "full", "1")]
    assert [r["wall"] for r in redone] == [f"{12.0 * FACTORS[1]:.2f} s"]
    assert [r["long answers' ms/token"] for r in redone] == [str(round(25.0 * FACTORS[1], 2))]
    assert {r["long answers' ms/token"] for r in reps if r["workload"] == "cd4"} == {"-"}


def test_a_missing_arm_leaves_its_targets_unmeasured(tmp_path):
    data = results([0], FACTORS)
    data["results"]["seed"] = [r for r in data["results"]["seed"] if r.get("arm") != "llama-server"]
    path = tmp_path / "one.json"
    path.write_text(json.dumps(data))
    report_module().main(["--data", str(path), "--out-dir", str(tmp_path), "--no-plot"])
    targets = tables((tmp_path / "concurrent_gpu.md").read_text())[1]
    unmeasured = {r["target"] for r in targets if r[""] == "not measured"}
    assert len(unmeasured) == 8 and all("llama-server" in t for t in unmeasured)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    report_module().main(["--data", *map(str, write_calls(tmp_path)), "--out-dir", str(tmp_path)])
    assert (tmp_path / "concurrent_gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "concurrent_gpu.png").stat().st_size > 10_000
