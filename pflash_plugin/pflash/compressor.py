"""PFlash compression of one prompt: draft, score, select. Plus the thread that runs it.

The compression thread owns the drafter context; the engine thread never touches it. Jobs carry
everything they need (tokens, query plan, keep ratio), so the two threads share no mutable state
beyond a cancel flag and a progress counter.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .drafter import Cancelled, Drafter, DrafterError, Neighbours
from .query import QueryPlan
from .attention_mass import NonFiniteScores
from .selection import KeepCurve, Selection, TokenBoundaries, budget_for, segment_at_boundaries, select

log = logging.getLogger(__name__)
MANDATORY_OVER_BUDGET = "the head, the query and its suffix alone exceed the budget"


@dataclass
class PflashConfig:
    mode: str = "off"  # off | auto | always
    threshold: int = 2048
    threshold_note: str = ""  # why the threshold is not the configured one (start-up calibration)
    keep_ratio: float = 0.25
    curve: KeepCurve | None = None
    query_tokens: int = 8
    segment_min: int = 16
    segment_max: int = 128
    select: Callable[..., Selection | None] = select  # select(mass, segments, budget, mandatory)

    def ratio_for(self, n_tokens: int, override: float | None = None) -> float:
        if override is not None:
            return override
        return self.curve.ratio(n_tokens) if self.curve else self.keep_ratio


@dataclass
class CompressionJob:
    tokens: list[int]
    plan: QueryPlan
    keep_ratio: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    progress: int = 0  # tokens drafted so far (written by the compression thread)


@dataclass
class CompressionResult:
    tokens: list[int]  # what the target prefills (the original prompt on skip/fallback)
    report: dict[str, Any]
    kept: list[int] | None = None  # indices of the prompt tokens kept, when compressed


class Compressor:
    """Synchronous compression; `drafter()` gives the drafter to use and `release` drops it."""

    def __init__(
        self,
        config: PflashConfig,
        piece: Callable[[int], bytes],
        drafter: Callable[[], Drafter],
        persistent: bool,
    ) -> None:
        self.config, self.piece = config, piece
        self._boundaries = TokenBoundaries(piece)  # used on the compression thread only
        self._make_drafter, self.persistent = drafter, persistent
        self._drafter: Drafter | None = drafter() if persistent else None
        # native-cpu | native-cuda | native-hip | numpy: known at start for a persistent drafter
        self.scorer_name: str | None = self._drafter.scorer.name if self._drafter else None

    def compress(self, job: CompressionJob, neighbours: Neighbours = Neighbours()) -> CompressionResult:
        tokens, plan = job.tokens, job.plan
        n = len(tokens)
        report: dict[str, Any] = {"original_tokens": n, "kept_tokens": n, "keep_ratio": 1.0}
        budget = budget_for(n, job.keep_ratio)
        if not plan.fits(n, budget):
            return self._skip(tokens, report, MANDATORY_OVER_BUDGET)
        t0 = time.perf_counter()
        drafter = self._drafter or self._make_drafter()
        t1 = time.perf_counter()
        report["drafter_load_ms"] = round((t1 - t0) * 1000.0, 3)
        try:
            drafted = drafter.run(
                tokens + list(plan.extra_query),
                plan.query_start,
                plan.query_end,
                should_stop=job.cancelled.is_set,
                progress=lambda done: setattr(job, "progress", done),
                neighbours=neighbours,
            )
        except NonFiniteScores as error:
            return self._fallback(tokens, report, f"non-finite scores: {error}")
        except (DrafterError, MemoryError) as error:
            return self._fallback(tokens, report, str(error))
        finally:
            if self.persistent:
                self._drafter = drafter
            else:
                drafter.close()
        self.scorer_name = drafted.scorer
        t2 = time.perf_counter()
        segments = segment_at_boundaries(self._boundaries(tokens), self.config.segment_min, self.config.segment_max)
        selection = self.config.select(drafted.mass, segments, budget, plan.mandatory(n))
        t3 = time.perf_counter()
        report.update(
            layers_run=drafted.layers_run,
            scorer=drafted.scorer,
            draft_windows=drafted.windows,
            draft_ms=round((t2 - t1) * 1000.0, 3),  # drafter forward, capture and scoring
            **drafted.timings,
            select_ms=round((t3 - t2) * 1000.0, 3),
        )
        if selection is None:
            return self._skip(tokens, report, MANDATORY_OVER_BUDGET)
        kept = selection.take(tokens)
        report.update(
            status="compressed",
            kept_tokens=len(kept),
            keep_ratio=round(len(kept) / n, 4),
            segments_total=selection.segments_total,
            segments_kept=selection.segments_kept,
        )
        return CompressionResult(kept, report, selection.token_indices())

    @staticmethod
    def _skip(tokens: list[int], report: dict, reason: str) -> CompressionResult:
        return CompressionResult(tokens, {**report, "status": "skipped", "reason": reason})

    @staticmethod
    def _fallback(tokens: list[int], report: dict, reason: str) -> CompressionResult:
        log.warning("pflash fell back to a full prefill: %s", reason)
        return CompressionResult(tokens, {**report, "status": "fallback", "reason": reason})

    def close(self) -> None:
        if self._drafter is not None:
            self._drafter.close()
            self._drafter = None


class CompressionWorker:
    """One thread that compresses jobs in arrival order and hands each result to `deliver`.

    The owner (the engine) sets `should_yield` (requests wait for a first token: the drafter steps
    aside) and `should_share` (slots are decoding: the drafter paces itself)."""

    STOP_TIMEOUT_S = 60.0

    def __init__(self, compressor: Compressor, name: str = "pflash") -> None:
        self.compressor = compressor
        self.should_yield: Callable[[], bool] = lambda: False
        self.should_share: Callable[[], bool] = lambda: False
        self._jobs: queue.SimpleQueue[tuple[CompressionJob, Callable[[CompressionResult], None]] | None] = queue.SimpleQueue()
        self._current: CompressionJob | None = None
        self._thread = threading.Thread(target=self._loop, name=f"{name}-compress", daemon=True)
        self._thread.start()

    def submit(self, job: CompressionJob, deliver: Callable[[CompressionResult], None]) -> None:
        self._jobs.put((job, deliver))

    def stop(self) -> None:
        """Cancel the job in flight (the drafter stops between chunks), end the thread once the
        queued jobs are done (the engine cancels them at shutdown), then free the drafter: never
        while the thread may still be using it."""
        self._jobs.put(None)
        current = self._current
        if current is not None:
            current.cancelled.set()
        self._thread.join(timeout=self.STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("the compression thread did not stop within %.0f s: its drafter is left allocated",
                      self.STOP_TIMEOUT_S)
            return
        self.compressor.close()

    def _loop(self) -> None:
        neighbours = Neighbours(lambda: self.should_yield(), lambda: self.should_share())
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, deliver = item
            if job.cancelled.is_set():
                continue
            self._current = job
            try:
                result = self.compressor.compress(job, neighbours)
            except Cancelled:
                continue
            except Exception as error:  # a bug in scoring must not kill the thread or the request
                log.exception("pflash compression failed")
                result = Compressor._fallback(job.tokens, {"original_tokens": len(job.tokens)}, f"internal error: {error}")
            finally:
                self._current = None
            deliver(result)
