"""Graceful shutdown on SIGTERM/SIGINT under whichever server runs the app: ours
(`python -m pflash_plugin.server`) or the patched stock `python -m llama_cpp.server`.

At the first signal the engines start draining at once (new requests get 503; requests in flight
finish or are cancelled within the grace) while the server still listens, so that /health and new
requests are answered 503 rather than refused; once drained, the server's own graceful shutdown
runs (a second signal starts it at once). Streams end with their requests instead of being cut by
sse-starlette; the app's lifespan then frees the models.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from sse_starlette.sse import AppStatus

from .models import ModelRegistry

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
            threading.Thread(target=drain, args=(sig, frame), name="pflash-drain", daemon=True).start()
            return None
        return chained[sig](sig, frame)

    for sig in SIGNALS:
        signal.signal(sig, handler)
