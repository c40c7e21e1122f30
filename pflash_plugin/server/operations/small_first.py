"""Small requests through the front door before large ones: a request whose body is large waits, a
bounded time, while requests with small bodies are between their headers and their engine
submission, before its body is read, parsed and prepared.

One event loop reads every request, and the large bodies' work holds the GIL wherever it runs
(for 22K token ids json.loads 1.1 ms, pydantic's validation 0.2 ms, the preparation's checks 0.8 ms
on this project's 2-core CPU): in mix8 on an H100 (4 bodies of 22K token ids, then 4 short requests, sent
together) the short requests' headers were in at 7-11 ms but their tiny bodies were read at
20-27 ms in 8 of 10 runs, once the long bodies had been read and parsed, where llama-server
answered them in 20 ms in all (docs/first_token_cpu.md). A large request's own first token is
seconds of prefill away: a wait of a few ms costs it little. Off with `--polite_prepare_ms 0` (the
default), which bounds each of a large request's two waits (this one, and server/runtime/polite.py's
while a first token is a step away)."""
from __future__ import annotations

import asyncio
from typing import MutableMapping

SMALL_BYTES = 64 * 1024  # a body up to this is parsed on the event loop in one piece (wire/errors.py)
PENDING = "small_pending"  # the request's state key while it counts


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length, None where it has none (a chunked body) or a bad one."""
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class SmallFirst:
    """Counts the small requests not yet handed to an engine; large ones wait for none to be left.
    Used on the event loop's thread only (the ASGI middleware, the routes)."""

    def __init__(self) -> None:
        self.pending = 0
        self._waiting: set[asyncio.Event] = set()  # one a waiting large request (an Event binds to its loop)

    def enter(self, state: MutableMapping[str, object], headers: list[tuple[bytes, bytes]]) -> bool:
        """Count a request whose body is small (a POST with a Content-Length up to SMALL_BYTES);
        True where it is large (a Content-Length over that), the kind that waits."""
        length = content_length(headers)
        if length is None:
            return False
        if length > SMALL_BYTES:
            return True
        state[PENDING] = True
        self.pending += 1
        return False

    def leave(self, state: MutableMapping[str, object]) -> None:
        """The request is handed to its engine (or answered): it counts no longer. Idempotent."""
        if state.pop(PENDING, False):
            self.pending -= 1
            if self.pending == 0:
                for waiter in self._waiting:
                    waiter.set()

    async def after_small(self, bound_s: float) -> None:
        """Return once no small request is pending, or after `bound_s` (0: at once)."""
        if not self.pending or bound_s <= 0:
            return
        clear = asyncio.Event()
        self._waiting.add(clear)
        try:
            await asyncio.wait_for(clear.wait(), bound_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiting.discard(clear)
