"""Embeddings on a context of their own (a model served with `embedding: true`).

Embedding requests run one at a time on a thread of their own, never on the server's worker pool
that completions need too (60 waiting embedding requests once filled it and starved every
completion). At most `max_queue` wait beyond the one running; more are refused as BUSY. A request
whose client has gone is dropped between inputs (its `cancelled` event). At a shutdown new requests
are refused at once as UNAVAILABLE, and so is what still waits once the grace has passed; `close` frees the
context only once its thread is done with it: nothing calls into a freed context (a SIGTERM with
embeddings queued once crashed the process that way).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..llama import Batch, Context, ContextConfig, Model
from .request import ErrorKind
from .scheduler import SHUTTING_DOWN, AdmissionError


class EmbeddingCancelled(Exception):
    """The client went away: its remaining inputs were not embedded."""


class Embedder:
    def __init__(self, model: Model, n_ctx: int, n_batch: int, n_threads: int = 0, max_queue: int = 64) -> None:
        self.model = model
        self.n_ctx = min(n_ctx, n_batch)
        self.max_queue = max_queue
        self.ctx = Context(
            model,
            ContextConfig(n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads, embeddings=True),
        )
        self.batch = Batch(self.n_ctx, 1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="embedder")
        self._lock = threading.Lock()  # guards the counts and the closed flag
        self._in_flight = 0  # running or waiting
        self._admitting = True
        self._deadline = float("inf")  # time.monotonic(): waiting inputs are refused from then on

    def check(self, tokens: list[int]) -> None:
        """ValueError for an input that cannot be embedded (refused before anything waits)."""
        if not tokens:
            raise ValueError("cannot embed an empty input")
        if len(tokens) > self.n_ctx:
            raise ValueError(f"input of {len(tokens)} tokens exceeds the embedding context ({self.n_ctx})")

    def submit(self, inputs: list[list[int]], cancelled: threading.Event | None = None) -> Future[list[list[float]]]:
        """Queue one request's inputs: its future gives their vectors, or raises AdmissionError
        UNAVAILABLE (closed meanwhile) or EmbeddingCancelled. AdmissionError BUSY when max_queue
        already wait, UNAVAILABLE once closed."""
        for tokens in inputs:
            self.check(tokens)
        with self._lock:
            if not self._admitting:
                raise AdmissionError.unavailable(SHUTTING_DOWN)
            if self._in_flight > self.max_queue:
                raise AdmissionError(
                    ErrorKind.BUSY, f"no room for another embedding request: {self._in_flight} are running or "
                                    f"queued (1 + max_queue {self.max_queue}); retry later")
            self._in_flight += 1
            future = self._thread.submit(self._run, inputs, cancelled or threading.Event())
        future.add_done_callback(self._done)
        return future

    def embed(self, tokens: list[int]) -> list[float]:
        """One input's vector, waiting for it (for callers outside the server)."""
        return self.submit([tokens]).result()[0]

    def _done(self, _: Future) -> None:
        with self._lock:
            self._in_flight -= 1

    def _run(self, inputs: list[list[int]], cancelled: threading.Event) -> list[list[float]]:
        vectors = []
        for tokens in inputs:
            if time.monotonic() >= self._deadline:
                raise AdmissionError.unavailable(SHUTTING_DOWN)
            if cancelled.is_set():
                raise EmbeddingCancelled()
            vectors.append(self._embed(tokens))
        return vectors

    def _embed(self, tokens: list[int]) -> list[float]:
        """Mean-pooled (or the model's own pooling) embedding, L2-normalised; on the embedder's thread."""
        self.ctx.memory.clear()
        self.batch.clear()
        for pos, token in enumerate(tokens):
            self.batch.add(token, pos, 0, True)
        self.ctx.decode(self.batch)
        vector = self.ctx.embeddings_seq(0, self.model.n_embd)
        if vector is None:
            vector = np.mean([self.ctx.embeddings_ith(i, self.model.n_embd) for i in range(len(tokens))], axis=0)
        norm = float(np.linalg.norm(vector))
        return (vector / norm if norm > 0 else vector).tolist()

    def shutdown(self, grace_s: float) -> None:
        """Refuse new requests; what waits runs for `grace_s` more, then is refused. Returns once
        the thread is idle."""
        with self._lock:
            self._admitting = False
            self._deadline = min(self._deadline, time.monotonic() + grace_s)
        self._thread.shutdown(wait=True)

    def close(self) -> None:
        """Refuse new and waiting requests, let the running input finish, then free the batch and
        the context (before the model)."""
        self.shutdown(0.0)
        self.batch.close()
        self.ctx.close()
