"""The events the scheduler queued for requests' sinks, delivered in one place.

The scheduler never calls a sink while it decides: it queues events here, and `emit` delivers them,
so a sink that raises costs its own request and nothing else.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .request import Event, Request, discard


class Outbox:
    """Queued (request, event) pairs; `cut_off(request, error)` is told of a sink or flush that raised
    for a request still live (the scheduler fails it)."""

    def __init__(self, cut_off: Callable[[Request, Exception], None]) -> None:
        self._events: deque[tuple[Request, Event]] = deque()
        self._cut_off = cut_off

    def __bool__(self) -> bool:
        """Events wait for `emit`."""
        return bool(self._events)

    def push(self, request: Request, event: Event) -> None:
        self._events.append((request, event))

    def emit(self) -> None:
        """Deliver the queued events: the one place that calls sinks, then each distinct `flush`
        of the requests that got one, once. A sink or flush that raises (its client's event loop
        is gone) cuts its requests off, which then get nothing more."""
        flushes: dict[Callable[[], None], list[Request]] = {}
        while self._events:
            request, event = self._events.popleft()
            try:
                request.sink(event)
            except Exception as error:
                self._silence(request, error)
                continue
            if request.flush is not None:
                flushes.setdefault(request.flush, []).append(request)
        for flush, requests in flushes.items():
            try:
                flush()
            except Exception as error:
                for request in dict.fromkeys(requests):
                    self._silence(request, error)

    def _silence(self, request: Request, error: Exception) -> None:
        request.sink, request.flush = discard, None
        if not request.status.finished:
            self._cut_off(request, error)
