"""uvicorn's HTTP/1.1 protocol with the limits an exposed server needs (issue 22).

uvicorn closes idle keep-alive connections (`timeout_keep_alive`, 5 s), but waits for ever for the
rest of a request's headers or body once they have begun, and refuses connections over
`limit_concurrency` only after a whole request has arrived. 1,100 clients that sent partial headers
(no API key needed) held every connection of a server under a 1,024-file limit, and each accept that
failed logged a traceback: 285 MB of log in 45 s. Here a connection must send its headers within
`header_timeout_s` and each part of its body within `body_timeout_s` of the one before, else it is
closed; connections over `max_connections` are closed as soon as they are accepted; and those
refusals are logged at most once per LOG_EVERY_S seconds, with a count.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

log = logging.getLogger("uvicorn.error")

LOG_EVERY_S = 10.0
FILES_KEPT = 128  # file descriptors left to the process itself (models, logs, sockets of its own)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


FEW_CONNECTIONS = 256  # below this a limit is said as a warning at start: a burst of clients meets it


def log_limit(max_connections: int, derived: bool) -> None:
    """Say at start how many connections stay open at once: past that a new one is closed as it is
    accepted, which its client sees as a dropped connection; where the open-file limit set it, how
    to raise it."""
    source = f"the open-file limit less {FILES_KEPT}: `ulimit -n` raises it" if derived else "--max_connections"
    log.log(logging.WARNING if max_connections < FEW_CONNECTIONS else logging.INFO,
            "at most %d connections open at once (%s); more are closed as soon as accepted", max_connections, source)


def default_max_connections() -> int:
    """The process's open-file limit less what it needs itself: past it, accept() fails."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) - FILES_KEPT)


class _BoundedLog:
    """One warning per LOG_EVERY_S seconds at most, counting what it did not log."""

    def __init__(self) -> None:
        self.last, self.skipped = 0.0, 0

    def warning(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last < LOG_EVERY_S:
            self.skipped += 1
            return
        suffix = f" ({self.skipped} more since the last such warning)" if self.skipped else ""
        log.warning("%s%s", message, suffix)
        self.last, self.skipped = now, 0


_refusals = _BoundedLog()
_timeouts = _BoundedLog()


class _Guarded(asyncio.Protocol):
    """The limits, over uvicorn's h11 or httptools protocol (the class after this one in the MRO)."""

    LIMITS: ConnectionLimits
    cycle: Any
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._read_timer: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "headers" or "body" while the timer runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's
        super().connection_made(transport)
        if len(self.connections) > self.LIMITS.max_connections:
            _refusals.warning(f"closed a new connection: {len(self.connections) - 1} are open "
                              f"(max_connections {self.LIMITS.max_connections})")
            transport.close()
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(data_arrived=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # uvicorn's protocol, after this class
        self._stop_timer()  # idle now: uvicorn's keep-alive timeout takes over

    def _watch(self, data_arrived: bool = False) -> None:
        """Time what the connection still owes: its headers (one deadline from their first byte, or
        from the connection), or its body (one deadline from its headers: a deadline per part would
        let a byte every few seconds hold the connection for ever)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            owed = "headers" if data_arrived or cycle is None else None
        else:
            owed = "body" if cycle.more_body else None
        if owed is None:
            self._stop_timer()
        elif owed != self._waiting_for:
            self._stop_timer()
            timeout = self.LIMITS.header_timeout_s if owed == "headers" else self.LIMITS.body_timeout_s
            self._waiting_for = owed
            self._read_timer = self.loop.call_later(timeout, self._timed_out)

    def _stop_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._waiting_for = None, None

    def _timed_out(self) -> None:
        limit = self.LIMITS.header_timeout_s if self._waiting_for == "headers" else self.LIMITS.body_timeout_s
        _timeouts.warning(f"closed a connection whose request {self._waiting_for} did not arrive within {limit:g} s")
        self._read_timer = None
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's `http` protocol class (`--http`, looked up as uvicorn's own `--http` is), with `limits`."""
    base = import_from_string(HTTP_PROTOCOLS[http])  # httptools' needs httptools installed: a start error
    return type("GuardedHTTPProtocol", (_Guarded, base), {"LIMITS": limits})
