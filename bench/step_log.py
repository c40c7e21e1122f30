"""Per-step parts of an engine run, so that a steady decode step is told apart from the rest.

host_overhead.PhaseTimer sums each part over the run and divides by the steps: a mean that carries
the prompts' prefill steps, the first decode step after them (a graph llama.cpp builds anew and
ggml-cuda captures anew) and any other step of a new shape. StepLog snapshots PhaseTimer's sums at
each step's start (Scheduler.schedule), so each step's parts are known, and counts each step's tokens
and llama.cpp's graph reuses. A steady step decodes one token in each of `rows` rows on the graph of
the step before: the shape a long greedy run is made of."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


class StepLog:
    def __init__(self, engine: Any, timer: Any, rows: int) -> None:
        self.rows = rows
        self._timer, self._ctx = timer, engine.runner.ctx
        self._marks: list[tuple[float, dict[str, float], int, int]] = []  # (time, sums, reuses, tokens) per step
        self._tokens = 0
        scheduler = engine.scheduler
        scheduler.schedule = self._at_step(scheduler.schedule)
        self._ctx.decode = self._counting(self._ctx.decode)

    def _at_step(self, schedule: Callable[[], Any]) -> Callable[[], Any]:
        def marked() -> Any:
            self._mark()
            return schedule()
        return marked

    def _counting(self, decode: Callable[[Any], None]) -> Callable[[Any], None]:
        def counted(batch: Any) -> None:
            self._tokens += batch.n_tokens
            decode(batch)
        return counted

    def _mark(self) -> None:
        self._marks.append((time.perf_counter(), dict(self._timer.seconds), self._ctx.graph_reuses(), self._tokens))

    def summary(self) -> dict[str, Any]:
        """Medians over the steady steps (ms: the step and each part, "other" the step less its parts: the
        engine loop's own) and their mean step, how many steps were steady, and the share of the run's
        time in the others (prefill, rebuilt graphs, the last partial step)."""
        self._mark()
        steady: list[tuple[float, dict[str, float]]] = []
        total = other = 0.0
        for (t0, sums0, reuses0, tokens0), (t1, sums1, reuses1, tokens1) in zip(self._marks, self._marks[1:]):
            if tokens1 == tokens0:  # an idle pass of the loop: no step
                continue
            wall = t1 - t0
            total += wall
            if tokens1 - tokens0 == self.rows and reuses1 - reuses0 == 1:
                parts = {p: s - sums0.get(p, 0.0) for p, s in sums1.items()}
                steady.append((wall, {**parts, "other": wall - sum(parts.values())}))
            else:
                other += wall
        if not steady:
            return {"steady_steps": 0}
        names = sorted({p for _, step in steady for p in step})
        return {"steady_steps": len(steady), "other_steps_share": round(other / total, 3),
                "steady_step_ms": round(1000 * statistics.median(w for w, _ in steady), 3),
                "steady_step_mean_ms": round(1000 * statistics.mean(w for w, _ in steady), 3),
                "steady_parts_ms": {p: round(1000 * statistics.median(step.get(p, 0.0) for _, step in steady), 3)
                                    for p in names}}
