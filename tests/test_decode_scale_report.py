"""bench/gpu/decode_scale_report.py on the committed H200 results, with every figure moved so that
the page's numbers can only come from the data: medians, reps, the earlier run's column, ratios,
issue 27's targets, the engine's step times, notes."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from report_pages import REPO, bench_module, tables

SERVERS = REPO / "docs" / "data" / "decode_scale_native_h200.json"
BEFORE = REPO / "docs" / "data" / "decode_scale_h200.json"
ENGINE = REPO / "docs" / "data" / "decode_scale_engine_h200.json"


def report_module():
    return bench_module("gpu/decode_scale_report.py")


def moved_data(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The committed results with each rep's tok/s scaled by its own factor (llama-server without
    `-bs` made the faster at top_p), the earlier run's too, and the engine's times shifted, written
    to tmp_path."""
    servers, before, engine = (json.loads(p.read_text()) for p in (SERVERS, BEFORE, ENGINE))
    for i, row in enumerate(r for r in servers["results"]["servers"] if "tok_s" in r):
        faster = 2.5 if (row["server"], row["mode"]) == ("llama-server", "top_p") else 1.0
        row["tok_s"] = round(row["tok_s"] * (1.3 + 0.01 * i) * faster, 1)
    for i, row in enumerate(r for r in before["results"]["servers"] if "tok_s" in r):
        row["tok_s"] = round(row["tok_s"] * (0.7 + 0.01 * i), 1)
    for i, row in enumerate(engine["results"]["engine"]):
        row.update(tok_s=row["tok_s"] + 7, host_ms=round(row["host_ms"] + 0.111 * (i + 1), 3),
                   decode_ms=round(row["decode_ms"] + 0.222, 3))
    paths = tmp_path / "servers.json", tmp_path / "before.json", tmp_path / "engine.json"
    for path, data in zip(paths, (servers, before, engine)):
        path.write_text(json.dumps(data))
    return paths


def medians(path: Path) -> dict[tuple[str, str], list[float]]:
    """Every rep's tok/s of a results file, by mode and server."""
    reps: dict[tuple[str, str], list[float]] = {}
    for row in json.loads(path.read_text())["results"]["servers"]:
        if row.get("kind") == "throughput":
            reps.setdefault((row["mode"], row["server"]), []).append(row["tok_s"])
    return reps



def table_with(page: str, column: str) -> list[dict[str, str]]:
    return next(t for t in tables(page) if t and column in t[0])


def number(cell: str) -> float:
    return float(cell.split(" ")[0].replace(",", "").rstrip("x"))


COLUMNS = {"ours": "ours, `--backend_sampling on` (device)",
           "ours-host-sampling": "ours, `--backend_sampling off` (host)",
           "llama-server": "llama-server", "llama-server-bs": "llama-server `-bs`"}


def test_the_page_reports_the_medians_ratios_and_step_times_of_its_data(tmp_path):
    servers, before, engine = moved_data(tmp_path)
    (tmp_path / "decode_scale.md").write_text("old page\n<!-- notes -->\nkept by hand\n")
    report_module().main(["--data", str(servers), "--before", str(before), str(engine),
                          "--out-dir", str(tmp_path), "--no-plot"])
    page = (tmp_path / "decode_scale.md").read_text()
    assert page.endswith("<!-- notes -->\nkept by hand\n") and "old page" not in page

    reps = medians(servers)
    median = {k: statistics.median(v) for k, v in reps.items()}
    throughput = {row["mode"].split(" ")[0]: row for row in table_with(page, COLUMNS["ours"])}
    assert set(throughput) == {"greedy", "top_p", "seeded", "penalties"}
    for (mode, server), value in median.items():
        cell = throughput[mode][COLUMNS[server]]
        assert cell.startswith(f"{value:,.0f} ("), (mode, server)
        assert cell.endswith("; 2 reps)") == (len(reps[(mode, server)]) == 2), (mode, server)
    assert "Throughput: medians of 2/3 interleaved rep(s) per cell (a cell's count where it has fewer" in page

    earlier = {k: statistics.median(v) for k, v in medians(before).items()}
    against = {row["mode"]: row for row in table_with(page, COLUMNS["ours-host-sampling"] + ": before -> now")}
    assert set(against) == {mode for mode, _ in earlier} & {mode for mode, _ in median}  # what both measured
    for (mode, server), value in median.items():
        if mode in against:
            cell = against[mode][COLUMNS[server] + ": before -> now"]
            old = earlier.get((mode, server))
            assert cell == (f"{old:,.0f} -> {value:,.0f} ({value / old:.2f}x)" if old else f"- -> {value:,.0f}")

    assert median[("top_p", "llama-server")] > median[("top_p", "llama-server-bs")]
    ratios = {row["mode"]: row for row in table_with(page, "host / -bs")}
    auto = {}
    for mode in ("greedy", "top_p", "seeded", "penalties"):
        best = max(median[(mode, "llama-server")], median[(mode, "llama-server-bs")])
        device, host = median[(mode, "ours")], median[(mode, "ours-host-sampling")]
        assert ratios[mode]["device / -bs"] == f"{device / median[(mode, 'llama-server-bs')]:.2f}x"
        assert ratios[mode]["host / llama-server"] == f"{host / median[(mode, 'llama-server')]:.2f}x"
        auto[mode] = host / best
        assert number(ratios[mode]["auto / llama-server's best"]) == pytest.approx(auto[mode], abs=0.005)
    missed = [f"{m} {r:.2f}x" for m, r in auto.items() if r < 1.2]
    assert f"missed in {len(missed)} of 4 ({', '.join(missed)})" in page
    assert f"Greedy at least 6,000 tok/s: {median[('greedy', 'ours-host-sampling')]:,.0f}, " in page
    share = median[("seeded", "ours-host-sampling")] / median[("top_p", "ours-host-sampling")]
    assert f"Seeded within 10% of unseeded (top_p): {share:.2f} of it" in page

    assert f"## The engine's time per step (earlier run, {report_module().BEFORE_LABEL})" in page
    steps = table_with(page, "host ms")
    for row, expected in zip(steps, json.loads(engine.read_text())["results"]["engine"]):
        assert (row["mode"], row["backend sampling"]) == (expected["mode"], expected["backend_sampling"])
        assert number(row["host ms"]) == expected["host_ms"] and number(row["decode ms"]) == expected["decode_ms"]
        assert number(row["tok/s"]) == round(expected["tok_s"])
    assert "Greedy tokens in every arm equalled each other" in page


def test_a_cell_measured_in_two_files_takes_the_later_files_reps_and_names_it(tmp_path):
    """Reps of two trees never merge: the later file supplies the cell, the table names it, and the
    earlier run's table leaves out a cell that both sides took from one file."""
    first, later = json.loads(SERVERS.read_text()), json.loads(SERVERS.read_text())
    later["results"]["servers"] = [{**r, "tok_s": r["tok_s"] * 3} for r in later["results"]["servers"]
                                   if r.get("mode") == "greedy"]
    paths = tmp_path / "first.json", tmp_path / "later.json"
    for path, data in zip(paths, (first, later)):
        path.write_text(json.dumps(data))
    report_module().main(["--data", *map(str, paths), "--before", str(paths[0]),
                          "--out-dir", str(tmp_path), "--no-plot"])
    page = (tmp_path / "decode_scale.md").read_text()
    reps = medians(SERVERS)
    throughput = {row["mode"].split(" ")[0]: row for row in table_with(page, COLUMNS["ours"])}
    for (mode, server), values in reps.items():
        expected = statistics.median(values) * (3 if mode == "greedy" else 1)
        assert throughput[mode][COLUMNS[server]].startswith(f"{expected:,.0f} ("), (mode, server)
        assert throughput[mode]["data"] == ("`later.json`" if mode == "greedy" else "`first.json`")
    against = table_with(page, COLUMNS["ours-host-sampling"] + ": before -> now")
    assert [row["mode"] for row in against] == ["greedy"]


def test_files_of_one_tree_merge_a_cells_reps(tmp_path):
    """Two runs that queue.sh tagged with one tree: every rep of both counts."""
    runs = [json.loads(SERVERS.read_text()) for _ in range(2)]
    for data in runs:
        data["machine"]["tree"] = "abc1234"
    rows = runs[1]["results"]["servers"]
    runs[1]["results"]["servers"] = [{**r, "tok_s": r["tok_s"] * 3} for r in rows if "tok_s" in r]
    paths = tmp_path / "one.json", tmp_path / "two.json"
    for path, data in zip(paths, runs):
        path.write_text(json.dumps(data))
    report_module().main(["--data", *map(str, paths), "--before", "--out-dir", str(tmp_path), "--no-plot"])
    page = (tmp_path / "decode_scale.md").read_text()
    throughput = {row["mode"].split(" ")[0]: row for row in table_with(page, COLUMNS["ours"])}
    for (mode, server), values in medians(SERVERS).items():
        merged = statistics.median([*values, *(v * 3 for v in values)])
        assert throughput[mode][COLUMNS[server]].startswith(f"{merged:,.0f} ("), (mode, server)
        assert throughput[mode]["data"] == "`one.json`, `two.json`"
    assert "(`one.json`, tree abc1234)" in page


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    report_module().main(["--data", str(SERVERS), "--before", str(BEFORE), str(ENGINE), "--out-dir", str(tmp_path)])
    assert (tmp_path / "decode_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "decode_scale.png").stat().st_size > 10_000


def test_without_the_device_arm_the_ratios_and_the_overlap_rows_come_from_what_ran(tmp_path):
    """The overlap run (docs/data/decode_*overlap*_h200.json): no `--backend_sampling on` arm, and
    engine rows with and without the overlap, medians over their reps."""
    data = REPO / "docs" / "data"
    servers, engines = data / "decode_scale_overlap_h200.json", [data / "decode_engine_overlap_h200.json",
                                                                  data / "decode_engine_overlap2_h200.json"]
    report_module().main(["--data", str(servers), *map(str, engines), "--before", str(SERVERS),
                          "--out-dir", str(tmp_path), "--no-plot"])
    page = (tmp_path / "decode_scale.md").read_text()
    median = {k: statistics.median(v) for k, v in medians(servers).items()}
    ratios = {row["mode"]: row for row in table_with(page, "host / -bs")}
    assert set(ratios) == {"greedy", "seeded"} and "device / -bs" not in next(iter(ratios.values()))
    for mode in ratios:
        best = max(median[(mode, "llama-server")], median[(mode, "llama-server-bs")])
        assert ratios[mode]["auto / llama-server's best"] == f"{median[(mode, 'ours-host-sampling')] / best:.2f}x"
    rows = [r for path in engines for r in json.loads(path.read_text())["results"]["engine"]]
    steps = {(row["mode"], row["overlap"]): row for row in table_with(page, "ms/step")}
    for (mode, overlap), row in steps.items():
        cell = [r for r in rows if (r["mode"], "on" if r["overlap"] else "off") == (mode, overlap)]
        assert row["reps"] == str(len(cell))
        assert number(row["ms/step"]) == pytest.approx(statistics.median(r["step_ms"] for r in cell), abs=0.0005)
        assert (row["decode ms"] == "-") == (overlap == "on")


def test_the_trace_table_gives_each_traced_step_its_gpu_share_and_host_calls():
    report = bench_module("gpu/decode_scale_report.py")
    trace = {"wall_ms_per_ubatch": 16.0, "gpu_busy_ms_per_ubatch": 9.6, "kernels_per_ubatch": 1247.0,
             "kernels [ms, launches] per ubatch": {"gemm": [2.2, 62.0], "flash_attn": [0.76, 32.0]},
             "copies": {"memcpy-kind2-32855296b": [0.62, 0.93], "memcpy-kind1-1048576b": [0.04, 0.94]},
             "runtime calls [ms, calls] per ubatch": {"cudaStreamSynchronize_v3020": [8.4, 15.4],
                                                      "cudaGraphLaunch_v10000": [2.0, 0.92],
                                                      "cudaLaunchKernelExC_v11060": [0.6, 91.4],
                                                      "cudaLaunchKernel_v7000": [0.5, 79.9]}}
    rows = [{"mode": "greedy", "overlap": True, "step_ms": 18.0, "trace": trace},
            {"mode": "greedy", "overlap": False, "step_ms": 17.0, "backend_sampling": "off", "tok_s": 1.0,
             "outputs": 1}]
    lines = report.trace_table(rows)
    assert lines[2] == "| greedy | on | 16.00 | 9.60 | 40% | 0.62 | 2.00 | 171 | 8.40 (15) |"
    assert "| `gemm` | 2.200 | 62.0 |" in lines and len([line for line in lines if line.startswith("| greedy")]) == 1
    assert report.trace_table(rows[1:]) == []
    engine = report.engine_table([{**rows[0], "backend_sampling": "off", "tok_s": 1.0, "outputs": 1}, rows[1]])
    assert [line.split(" | ")[2] for line in engine if line.startswith("| greedy")] == ["off"]  # traced: not a rep


def test_a_server_whose_rows_all_timed_out_shows_failed_cells():
    """61fd822's H200 run: the host-sampling server hung and every row of it timed out (rows with an
    error, no tok_s); the bench's own table crashed on them and the run exited 1."""
    table = bench_module("gpu/decode_scale.py").table
    rows = [{"server": "hung", "kind": "throughput", "mode": "greedy", "rep": 0, "clients": 128,
             "error": "TimeoutError: ", "restart": "ready after 6.5 s"},
            {"server": "fine", "kind": "throughput", "mode": "greedy", "rep": 0, "clients": 128, "tok_s": 1905.1},
            {"server": "fine", "kind": "throughput", "mode": "greedy", "rep": 1, "clients": 128, "tok_s": 1906.1}]
    assert table({"results": {"servers": rows}}).splitlines()[2] == "| greedy | 128 | failed | 1,906 |"
