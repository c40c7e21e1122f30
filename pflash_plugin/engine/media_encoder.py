"""The engine's media side (issue 46): the projector, worker threads that encode media chunks
(a ViT over a big image takes seconds on a CPU: the engine thread keeps stepping meanwhile), and
an LRU cache of encoded embeddings bounded in bytes, keyed by a hash of the media's bytes (a
resent image is not encoded again, even when its KV was evicted).

Each worker has a projector of its own (one libmtmd context runs one encode at a time): on a GPU a
ViT encode of one image leaves the device mostly idle, so several images from several requests
encode at once (`EngineConfig.media_encoders`). The first projector also tokenizes.

`engine.media` is one of these where the model was loaded with a projector (EngineConfig.mmproj),
else None. A failed encode fails only its request (the scheduler reads the span's future)."""
from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..llama.media import DecodeCounts, Projector
from ..llama.ubatches import UbatchCounts
from .media import MediaInput
from .limits import AdmissionError
from .media_prompt import MediaPrompt, MediaSpan, build_prompt
from .request import ErrorKind, Request


@dataclass(frozen=True)
class MediaStats:
    """For /status and /metrics; the seconds are sums since start, for a bench's per-phase split."""

    encoded: int  # chunks encoded by the projector
    cache_hits: int  # chunks whose embeddings came from the cache (or an encode already under way)
    cache_bytes: int
    cache_capacity_bytes: int
    media_tokens: int  # media tokens (KV cells) of the requests submitted
    encoders: int = 1  # projectors encoding at once
    encode_s: float = 0.0  # inside libmtmd's encodes (on the workers)
    encode_wait_s: float = 0.0  # from a request's submission to its encode's start (queued behind others)
    tokenized: int = 0  # items libmtmd decoded and resized (the server's threads, before submission)
    tokenize_s: float = 0.0
    decode_calls: int = 0  # llama_decode calls of embedding rows (the engine thread, before a step's tokens)
    decode_rows: int = 0
    decode_pieces: int = 0  # step rows of media (a piece of one request's chunk each)
    decode_s: float = 0.0
    decode_ubatches: int = 0  # the ubatches llama.cpp cut those calls into (llama/ubatches.py)
    decode_graphs_reused: int = 0  # of them, computed on the ubatch before's graph
    step_calls: int = 0  # the steps' token batches (llama_decode calls of token rows)
    step_ubatches: int = 0
    step_graphs_reused: int = 0


class MediaEncoder:
    def __init__(self, projectors: Projector | Sequence[Projector], cache_bytes: int = 256 << 20) -> None:
        """`projectors`: one per worker (the same mmproj file), the first also tokenizes."""
        self.projectors = [projectors] if isinstance(projectors, Projector) else list(projectors)
        self.projector, self.capacity = self.projectors[0], cache_bytes
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._pending: dict[str, Future[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._bytes = self._encoded = self._hits = self._media_tokens = 0
        self._encode_s = self._wait_s = 0.0
        self._free: queue.SimpleQueue[Projector] = queue.SimpleQueue()  # the projectors no worker holds
        for projector in self.projectors:
            self._free.put(projector)
        self._worker = ThreadPoolExecutor(len(self.projectors), thread_name_prefix="pflash-media")
        self.decode_counts: DecodeCounts | None = None  # the runner's media decodes (set by build_engine)
        self.ubatches: UbatchCounts | None = None  # the runner's decodes' ubatches and reused graphs (the same)
        self.on_done: Callable[[], None] = lambda: None  # the engine wakes its thread here

    def prompt(self, text: str, media: Sequence[MediaInput]) -> MediaPrompt:
        """The engine's tokens and spans for `text` with a MEDIA_MARKER per item (media_prompt.py);
        any thread (the server's tokenizer pool). MediaError: the client's media."""
        return build_prompt(self.projector, text, media)

    def want(self, spans: Sequence[MediaSpan]) -> None:
        """Start (or find) each span's embeddings: a cache hit is a done future; an encode under
        way for the same bytes is shared; anything else is queued on the worker."""
        for span in spans:
            if span.embeddings is None:
                span.embeddings = self._future(span)

    def _future(self, span: MediaSpan) -> Future[np.ndarray]:
        key = span.chunk.key
        with self._lock:
            self._media_tokens += span.chunk.n_tokens
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                done: Future[np.ndarray] = Future()
                done.set_result(cached)
                return done
            pending = self._pending.get(key)
            if pending is not None:
                self._hits += 1
                return pending
            future = self._worker.submit(self._encode, span, time.perf_counter())
            self._pending[key] = future
        return future

    def _encode(self, span: MediaSpan, wanted: float) -> np.ndarray:
        key = span.chunk.key
        projector = self._free.get()  # one is free: there are as many as workers
        start = time.perf_counter()
        try:
            rows = projector.encode(span.chunk)
            with self._lock:
                self._encoded += 1
                self._store(key, rows)
            return rows
        finally:
            self._free.put(projector)
            with self._lock:
                self._pending.pop(key, None)
                self._encode_s += time.perf_counter() - start
                self._wait_s += start - wanted
            self.on_done()

    def _store(self, key: str, rows: np.ndarray) -> None:
        """Keep `rows` (under the lock), evicting the least recently used beyond the capacity."""
        if rows.nbytes > self.capacity:
            return
        self._cache[key] = rows
        self._bytes += rows.nbytes
        while self._bytes > self.capacity:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.nbytes

    def stats(self) -> MediaStats:
        decoded, ub = self.decode_counts or DecodeCounts(), self.ubatches or UbatchCounts()
        with self._lock:
            return MediaStats(self._encoded, self._hits, self._bytes, self.capacity, self._media_tokens,
                              len(self.projectors), round(self._encode_s, 6), round(self._wait_s, 6),
                              self.projector.tokenized_items, round(self.projector.tokenize_s, 6),
                              decoded.calls, decoded.rows, decoded.pieces, round(decoded.seconds, 6),
                              ub.media.ubatches, ub.media.reused, ub.step.calls, ub.step.ubatches, ub.step.reused)

    def close(self) -> None:
        """End the workers (encodes under way finish first), then free the projectors."""
        self._worker.shutdown(wait=True, cancel_futures=True)
        for projector in self.projectors:
            projector.close()


def want_media(encoder: MediaEncoder | None, requests: Sequence[Request], name: str) -> None:
    """Start encoding the requests' media (on the encoder's worker) as they are submitted, so the
    engine thread finds them encoded; AdmissionError where the model `name` has no projector."""
    spans = [span for request in requests for span in request.media]
    if not spans:
        return
    if encoder is None:
        raise AdmissionError(ErrorKind.INVALID, f"the model {name} takes no media: it was loaded without "
                             "a projector (--mmproj)")
    encoder.want(spans)
