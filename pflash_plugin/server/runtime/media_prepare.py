"""Where a media request's preparation runs and where its time goes (issue 46).

A chat with an image spends a few ms of CPU before the engine has it (the body's JSON, base64,
libmtmd's decode and resize), yet on the H200 its `prepare_ms` was ~200 ms at 32 clients: waits.
So its preparation runs on a bounded pool of its own (`MediaPreparation`), never queued behind the
shared thread pool's other work, few threads at once (32 threads taking turns on the GIL with the
engine thread and the event loop made each one's work last many times its CPU), and its parts are
timed: `/status` `media` sums them since start (`PrepareCounts`), bench/vision.py prints them per
round. A request without media is prepared as before (inline or on starlette's pool)."""
from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from fastapi import Request

from ...engine.stats import rounded
from ..operations.received import body_read, received
from ..wire.media_parts import CHAT_MEDIA, MediaPart
from ..wire.offload import offload
from ..wire.protocol import ChatCompletionRequest

T = TypeVar("T")
# the pool's size, whatever the cores: a request's preparation is a few ms of CPU and waits for the
# GIL between libmtmd's calls, so a few threads more than 2 cores' worth overlap those waits (on 2
# cores, 32 image chats at once: 2 threads waited 100-230 ms a request for one, 8 threads 12-30 ms,
# starlette's shared pool 43-72 ms); 32 threads would contend for the GIL with the engine thread
THREADS = 8


@dataclass
class PrepareCounts:
    """Seconds since start, summed over the media requests prepared (for /status and the bench)."""

    prepared: int = 0  # media requests prepared (refused ones too)
    prepare_upload_s: float = 0.0  # headers -> the body's last part read (the client's sending, the loop's reading)
    prepare_parse_s: float = 0.0  # that -> the route: the JSON parsed and validated (and the loop's turns between)
    prepare_wait_s: float = 0.0  # the route -> a pool thread took it
    prepare_media_s: float = 0.0  # the items read: base64 decoded, format and pixels checked (MediaReader)
    prepare_tokenize_s: float = 0.0  # libmtmd's decode + resize of the items and their chunks (media_tokens)
    prepare_work_s: float = 0.0  # the whole preparation on the thread (the two above in it)
    prepare_back_s: float = 0.0  # the thread's end -> the event loop took the result back
    prepare_threads: int = 0


@dataclass
class _Marks:
    """One request's parts on its thread (media_tokens and the reader add theirs)."""

    media_s: float = 0.0
    tokenize_s: float = 0.0


_current: contextvars.ContextVar[_Marks | None] = contextvars.ContextVar("pflash_media_marks", default=None)


def mark(part: str, seconds: float) -> None:
    """Add `seconds` to the running preparation's `part` ("media_s" or "tokenize_s"); nothing
    outside a MediaPreparation's thread (in-process callers, the tests' direct calls)."""
    marks = _current.get()
    if marks is not None:
        setattr(marks, part, getattr(marks, part) + seconds)


def carries_media(body: ChatCompletionRequest) -> bool:
    """Whether a chat's messages hold a media part (its preparation decodes and tokenizes media)."""
    for message in body.messages:
        if isinstance(message.content, list) and any(
                isinstance(part, MediaPart) or part.type in CHAT_MEDIA for part in message.content):
            return True
    return False


class MediaPreparation:
    """A bounded pool for media requests' preparation and the sums of its parts."""

    def __init__(self, threads: int | None = None) -> None:
        size = threads or THREADS
        self._pool = ThreadPoolExecutor(size, thread_name_prefix="pflash-media-prepare")
        self._lock = threading.Lock()
        self._counts = PrepareCounts(prepare_threads=size)

    async def run(self, http: Request, prepare: Callable[..., T], *args: Any) -> T:
        """`prepare(*args)` on the pool, its parts added to the counts (a refusal's too)."""
        entered = time.perf_counter()
        loop = asyncio.get_running_loop()
        marks = _Marks()
        spans: dict[str, float] = {}

        def timed() -> T:
            spans["started"] = time.perf_counter()
            token = _current.set(marks)
            try:
                return prepare(*args)
            finally:
                spans["done"] = time.perf_counter()
                _current.reset(token)

        try:
            return await loop.run_in_executor(self._pool, timed)
        finally:
            headers = received(http) or entered
            self._count(headers, body_read(http) or headers, entered, spans, marks)

    def _count(self, headers: float, body: float, entered: float, spans: dict[str, float], marks: _Marks) -> None:
        back = time.perf_counter()
        started, done = spans.get("started", entered), spans.get("done", back)
        with self._lock:
            c = self._counts
            c.prepared += 1
            c.prepare_upload_s += body - headers
            c.prepare_parse_s += entered - body
            c.prepare_wait_s += started - entered
            c.prepare_media_s += marks.media_s
            c.prepare_tokenize_s += marks.tokenize_s
            c.prepare_work_s += done - started
            c.prepare_back_s += back - done

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return rounded(self._counts)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def prepared(http: Request, media: MediaPreparation | None, body: ChatCompletionRequest,
                   prepare: Callable[..., T], *args: Any) -> T:
    """`prepare(*args)` for a chat: a media chat's on the media pool (where the model has one),
    another's on the request path's threads (wire/offload.py)."""
    if media is not None and carries_media(body):
        return await media.run(http, prepare, *args)
    return await offload(prepare, *args)
