"""Embeddings on a context of their own (a model served with `embedding: true`).

Embedding requests are short and rare next to generation, so they run one at a time under a lock
on the calling thread rather than through the scheduler.
"""
from __future__ import annotations

import threading

import numpy as np

from ..llama import Batch, Context, ContextConfig, Model


class Embedder:
    def __init__(self, model: Model, n_ctx: int, n_batch: int, n_threads: int = 0) -> None:
        self.model = model
        self.n_ctx = min(n_ctx, n_batch)
        self.ctx = Context(
            model,
            ContextConfig(n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads, embeddings=True),
        )
        self.batch = Batch(self.n_ctx, 1)
        self._lock = threading.Lock()

    def embed(self, tokens: list[int]) -> list[float]:
        """Mean-pooled (or the model's own pooling) embedding, L2-normalised."""
        if not tokens:
            raise ValueError("cannot embed an empty input")
        if len(tokens) > self.n_ctx:
            raise ValueError(f"input of {len(tokens)} tokens exceeds the embedding context ({self.n_ctx})")
        with self._lock:
            self.ctx.clear()
            self.batch.clear()
            for pos, token in enumerate(tokens):
                self.batch.add(token, pos, 0, True)
            self.ctx.decode(self.batch)
            vector = self.ctx.embeddings_seq(0, self.model.n_embd)
            if vector is None:
                vector = np.mean([self.ctx.embeddings_ith(i, self.model.n_embd) for i in range(len(tokens))], axis=0)
        norm = float(np.linalg.norm(vector))
        return (vector / norm if norm > 0 else vector).tolist()

    def close(self) -> None:
        """Free the batch and the context (before the model), once no embedding runs."""
        with self._lock:
            self.batch.close()
            self.ctx.close()
