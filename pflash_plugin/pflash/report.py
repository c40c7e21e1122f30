"""What `usage.timings.pflash` says of one request's compression, built only here: the compressor
fills it in as it goes, planning and the engine only ever say why a prompt was not compressed."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

MANDATORY_OVER_BUDGET = "the head, the query and its suffix alone exceed the budget"


@dataclass
class PflashReport:
    """Fields left None are not reported; `to_json` gives the keys clients read."""

    status: str  # compressed | skipped | fallback (the full prompt was prefilled)
    original_tokens: int
    reason: str | None = None  # why skipped or fallen back
    kept_tokens: int | None = None
    keep_ratio: float | None = None
    drafter_load_ms: float | None = None
    layers_run: int | None = None
    scorer: str | None = None  # native-cpu | native-cuda | native-hip | numpy
    draft_windows: int | None = None
    draft_ms: float | None = None  # drafter forward, capture and scoring
    draft_timings: dict[str, float] = field(default_factory=dict)  # the drafter's: forward_ms, capture_ms, score_ms
    select_ms: float | None = None
    segments_total: int | None = None
    segments_kept: int | None = None
    cause: str | None = None  # a skip's reason as a label of few values, for /metrics (not in to_json)

    @classmethod
    def skipped(cls, original_tokens: int, reason: str, cause: str) -> PflashReport:
        """Not compressed, decided before any drafting."""
        return cls("skipped", original_tokens, reason, cause=cause)

    def ending(self, status: str, reason: str, cause: str | None = None) -> PflashReport:
        """This report, ended as skipped (for `cause`) or fallback, for `reason`."""
        return replace(self, status=status, reason=reason, cause=cause)

    def to_json(self) -> dict[str, Any]:
        """The set fields, in the key order clients have seen: measurements first, then the outcome;
        a skip decided before any drafting (its original size alone) leads with its outcome."""
        early = self.status == "skipped" and self.kept_tokens is None
        out: dict[str, Any] = {}
        for name in _EARLY_SKIP_ORDER if early else _ORDER:
            value = getattr(self, name)
            if name == "draft_timings":
                out.update(value)
            elif value is not None:
                out[name] = value
        return out


_ORDER = ("original_tokens", "kept_tokens", "keep_ratio", "drafter_load_ms", "layers_run", "scorer", "draft_windows",
          "draft_ms", "draft_timings", "select_ms", "status", "reason", "segments_total", "segments_kept")
_EARLY_SKIP_ORDER = ("status", "reason", "original_tokens")
