"""bench/online.py's client and report (issue 48): against a real server on loopback it measures
every forced token of streamed answers sent at Poisson offsets; server-sent events are split as the
SSE spec says (not at a Unicode line break inside a JSON string, where httpx's aiter_lines splits);
goodput counts only requests within the objective; the page shows medians over reps."""
from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest

from conftest import live_server
from report_pages import REPO, tables

sys.path.append(str(REPO / "bench"))  # last: bench/ scripts must not shadow the standard library
import harness  # noqa: E402
import online_data  # noqa: E402
import online_load  # noqa: E402
import online_report  # noqa: E402
import online_sweep  # noqa: E402


def test_client_measures_every_forced_token_at_poisson_offsets(tiny_model):
    items = [online_data.Item(f"Request {i} asks about the harbor.", 8, n, "sharegpt") for i, n in enumerate((5, 9, 3))]
    model = {"model": str(tiny_model), "n_ctx": 1024, "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model]) as server:
        arm = online_sweep.Arm("ours", server, "min_tokens", online_load.OURS_FIELDS)  # type: ignore[arg-type]
        outcomes, duration = asyncio.run(online_load.run_point(
            server.url, items, [arm.body(item) for item in items], rate=20.0, seed=3, limit_s=60.0))
    assert [o.sent_s for o in outcomes] == online_load.arrivals(3, 20.0, 3)
    for outcome, item in zip(outcomes, items):
        assert outcome.error is None
        assert outcome.output_tokens == item.output_tokens
        assert len(outcome.itl_s) == item.output_tokens - 1
        assert 0 < outcome.ttft_s <= outcome.latency_s
        assert outcome.server_ms is not None  # the server's own marks: its TTFT within the client's
        assert 0 < outcome.server_ms["ttft_ms"] <= outcome.ttft_s * 1000 and outcome.server_ms["prefill_ms"] > 0
    summary = online_load.summarize(outcomes, duration, online_load.Objective(ttft_s=60.0, tpot_s=60.0))
    assert summary["completed"] == 3 and summary["goodput"] == round(3 / duration, 4)
    assert online_load.summarize(outcomes, duration, online_load.Objective(ttft_s=0.0, tpot_s=60.0))["goodput"] == 0


def test_server_sent_events_are_split_by_the_spec_not_by_unicode_line_breaks():
    text = "one\u2028two"
    body = ("data: " + json.dumps({"choices": [{"text": text}]}, ensure_ascii=False) + "\n\n"
            + 'data: {"choices": [{"text":\ndata: "x"}]}\r\n\r\n' + "data: [DONE]\n\n").encode()

    async def events() -> list[str]:
        return [e async for e in harness.sse_events(httpx.Response(200, content=body))]

    found = asyncio.run(events())
    assert [json.loads(e)["choices"][0]["text"] for e in found[:2]] == [text, "x"]
    assert found[2] == "[DONE]"


def outcome(ttft: float | None, latency: float | None, tokens: int, **kw) -> object:
    return online_load.Outcome("sharegpt", 10, tokens, 0.0, ttft_s=ttft, latency_s=latency, output_tokens=tokens, **kw)


def test_goodput_counts_requests_within_the_objective_and_cut_ones_fail():
    outcomes = [
        outcome(0.5, 1.4, 10),  # TTFT 0.5, TPOT 0.1: good
        outcome(1.5, 2.4, 10),  # TTFT over
        outcome(0.5, 3.2, 10),  # TPOT 0.3: over
        outcome(8.0, None, 0, error="cut at the run's limit", censored=True),
    ]
    summary = online_load.summarize(outcomes, 4.0, online_load.Objective(ttft_s=1.0, tpot_s=0.2))
    assert summary["goodput"] == 0.25 and summary["completed"] == 3 and summary["failed"] == 1
    assert summary["ttft_censored"] == 1 and summary["p99_ttft_s"] > 7.5


def test_page_shows_medians_over_reps_and_ours_over_the_best_peer(tmp_path, monkeypatch):
    """An --ours-arms arm (ours-s16) is ours, not a peer."""
    pytest.importorskip("matplotlib")  # the bench extra's, not the dev extra's
    runs = [{"arm": arm, "rate": 0.5, "rep": rep, "requests": 6, "completed": 6, "ttft_censored": 0,
             "goodput": good, "p99_ttft_s": 1.0 + rep, "median_ttft_s": 0.5, "median_itl_s": 0.04, "p99_itl_s": 0.1,
             "output_throughput": 10.0 * good}
            for arm, goods in (("ours", (0.3, 0.4, 0.2)), ("stock", (0.1, 0.3, 0.15)), ("ours-s16", (0.5, 0.5, 0.5)))
            for rep, good in enumerate(goods)]
    data = {"device": "cpu", "arms": ["ours", "stock", "ours-s16"], "objective": {"ttft_s": 2.0, "tpot_s": 0.25},
            "runs": runs,
            "mix": {"output_scale": 0.25, "long_share": 0.1, "long_low": 1024, "long_high": 6144}, "window_s": 24,
            "drain_s": 30, "complete": True}
    path = tmp_path / "online_cpu.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(online_report, "DOCS", tmp_path)
    monkeypatch.setattr(online_report, "SOURCES", (("cpu", "CPU", path),))
    page = online_report.write_page().read_text()
    goodput = tables(page)[0][0]
    assert goodput["ours, PFlash off"] == "0.300" and goodput["llama_cpp.server"] == "0.150"
    assert "over the best peer (llama_cpp.server): **2.00x**" in page
    assert ("ours, PFlash off 0.300 / 0.400 / 0.200 (0.5 req/s); llama_cpp.server 0.100 / 0.300 / 0.150 (0.5 req/s)"
            in page)
    assert (tmp_path / "online_cpu.png").stat().st_size > 0


def test_page_shows_a_changes_before_and_after_from_its_data_file(tmp_path, monkeypatch):
    """`bench/online.py --base-tree` runs (arm ours-base) land on the page as their own section, the
    data file's title and notes first, each arm's medians over the reps in its column."""
    runs = [{"arm": arm, "rate": 0.3, "rep": rep, "requests": 6, "completed": 6, "ttft_censored": 0, "goodput": good,
             "p99_ttft_s": 1.0, "median_ttft_s": 0.5, "median_itl_s": 0.03, "p99_itl_s": itl, "output_throughput": 9.0}
            for arm, goods, itl in (("ours", (0.2, 0.3, 0.25), 0.15), ("ours-base", (0.1, 0.2, 0.3), 0.4))
            for rep, good in enumerate(goods)]
    data = {"title": "CPU: a change", "notes": ["what changed"], "command": "python bench/online.py --base-tree B",
            "arms": ["ours", "ours-base"], "runs": runs}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "online_change_x.json").write_text(json.dumps(data))
    monkeypatch.setattr(online_report, "DOCS", tmp_path)
    monkeypatch.setattr(online_report, "SOURCES", ())
    page = online_report.write_page().read_text()
    assert "## CPU: a change\n\n- what changed\n- Command: `python bench/online.py --base-tree B`" in page
    goodput, _, itl = tables(page)[:3]
    assert goodput[0] == {"rate (req/s)": "0.3", "ours, PFlash off": "0.250", "ours, PFlash off (base tree)": "0.200"}
    assert itl[0]["ours, PFlash off (base tree)"] == "30 / 400"


def test_a_sweep_cut_by_its_budget_goes_on_with_only_the_runs_it_lacks(tmp_path, monkeypatch):
    """`bench/online.py --resume F`: the rows F has are kept and not run again; the rest run in the
    sweep's order (each rep's arms rotated), and the file says when it is complete."""
    arms = [online_sweep.Arm(label, None, "min_tokens") for label in ("ours", "peer")]  # type: ignore[arg-type]
    sweep = online_sweep.Sweep(arms, [0.5, 1.0], 2, lambda *_: [], None, lambda last: last,  # type: ignore[arg-type]
                               tmp_path / "sweep.json", {})
    monkeypatch.setattr(sweep, "write", lambda complete: setattr(sweep, "complete", complete))
    sweep.rows = [{"arm": arm, "rate": rate, "rep": 0} for rate in (0.5, 1.0) for arm in ("ours", "peer")]
    sweep.rows.append({"arm": "peer", "rate": 0.5, "rep": 1})
    ran = []
    monkeypatch.setattr(sweep, "one", lambda arm, rate, rep, say: ran.append((arm.label, rate, rep)) or
                        {"arm": arm.label, "rate": rate, "rep": rep})
    sweep.run(lambda message: None)
    assert ran == [("ours", 0.5, 1), ("peer", 1.0, 1), ("ours", 1.0, 1)]
    assert len(sweep.rows) == 8 and sweep.complete


def test_the_committed_page_is_what_the_report_writes(tmp_path, monkeypatch):
    """docs/online.md is `python bench/online.py --report`'s from docs/data: a section written by hand
    beside it (session 69's) was lost at the next regeneration; its data file now carries its title and
    notes (online_change_*.json) as every change's does."""
    (tmp_path / "data").symlink_to(REPO / "docs" / "data")
    monkeypatch.setattr(online_report, "DOCS", tmp_path)
    monkeypatch.setattr(online_report, "plot", lambda *args: None)  # the PNGs: compared by eye, not here
    assert online_report.write_page().read_text() == (REPO / "docs" / "online.md").read_text()
