"""Executes the scheduler's steps on one llama.cpp context (the only engine part with a model)."""
from __future__ import annotations

import time
from typing import Callable

from ..llama import Batch, Context, Model
from .request import Request, TokenOutput
from .sampling import Sampling
from .scheduler import Step
from .threads import DecodeThreads


class LlamaRunner:
    """KV operations and batched decode + sampling for the slots of one context."""

    def __init__(self, model: Model, ctx: Context, seed: int | None = None, penalty_last_n: int = 64,
                 backend_sampling: str = "none") -> None:
        """`seed`, `penalty_last_n`: the server's; `backend_sampling`: which rows the backend samples
        inside the decode ("none", "sampled" or "all": engine/sampling.py)."""
        self.model, self.ctx = model, ctx
        self.sampling = Sampling(model, ctx, seed=seed, penalty_last_n=penalty_last_n, device=backend_sampling)
        self.batch = Batch(ctx.n_batch, 1)
        self.decode_threads = DecodeThreads(ctx.n_threads, ctx.n_threads_batch)

    # ---- KVOps -----------------------------------------------------------------------------
    def seq_rm(self, slot: int, start: int) -> None:
        self.ctx.seq_rm(slot, start, -1)

    def seq_cp(self, src: int, dst: int, n_tokens: int) -> None:
        """`dst` (empty) gets the first `n_tokens` of `src`: cells shared in place in a unified KV;
        across streams llama.cpp copies only whole streams, so the copy's tail is removed."""
        if self.ctx.config.kv_unified:
            self.ctx.seq_cp(src, dst, 0, n_tokens)
        else:
            self.ctx.seq_cp(src, dst, -1, -1)
            self.ctx.seq_rm(dst, n_tokens, -1)

    def save(self, slot: int, max_bytes: int) -> bytes | None:
        return self.ctx.state_seq_get(slot, max_bytes)

    def restore(self, slot: int, data: bytes, n_tokens: int) -> None:
        """`slot` (emptied by the caller) gets the first `n_tokens` of a saved sequence."""
        self.ctx.state_seq_set(slot, data)
        self.ctx.seq_rm(slot, n_tokens, -1)

    # ---- a slot's request (its sampler) ------------------------------------------------------
    def start_request(self, slot: int, request: Request) -> None:
        """Bind the request's sampler to its slot (ValueError: a grammar that does not parse)."""
        self.sampling.bind(slot, request)

    def end_request(self, slot: int) -> None:
        """Free the sampler of the request that left the slot."""
        self.sampling.unbind(slot)

    def set_abort(self, should_abort: Callable[[], bool]) -> None:
        self.ctx.set_abort(should_abort)

    def close(self) -> None:
        """Free the samplers, the batch and the context (the model belongs to whoever loaded it)."""
        self.sampling.close()
        self.batch.close()
        self.ctx.close()

    # ---- stepping --------------------------------------------------------------------------
    def execute(self, step: Step) -> dict[int, TokenOutput | Exception]:
        """One llama_decode for the whole step, then one token per slot that asked for logits.

        Raises DecodeError; the engine decides whom it fails. A sampling error belongs to its
        request alone: it is returned in that request's place.
        """
        batch = self.batch
        batch.clear()
        rows: list[tuple[Request, int]] = []
        for item in step.items:
            row = batch.add_sequence(item.tokens, item.start_pos, item.request.held_slot, item.wants_logits)
            if item.wants_logits:
                rows.append((item.request, row))
        decoding = all(len(item.tokens) == 1 for item in step.items)
        threads = self.decode_threads.threads(len(step.items)) if decoding else None
        self.ctx.use_threads(threads or self.ctx.n_threads, threads or self.ctx.n_threads_batch)
        self.sampling.before_decode(rows)
        start = time.perf_counter()
        self.ctx.decode(batch)
        outputs = self.sampling.sample(rows) if rows else {}
        if threads:  # sampling reads the logits, so on a GPU too this waited for the decode
            self.decode_threads.record(threads, len(step.items), time.perf_counter() - start)
        return outputs
