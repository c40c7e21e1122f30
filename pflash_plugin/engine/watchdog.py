"""The engine's stall watch: a round (one llama_decode and the host work around it) that has run past
`max_step_s` marks the engine stalled, so /health answers 503 and a supervisor restarts the server
(on two H200s a GPU hang held a step for minutes; a costly stop list or grammar holds it on the host)."""
from __future__ import annotations

import time


class Watchdog:
    def __init__(self, max_step_s: float) -> None:
        self.max_step_s = max_step_s  # 0: never stalled
        self.started: float | None = None  # monotonic start of the busy round running now; None: idle

    def stalled(self) -> str | None:
        """Why the engine is stalled; None if not. The whole round is timed, not only the decode: the
        host work around it (admission, sampling, stop strings, events) stalls every client alike."""
        started = self.started
        if not self.max_step_s or started is None:
            return None
        running = time.monotonic() - started
        if running <= self.max_step_s:
            return None
        return f"one step has run for {running:.0f} s (max_step_s {self.max_step_s:g}): the engine is not returning"
