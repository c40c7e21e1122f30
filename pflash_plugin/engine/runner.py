"""Executes the scheduler's steps on one llama.cpp context (the only engine part with a model)."""
from __future__ import annotations

import time
from typing import Callable

from ..llama import Batch, Context, Model
from ..llama.media import MediaDecoder, MediaPiece
from ..llama.ubatches import UbatchCounts
from .request import Request, TokenOutput
from .sampling import Sampling
from .scheduler import Step
from .threads import DecodeThreads


class LlamaRunner:
    """KV operations and batched decode + sampling for the slots of one context."""

    def __init__(self, model: Model, ctx: Context, seed: int | None = None, penalty_last_n: int = 64,
                 backend_sampling: str = "none", overlaps: bool | None = None) -> None:
        """`seed`, `penalty_last_n`: the server's; `backend_sampling`: which rows the backend samples
        inside the decode ("none", "sampled" or "all": engine/sampling.py). `overlaps`: whether
        `launch` returns while the device computes, so the engine's host work between `launch` and
        `collect` runs beside it (None: where the output layer runs on a GPU; on the CPU the decode
        runs inside `launch`, so work put there would only delay the step's tokens)."""
        self.model, self.ctx = model, ctx
        self.sampling = Sampling(model, ctx, seed=seed, penalty_last_n=penalty_last_n, device=backend_sampling)
        self.batch = Batch(ctx.n_batch, 1)
        self.ubatches = UbatchCounts()  # the decode calls' ubatches and reused graphs (/status media)
        self.media = MediaDecoder(ctx, self.ubatches)  # media pieces' embeddings (issue 46)
        self.decode_threads = DecodeThreads(ctx.n_threads, ctx.n_threads_batch)
        self.overlaps = model.output_on_gpu if overlaps is None else overlaps
        self._rows: list[tuple[Request, int]] = []  # the launched step's rows that want logits
        self._drafts: dict[int, list[int]] = {}  # its speculating rows' drafts, by request id
        self._timing: tuple[int, float] | None = None  # a decode step's threads and its seconds so far

    # ---- KVOps -----------------------------------------------------------------------------
    def seq_rm(self, slot: int, start: int) -> None:
        self.ctx.memory.seq_rm(slot, start, -1)

    def seq_cp(self, src: int, dst: int, n_tokens: int) -> None:
        """`dst` (empty) gets the first `n_tokens` of `src`: cells shared in place in a unified KV;
        across streams llama.cpp copies only whole streams, so the copy's tail is removed."""
        if self.ctx.config.kv_unified:
            self.ctx.memory.seq_cp(src, dst, 0, n_tokens)
        else:
            self.ctx.memory.seq_cp(src, dst, -1, -1)
            self.ctx.memory.seq_rm(dst, n_tokens, -1)

    def save(self, slot: int, max_bytes: int) -> bytes | None:
        return self.ctx.memory.state_seq_get(slot, max_bytes)

    def restore(self, slot: int, data: bytes, n_tokens: int) -> None:
        """`slot` (emptied by the caller) gets the first `n_tokens` of a saved sequence."""
        self.ctx.memory.state_seq_set(slot, data)
        self.ctx.memory.seq_rm(slot, n_tokens, -1)

    # ---- a slot's request (its sampler) ------------------------------------------------------
    def start_request(self, slot: int, request: Request) -> None:
        """Bind the request's sampler to its slot (ValueError: a grammar that does not parse)."""
        self.sampling.bind(slot, request)

    def end_request(self, slot: int) -> None:
        """Free the sampler of the request that left the slot."""
        self.sampling.unbind(slot)

    def set_abort(self, should_abort: Callable[[], bool]) -> None:
        self.ctx.set_abort(should_abort)

    def first_cell(self, slot: int) -> int:
        return self.ctx.memory.seq_pos_min(slot)

    def kv_tokens(self, slot: int) -> int:
        """The KV positions `slot` holds (after an aborted decode: those its computed ubatches wrote)."""
        return self.ctx.memory.seq_pos_max(slot) + 1

    def close(self) -> None:
        """Free the samplers, the batch and the context (the model belongs to whoever loaded it)."""
        self.sampling.close()
        self.batch.close()
        self.media.close()
        self.ctx.close()

    # ---- stepping --------------------------------------------------------------------------
    def returns_early(self, step: Step) -> bool:
        """Whether this step's launch returns while the device computes: on a GPU, a step of one
        ubatch. ggml's scheduler waits for each ubatch's compute before it copies the next one's
        inputs, so a longer step's launch (a prefill chunk beside the decode rows) returns only
        as its last ubatch computes, and host work put after it would wait out the step."""
        return self.overlaps and step.n_tokens <= self.ctx.n_ubatch

    def arm_abort(self, armed: bool) -> None:
        """Whether llama.cpp polls the abort callback in the next launch: only in a step that may be
        cut short for a newcomer (Steps.preemptible). Each poll takes the GIL inside llama_decode,
        ~800 a CPU step of the demo model, each waiting its turn while other threads run Python."""
        self.ctx.arm_abort(armed)

    def launch(self, step: Step) -> None:
        """One llama_decode for the whole step (on a GPU it returns while the device computes).
        Raises DecodeError; the engine decides whom it fails."""
        batch = self.batch
        batch.clear()
        self._rows = []
        self._drafts = {}
        self._decode_media(step)
        for item in step.items:
            if item.media is not None:  # decoded above
                continue
            row = batch.add_sequence(item.tokens, item.start_pos, item.request.held_slot, item.wants_logits,
                                     item.drafts + 1)
            if item.wants_logits:
                self._rows.extend((item.request, at) for at in range(row - item.drafts, row + 1))
            if item.drafts:
                self._drafts[item.request.request_id] = item.tokens[-item.drafts:]
        # decode rows only (a speculating row's drafts too): the thread count measured fastest for its tokens
        decoding = all(len(item.tokens) == 1 + item.drafts for item in step.items)
        threads = self.decode_threads.threads(step.n_tokens) if decoding else None
        self.ctx.use_threads(threads or self.ctx.n_threads, threads or self.ctx.n_threads_batch)
        self.sampling.before_decode(self._rows)
        start = time.perf_counter()
        try:
            if batch.n_tokens:  # a step of media pieces alone has no token batch
                self._decode_counted(step)
        except BaseException:
            self.sampling.landed()
            raise
        self._timing = (threads, time.perf_counter() - start) if threads else None
        if self.returns_early(step):  # the constrained rows' masks while the device decodes
            self.sampling.beside_decode(self._rows)

    def _decode_counted(self, step: Step) -> None:
        """The token batch's llama_decode, its ubatches and the graphs llama.cpp reused counted."""
        runs = [(item.request.held_slot, len(item.tokens)) for item in step.items if item.media is None]
        self.ubatches.step.decode(self.ctx, self.batch, runs)

    def _decode_media(self, step: Step) -> None:
        """The step's media pieces, before its token batch, by decode calls of their own (llama.cpp
        takes no token rows beside embedding rows): the slots' causal pieces share calls."""
        pieces = [MediaPiece(item.media.rows, item.media.positions, item.request.held_slot, item.media.non_causal)
                  for item in step.items if item.media is not None]
        if pieces:
            self.ctx.use_threads(self.ctx.n_threads, self.ctx.n_threads_batch)
            self.media.decode(pieces)

    def collect(self, step: Step) -> dict[int, TokenOutput | Exception]:
        """One token for each row of the launched step that asked for logits and whose request is
        still running (after the drafts the target accepted, for a speculating row). A sampling
        error belongs to its request alone: it is returned in that request's place. A token or
        error returned means the decode's outputs were read, which waits for the whole decode
        (llama_get_logits, llama_get_sampled_token_ith synchronize): only a step that returns none
        waits here."""
        start = time.perf_counter()
        try:
            outputs = self.sampling.sample(self._rows, self._drafts) if self._rows else {}
            if not outputs:  # no row read the outputs: the next launch and KV operations need the decode landed
                self.ctx.synchronize()
        finally:
            self.sampling.landed()
        if self._timing and not self.overlaps:  # overlapped, the wait says nothing of the decode's time
            threads, launched = self._timing
            self.decode_threads.record(threads, step.n_tokens, launched + time.perf_counter() - start)
        return outputs
