"""The request path's worker threads (a large body's parse, a request's preparation), started with the
server and kept.

Starlette's `run_in_threadpool` hands work to AnyIO's pool, which starts a thread when none is idle and,
at a later hand-off, stops those idle for 10 s: a burst after a pause started a thread per request it
carried, and each `Thread.start` holds the event loop until the new thread has taken the GIL once.
In mix8 on this project's 2 CPU cores (8 requests at once, py-spy's timeline of the server), a fresh
server's first burst spent 14 ms of its event loop starting threads (140 ms with the cores shared by two
other busy processes); these threads are started at start-up (`start`) and never stopped."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")
THREADS = 16  # requests prepared at once; their work mostly holds the GIL, so more would only queue there

_pool = ThreadPoolExecutor(THREADS, thread_name_prefix="pflash-request")


@functools.cache  # once a process: its threads are never stopped (an app's second start, a test's, waits for none)
def start() -> None:
    """Every thread of the pool started now: each waits at a barrier until all are up, so none is
    reused before the next one starts."""
    barrier = threading.Barrier(THREADS)
    for started in [_pool.submit(barrier.wait) for _ in range(THREADS)]:
        started.result()


async def offload(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the pool, in a copy of the caller's context (as run_in_threadpool)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_pool, call)
