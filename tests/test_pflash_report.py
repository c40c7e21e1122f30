"""usage.timings.pflash: the same keys, in the same order, as the dicts the report replaced."""
from __future__ import annotations

import json

from pflash_plugin.pflash.report import PflashReport


def measured(status: str = "compressed") -> PflashReport:
    return PflashReport(status, 1000, kept_tokens=250, keep_ratio=0.25, drafter_load_ms=1.5, layers_run=6,
                        scorer="numpy", draft_windows=1, draft_ms=40.0,
                        draft_timings={"forward_ms": 30.0, "capture_ms": 2.0, "score_ms": 8.0}, select_ms=0.5)


def test_a_compressed_report_keeps_its_keys_and_their_order():
    report = measured()
    report.segments_total, report.segments_kept = 40, 9
    assert list(report.to_json()) == [
        "original_tokens", "kept_tokens", "keep_ratio", "drafter_load_ms", "layers_run", "scorer", "draft_windows",
        "draft_ms", "forward_ms", "capture_ms", "score_ms", "select_ms", "status", "segments_total", "segments_kept"]


def test_a_skip_before_drafting_leads_with_its_reason():
    assert json.dumps(PflashReport.skipped(12, "no compressor", "no_compressor").to_json()) == (
        '{"status": "skipped", "reason": "no compressor", "original_tokens": 12}')


def test_skips_and_fallbacks_of_the_compressor_end_with_their_outcome():
    early = PflashReport("compressed", 1000, kept_tokens=1000, keep_ratio=1.0).ending("skipped", "budget")
    assert list(early.to_json()) == ["original_tokens", "kept_tokens", "keep_ratio", "status", "reason"]
    fallback = PflashReport("compressed", 1000, kept_tokens=1000, keep_ratio=1.0, drafter_load_ms=2.0)
    assert list(fallback.ending("fallback", "oom").to_json()) == [
        "original_tokens", "kept_tokens", "keep_ratio", "drafter_load_ms", "status", "reason"]
    internal = PflashReport("fallback", 7).ending("fallback", "bug")
    assert list(internal.to_json()) == ["original_tokens", "status", "reason"]
