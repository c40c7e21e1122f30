"""The stall watch names where the engine thread hangs: its stack, logged once per stalled round."""
from __future__ import annotations

import logging
import threading
import time

from pflash_plugin.engine.watchdog import Watchdog


def test_a_stalled_round_logs_the_engine_thread_s_stack_once(caplog) -> None:
    release, inside = threading.Event(), threading.Event()
    watchdog = Watchdog(max_step_s=0.01)

    def hanging_in_a_decode() -> None:
        watchdog.thread = threading.get_ident()
        inside.set()
        release.wait(10)

    thread = threading.Thread(target=hanging_in_a_decode)
    thread.start()
    try:
        assert inside.wait(10)
        watchdog.started = time.monotonic() - 1.0
        with caplog.at_level(logging.ERROR, logger="pflash_plugin.engine.watchdog"):
            assert "not returning" in (watchdog.stalled() or "")
            assert watchdog.stalled() is not None  # still stalled, not logged again
        logged = [r.getMessage() for r in caplog.records]
        assert len(logged) == 1 and "hanging_in_a_decode" in logged[0]
    finally:
        release.set()
        thread.join()


def test_a_round_within_its_time_is_no_stall() -> None:
    watchdog = Watchdog(max_step_s=5.0)
    watchdog.started = time.monotonic()
    assert watchdog.stalled() is None and Watchdog(0.0).stalled() is None
