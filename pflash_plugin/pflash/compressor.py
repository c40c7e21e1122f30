"""PFlash compression of one prompt: draft, score, select. Plus the thread that runs it.

The compression thread owns the drafter context; the engine thread never touches it. Jobs carry
everything they need (tokens, query plan, keep ratio), so the two threads share no mutable state
beyond a cancel flag and a progress counter (and the engine's activity, which this thread only reads).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .draft_lane import Cancelled, DrafterError
from .drafter import Drafter
from .media_text import TextView
from .pacing import POLITE_S, Alone, Neighbours, Pacing
from .query import QueryPlan
from .attention_mass import NonFiniteScores
from .report import MANDATORY_OVER_BUDGET, PflashReport
from .selection import KeepCurve, Selection, TokenBoundaries, budget_for, segment_at_boundaries, select

log = logging.getLogger(__name__)


@dataclass(frozen=True)
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
    polite_s: float = POLITE_S  # a prompt's draft steps aside for its neighbours this long after its arrival

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
    created: float = field(default_factory=time.monotonic)  # the prompt's arrival, as its draft's pacing counts

    def skipped(self, reason: str, cause: str) -> PflashReport:
        """The report of this job when it is not run (the engine decided against it)."""
        return PflashReport.skipped(len(self.tokens), reason, cause)


@dataclass
class CompressionResult:
    tokens: list[int]  # what the target prefills (the original prompt on skip/fallback)
    report: PflashReport
    selection: Selection | None = None  # the segments kept, when compressed (benchmarks compare them)


class Compressor:
    """Compresses one prompt at a time on the caller's thread. `drafter()` makes the drafter: kept
    for every prompt when `persistent`, else made and closed per prompt."""

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

    def compress(self, job: CompressionJob, neighbours: Neighbours = Alone()) -> CompressionResult:
        tokens, plan = job.tokens, job.plan
        n = len(tokens)
        report = PflashReport("compressed", n, kept_tokens=n, keep_ratio=1.0)
        budget = budget_for(n, job.keep_ratio)
        if not plan.fits(n, budget):
            return self._over_budget(tokens, report)
        t0 = time.perf_counter()
        drafter = self._drafter or self._make_drafter()
        t1 = time.perf_counter()
        report.drafter_load_ms = round((t1 - t0) * 1000.0, 3)
        view = TextView.of(tokens)  # a prompt with media: the drafter reads its text alone (media_text.py)
        text = view.text(tokens) if view else tokens
        to_text = view.to_text if view else int
        try:
            drafted = drafter.run(
                text + list(plan.extra_query),
                to_text(plan.query_start),
                to_text(plan.query_end),
                should_stop=job.cancelled.is_set,
                progress=lambda done: setattr(job, "progress", done),
                pacing=Pacing(neighbours, job.created, self.config.polite_s),
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
        flags, mass = self._boundaries(text), drafted.mass
        mandatory = plan.mandatory(n)
        if view:
            flags, mass, mandatory = view.boundaries(flags), view.mass(mass), mandatory + list(view.media)
        segments = segment_at_boundaries(flags, self.config.segment_min, self.config.segment_max)
        selection = self.config.select(mass, segments, budget, mandatory)
        t3 = time.perf_counter()
        report.layers_run, report.scorer, report.draft_windows = drafted.layers_run, drafted.scorer, drafted.windows
        report.draft_ms = round((t2 - t1) * 1000.0, 3)
        report.draft_timings = drafted.timings
        report.select_ms = round((t3 - t2) * 1000.0, 3)
        if selection is None:
            return self._over_budget(tokens, report)
        kept = selection.take(tokens)
        report.kept_tokens, report.keep_ratio = len(kept), round(len(kept) / n, 4)
        report.segments_total, report.segments_kept = selection.segments_total, selection.segments_kept
        return CompressionResult(kept, report, selection)

    @staticmethod
    def _over_budget(tokens: list[int], report: PflashReport) -> CompressionResult:
        """The mandatory spans alone take more than the budget: the prompt goes uncompressed."""
        return CompressionResult(tokens, report.ending("skipped", MANDATORY_OVER_BUDGET, "over_budget"))

    @staticmethod
    def _fallback(tokens: list[int], report: PflashReport, reason: str) -> CompressionResult:
        log.warning("pflash fell back to a full prefill: %s", reason)
        return CompressionResult(tokens, report.ending("fallback", reason))

    def close(self) -> None:
        if self._drafter is not None:
            self._drafter.close()
            self._drafter = None


class CompressionWorker:
    """One thread that compresses jobs in arrival order, each beside the neighbours it was
    submitted with (the engine's activity: the drafter steps aside or paces itself), and hands
    each result to its `deliver`."""

    STOP_TIMEOUT_S = 60.0

    def __init__(self, compressor: Compressor, name: str = "pflash") -> None:
        self.compressor = compressor
        self._jobs: queue.SimpleQueue[_Submitted | None] = queue.SimpleQueue()
        self._current: CompressionJob | None = None
        self._thread = threading.Thread(target=self._loop, name=f"{name}-compress", daemon=True)
        self._thread.start()

    def submit(self, job: object, neighbours: Neighbours, deliver: Callable[[CompressionResult], None]) -> None:
        """Queue `job` (a CompressionJob: the engine passes it through as it got it)."""
        if not isinstance(job, CompressionJob):
            raise TypeError(f"the compression worker runs CompressionJob, not {type(job).__name__}")
        self._jobs.put(_Submitted(job, neighbours, deliver))

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
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job = item.job
            if job.cancelled.is_set():
                continue
            self._current = job
            try:
                result = self.compressor.compress(job, item.neighbours)
            except Cancelled:
                continue
            except Exception as error:  # a bug in scoring must not kill the thread or the request
                log.exception("pflash compression failed")
                report = PflashReport("fallback", len(job.tokens))
                result = Compressor._fallback(job.tokens, report, f"internal error: {error}")
            finally:
                self._current = None
            item.deliver(result)


@dataclass(frozen=True)
class _Submitted:
    job: CompressionJob
    neighbours: Neighbours
    deliver: Callable[[CompressionResult], None]
