"""Small requests through the front door before large ones (`--polite_door`, off by default until
measured on a GPU): a request whose body is large waits, a bounded time (`--polite_prepare_ms`), before
its body is read, while a request with a small body is between its headers and its engine, or while a
request's first token comes from the engine's next step.

One process reads, parses and prepares every request beside the engine thread, and a large body's
work holds the GIL wherever it runs (json.loads, pydantic's validation, the token-id checks of 22K
ids: ~3 ms a body on 2 CPU cores). In mix8 on an H100 (4 bodies of 22K token ids, then 4 short
requests, sent together; docs/first_token_cpu.md) the short requests' tiny bodies were read 4-7 ms
after their headers and waited up to 18 ms for the engine thread to admit them, while the long bodies
were parsed: the GIL, not the work, set their first token. A large request's own first token is
seconds of prefill away: a wait of a step costs it little. A small request counts until the engine
has it (admitted or queued: one queued for a slot is not worth a wait); from there the engine's own
flag says whether its first token is a step away (runtime/polite.py waits on the same flag).

b97d6c3 tried the first half alone, before the request path's threads were kept (wire/offload.py):
thread starts on the event loop then set the short requests' time, and it gained nothing measurable."""
from __future__ import annotations

import asyncio
from typing import Callable, MutableMapping

from ..wire.errors import LOOP_PARSE_BYTES

PENDING = "small_pending"  # the request's state key while it counts
POLL_S = 0.001  # the engine's flag is published on its thread: polled


async def wait_while(busy: Callable[[], bool], bound_s: float) -> None:
    """Return once `busy()` is false, or after `bound_s` (0: at once): the polite waits' one loop
    (this door's, runtime/polite.py's)."""
    if bound_s <= 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while busy() and loop.time() < deadline:
        await asyncio.sleep(POLL_S)


class SmallFirst:
    """Counts the small requests not yet handed to an engine; large ones wait for none to be left
    and no first token to be a step away. Used on the event loop's thread only."""

    def __init__(self) -> None:
        self.pending = 0

    def enter(self, state: MutableMapping[str, object], length: int | None) -> bool:
        """Count a request whose body is small (a Content-Length up to LOOP_PARSE_BYTES: parsed on
        the event loop); True where it is large (a Content-Length over that), the kind that waits."""
        if length is None:
            return False
        if length > LOOP_PARSE_BYTES:
            return True
        state[PENDING] = True
        self.pending += 1
        return False

    def leave(self, state: MutableMapping[str, object]) -> None:
        """The request is with its engine (or answered): it counts no longer. Idempotent."""
        if state.pop(PENDING, False):
            self.pending -= 1

    async def after_small(self, bound_s: float, first_token_next: Callable[[], bool]) -> None:
        """Return once no small request is pending and no first token is a step away
        (`first_token_next`), or after `bound_s` (0: at once)."""
        await wait_while(lambda: bool(self.pending) or first_token_next(), bound_s)
