"""Small requests through the front door before large ones: a request whose body is large waits, a
bounded time (`--polite_prepare_ms`), before its body is read, while a request with a small body is
between its headers and its first token.

One process reads, parses and prepares every request beside the engine thread, and a large body's
work holds the GIL wherever it runs (json.loads, pydantic's validation, the token-id checks of 22K
ids: ~3 ms a body on 2 CPU cores). In mix8 on an H100 (4 bodies of 22K token ids, then 4 short
requests, sent together; docs/first_token_cpu.md) the short requests' tiny bodies were read 4-7 ms
after their headers and waited up to 18 ms for the engine thread to admit them, while the long bodies
were parsed: the GIL, not the work, set their first token. A large request's own first token is
seconds of prefill away: a wait of a step costs it little. The wait ends at the small requests'
first tokens, not their submission: between the two the engine thread runs their step.

b97d6c3 tried a wait that ended at the submission, before the request path's threads were kept
(wire/offload.py): thread starts on the event loop then set the short requests' time, and it gained
nothing measurable."""
from __future__ import annotations

import asyncio
import threading
from typing import MutableMapping

SMALL_BYTES = 64 * 1024  # a body up to this is parsed on the event loop in one piece (wire/errors.py)
PENDING = "small_pending"  # the request's state key while it counts
POLL_S = 0.001  # a first token is counted off on the engine thread: polled, as runtime/polite.py polls


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
    """Counts the small requests without a first token yet; large ones wait for none to be left.
    `enter` and `after_small` run on the event loop, `leave` on it or on an engine thread."""

    def __init__(self) -> None:
        self.pending = 0
        self._lock = threading.Lock()

    def enter(self, state: MutableMapping[str, object], headers: list[tuple[bytes, bytes]]) -> bool:
        """Count a request whose body is small (a Content-Length up to SMALL_BYTES); True where
        it is large (a Content-Length over that), the kind that waits."""
        length = content_length(headers)
        if length is None:
            return False
        if length > SMALL_BYTES:
            return True
        state[PENDING] = True
        with self._lock:
            self.pending += 1
        return False

    def leave(self, state: MutableMapping[str, object]) -> None:
        """The request has its first token, or is answered: it counts no longer. Idempotent
        (dict.pop is one step under the GIL: of two threads, one takes the mark)."""
        if state.pop(PENDING, False):
            with self._lock:
                self.pending -= 1

    async def after_small(self, bound_s: float) -> None:
        """Return once no small request is pending, or after `bound_s` (0: at once)."""
        if bound_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        while self.pending and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
