"""Graceful shutdown on SIGTERM/SIGINT under whichever server runs the app: ours
(`python -m pflash_plugin.server`) or the patched stock `python -m llama_cpp.server`.

At the first signal the engines start draining at once (new requests get 503; requests in flight
finish or are cancelled within the grace) while the server still listens, so that /health and new
requests are answered 503 rather than refused; once drained, the server's own graceful shutdown
runs. Streams end with their requests instead of being cut by sse-starlette; the app's lifespan
then frees the models.

Whatever the connections do (a client that sent half a body holds its connection until the body
timeout), the process is gone `HARD_MARGIN_S` after the grace: the drain, the server's shutdown and
the lifespan each had a timeout of their own, and together they took 15-27.7 s against a 10 s grace
(issue 49). A second signal ends the process at once.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from sse_starlette.sse import AppStatus

from ..operations.log_handoff import write_out
from ..runtime.models import ModelRegistry

SIGNALS = (signal.SIGINT, signal.SIGTERM)
HARD_MARGIN_S = 2.0  # past the grace: the server's shutdown and the models' release, then the exit
DEADLINE_EXIT = 1  # the exit status of a shutdown the deadline ended

log = logging.getLogger(__name__)


def exit_now(status: int, why: str) -> None:
    """End the process at once, whatever its threads and connections are doing (logs flushed)."""
    try:
        log.error("%s: exiting now", why)
        write_out()  # the records queued for the log's thread (operations/log_handoff.py)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001  a signal can land inside a write (a reentrant flush): exit all the same
        pass
    finally:
        os._exit(status)


def exit_by(deadline_s: float) -> threading.Timer:
    """A timer that ends the process `deadline_s` from now, unless it has ended by then."""
    timer = threading.Timer(deadline_s, exit_now,
                            (DEADLINE_EXIT, f"the shutdown ran past its deadline ({deadline_s:g} s after the signal)"))
    timer.name, timer.daemon = "pflash-shutdown-deadline", True
    timer.start()
    return timer


def drain_on_signal(models: ModelRegistry, grace_s: float) -> None:
    """Chain the drain onto the server's own SIGTERM/SIGINT handlers, which uvicorn installs before
    the app's lifespan starts. Only in the main thread, where signals arrive, and only over a
    server's handler: an app served some other way keeps its signals as they are."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = {int(sig): signal.getsignal(sig) for sig in SIGNALS}
    chained = {sig: handler for sig, handler in previous.items() if callable(handler)}
    if len(chained) < len(previous):
        return
    AppStatus.disable_automatic_graceful_drain()  # streams end with their requests
    started = threading.Lock()

    def drain(sig: int, frame: FrameType | None) -> None:
        models.drain(grace_s)
        AppStatus.should_exit = True  # every request has ended: close whatever stream is left
        chained[sig](sig, frame)  # now the server stops listening and shuts down

    def handler(sig: int, frame: FrameType | None) -> Any:
        if started.acquire(blocking=False):  # the first signal: the server shuts down once drained
            exit_by(grace_s + HARD_MARGIN_S)
            threading.Thread(target=drain, args=(sig, frame), name="pflash-drain", daemon=True).start()
            return None
        exit_now(128 + sig, f"a second {signal.Signals(sig).name} during the shutdown")

    for sig in SIGNALS:
        signal.signal(sig, handler)
