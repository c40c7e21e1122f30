"""The engine's stall watch: a round (one llama_decode and the host work around it) that has run past
`max_step_s` marks the engine stalled, so /health answers 503 and a supervisor restarts the server
(on two H200s a GPU hang held a step for minutes; a costly stop list or grammar holds it on the host).
The first time a round is seen stalled, the engine thread's Python stack goes to the log: where it
hangs (in llama_decode, the device's wait, sampling) is what a hang's report needs."""
from __future__ import annotations

import logging
import sys
import time
import traceback

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, max_step_s: float) -> None:
        self.max_step_s = max_step_s  # 0: never stalled
        self.started: float | None = None  # monotonic start of the busy round running now; None: idle
        self.thread: int | None = None  # the engine thread's ident (threading.get_ident), for its stack
        self._reported: float | None = None  # the round whose stall was logged

    def stalled(self) -> str | None:
        """Why the engine is stalled; None if not. The whole round is timed, not only the decode: the
        host work around it (admission, sampling, stop strings, events) stalls every client alike."""
        started = self.started
        if not self.max_step_s or started is None:
            return None
        running = time.monotonic() - started
        if running <= self.max_step_s:
            return None
        reason = f"one step has run for {running:.0f} s (max_step_s {self.max_step_s:g}): the engine is not returning"
        if self._reported != started:
            self._reported = started
            log.error("%s; the engine thread is at:\n%s", reason, self.stack())
        return reason

    def stack(self) -> str:
        """The engine thread's Python stack now (its innermost frame last)."""
        frame = sys._current_frames().get(self.thread) if self.thread is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(the engine thread is not running)"
