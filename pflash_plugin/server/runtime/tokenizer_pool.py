"""The routes whose whole work is tokenizing (count_tokens, /extras/tokenize and its count,
/extras/detokenize) run on threads of their own, a few at most, with a queue limit of their own and
a 429 past it: they never reach the engine's queue, and unbounded they took the CPU from generation
(6-8 clients counting 126K-character texts slowed a short chat 5-14x, issue 49).

A request that leaves while its work waits gives its place back; work already running runs to its
end and holds its place until then, so the threads never run more than `workers` jobs.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ...engine.request import ErrorKind
from ..wire.errors import http_of
from ..wire.protocol import RequestError

T = TypeVar("T")


class TokenizerPool:
    """`workers` threads; at most `max_queue` jobs waiting for one; more are refused with a 429."""

    def __init__(self, workers: int, max_queue: int) -> None:
        self.workers, self.max_queue = workers, max_queue
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="pflash-tokenizer")
        self._held = 0  # jobs queued or running
        self._lock = threading.Lock()

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the pool's threads; a RequestError 429 when the pool is full."""
        with self._lock:
            if self._held >= self.workers + self.max_queue:
                status, kind, code = http_of(ErrorKind.BUSY)
                raise RequestError(status, f"the tokenizer is busy ({self.workers} running, {self.max_queue} "
                                   "waiting): retry later", kind, code=code)
            self._held += 1
        future = self._executor.submit(work, *args)
        future.add_done_callback(self._release)  # also when cancelled before it ran
        return await asyncio.wrap_future(future)

    def _release(self, _: Future[Any]) -> None:
        with self._lock:
            self._held -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
