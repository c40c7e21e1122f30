"""bench/gpu/decode_scale_report.py on the committed H200 results, with every figure moved so that
the page's numbers can only come from the data: medians, ratios, the engine's step times, notes."""
from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVERS = REPO / "docs" / "data" / "decode_scale_h200.json"
ENGINE = REPO / "docs" / "data" / "decode_scale_engine_h200.json"


def report_module():
    path = REPO / "bench" / "gpu" / "decode_scale_report.py"
    spec = importlib.util.spec_from_file_location("decode_scale_report", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def moved_data(tmp_path: Path) -> tuple[Path, Path]:
    """The committed results with each rep's tok/s scaled by its own factor (llama-server without
    `-bs` made the faster at top_p) and the engine's times shifted, written to tmp_path."""
    servers, engine = json.loads(SERVERS.read_text()), json.loads(ENGINE.read_text())
    for i, row in enumerate(r for r in servers["results"]["servers"] if "tok_s" in r):
        faster = 2.5 if (row["server"], row["mode"]) == ("llama-server", "top_p") else 1.0
        row["tok_s"] = round(row["tok_s"] * (1.3 + 0.01 * i) * faster, 1)
    for i, row in enumerate(engine["results"]["engine"]):
        row.update(tok_s=row["tok_s"] + 7, host_ms=round(row["host_ms"] + 0.111 * (i + 1), 3),
                   decode_ms=round(row["decode_ms"] + 0.222, 3))
    paths = tmp_path / "servers.json", tmp_path / "engine.json"
    paths[0].write_text(json.dumps(servers))
    paths[1].write_text(json.dumps(engine))
    return paths


def tables(page: str) -> list[list[dict[str, str]]]:
    """Every markdown table of the page, each row as {column: cell}."""
    found, block = [], []
    for line in [*page.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip("|").split("|")])
        elif block:
            found.append([dict(zip(block[0], row)) for row in block[2:]])
            block = []
    return found


def table_with(page: str, column: str) -> list[dict[str, str]]:
    return next(t for t in tables(page) if t and column in t[0])


def number(cell: str) -> float:
    return float(cell.split(" ")[0].replace(",", "").rstrip("x"))


def test_the_page_reports_the_medians_ratios_and_step_times_of_its_data(tmp_path):
    servers, engine = moved_data(tmp_path)
    (tmp_path / "decode_scale.md").write_text("old page\n<!-- notes -->\nkept by hand\n")
    report_module().main(["--data", str(servers), str(engine), "--out-dir", str(tmp_path), "--no-plot"])
    page = (tmp_path / "decode_scale.md").read_text()
    assert page.endswith("<!-- notes -->\nkept by hand\n") and "old page" not in page

    rows = [r for r in json.loads(servers.read_text())["results"]["servers"] if r.get("kind") == "throughput"]
    median = {(r["mode"], r["server"]): statistics.median(x["tok_s"] for x in rows
                                                          if (x["mode"], x["server"]) == (r["mode"], r["server"]))
              for r in rows}
    columns = {"ours": "ours, `--backend_sampling on` (device)",
               "ours-host-sampling": "ours, `--backend_sampling off` (host)",
               "llama-server": "llama-server", "llama-server-bs": "llama-server `-bs`"}
    throughput = {row["mode"].split(" ")[0]: row for row in table_with(page, columns["ours"])}
    assert set(throughput) == {"greedy", "top_p", "seeded"}
    for (mode, server), value in median.items():
        assert throughput[mode][columns[server]].startswith(f"{value:,.0f} ("), (mode, server)

    assert median[("top_p", "llama-server")] > median[("top_p", "llama-server-bs")]
    ratios = {row["mode"]: row for row in table_with(page, "host / -bs")}
    for mode in ("greedy", "top_p", "seeded"):
        best = max(median[(mode, "llama-server")], median[(mode, "llama-server-bs")])
        auto = median[(mode, "ours-host-sampling" if mode == "greedy" else "ours")]
        device, host = median[(mode, "ours")], median[(mode, "ours-host-sampling")]
        assert ratios[mode]["device / -bs"] == f"{device / median[(mode, 'llama-server-bs')]:.2f}x"
        assert ratios[mode]["host / llama-server"] == f"{host / median[(mode, 'llama-server')]:.2f}x"
        assert number(ratios[mode]["auto / llama-server's best"]) == pytest.approx(auto / best, abs=0.005)

    steps = table_with(page, "host ms")
    for row, expected in zip(steps, json.loads(engine.read_text())["results"]["engine"]):
        assert (row["mode"], row["backend sampling"]) == (expected["mode"], expected["backend_sampling"])
        assert number(row["host ms"]) == expected["host_ms"] and number(row["decode ms"]) == expected["decode_ms"]
        assert number(row["tok/s"]) == round(expected["tok_s"])
    assert "Greedy tokens with the device on equalled those with it off" in page


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    report_module().main(["--data", str(SERVERS), str(ENGINE), "--out-dir", str(tmp_path)])
    assert (tmp_path / "decode_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "decode_scale.png").stat().st_size > 10_000
