"""Executes the scheduler's steps on one llama.cpp context (the only engine part with a model)."""
from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from ..llama import Batch, Context, GrammarExhausted, GrammarTooSlow, Model, SamplerChain
from .batch_sampling import penalize_rows, sample_row
from .request import Request, RequestRefused, TokenOutput
from .scheduler import Step
from .threads import DecodeThreads


class LlamaRunner:
    """KV operations and batched decode + sampling for the slots of one context."""

    def __init__(self, model: Model, ctx: Context, seed: int | None = None, penalty_last_n: int = 64) -> None:
        """`seed`: requests without their own seed draw one from an RNG seeded with it, so a server
        started with a seed repeats its answers (llama_cpp.server's --seed); None: random seeds."""
        self.model, self.ctx = model, ctx
        self._seeds = random.Random(seed) if seed is not None else None
        self._rng = np.random.default_rng()  # the draws of unseeded requests sampled in batch
        self.penalty_last_n = penalty_last_n
        self.batch = Batch(ctx.n_batch, 1)
        self.decode_threads = DecodeThreads(ctx.n_threads, ctx.n_threads_batch)
        self._samplers: dict[int, SamplerChain] = {}
        self._logprobs: dict[int, int | None] = {}
        self._eog_tokens: list[int] | None = None  # found on first use

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

    def start_request(self, slot: int, request: Request) -> None:
        p = request.params
        seed = p.seed if p.seed is not None or self._seeds is None else self._seeds.getrandbits(32)
        self._samplers[slot] = SamplerChain(self.model, replace(p, seed=seed, penalty_last_n=self.penalty_last_n))
        self._logprobs[slot] = p.logprobs

    def end_request(self, slot: int) -> None:
        sampler = self._samplers.pop(slot, None)
        if sampler is not None:
            sampler.close()
        self._logprobs.pop(slot, None)

    def set_abort(self, should_abort: Callable[[], bool]) -> None:
        self.ctx.set_abort(should_abort)

    def close(self) -> None:
        """Free the samplers, the batch and the context (the model belongs to whoever loaded it)."""
        for slot in list(self._samplers):
            self.end_request(slot)
        self.batch.close()
        self.ctx.close()

    # ---- stepping --------------------------------------------------------------------------
    def execute(self, step: Step) -> dict[int, TokenOutput | Exception]:
        """One llama_decode for the whole step, then one sample per slot that asked for logits.

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
        start = time.perf_counter()
        self.ctx.decode(batch)
        outputs: dict[int, TokenOutput | Exception] = {}
        if rows:
            logits = self.ctx.output_logits(len(rows))  # a view, written in place: the rows' own buffer
            self._suppress_eog(logits, rows)
            outputs = self._batch_rows(logits, rows)
        for request, row in rows:
            if request.request_id in outputs:
                continue
            try:
                outputs[request.request_id] = self._sample(request, row)
            except Exception as error:
                outputs[request.request_id] = error
        if threads:  # sampling reads the logits, so on a GPU too this waited for the decode
            self.decode_threads.record(threads, len(step.items), time.perf_counter() - start)
        return outputs

    def _batch_rows(self, logits: np.ndarray, rows: list[tuple[Request, int]]) -> dict[int, TokenOutput | Exception]:
        """The tokens of the rows whose chain allows it (`SamplerChain.batch`), taken from
        llama.cpp's logits buffer together (engine/batch_sampling.py): every row's penalties in one
        pass, then one argmax over the greedy rows and the chain's truncation and draw on each
        sampled row's top-k. Log-probabilities come from the row as the chain's path takes them
        (after min_tokens, before penalties). A row whose maximum is not a number is left
        to its sampler, as before (which penalizes it again: such a row means nothing either way).
        The chains accept the tokens, so their penalty windows stay whole."""
        picked = [(k, request, self._samplers[request.held_slot]) for k, (request, _) in enumerate(rows)
                  if self._samplers[request.held_slot].batch is not None]
        if not picked:
            return {}
        before_penalties = {k: logits[k].copy() for k, request, _ in picked
                            if self._logprobs.get(request.held_slot) is not None}
        penalize_rows(logits, [(k, chain.params, request.output_tokens) for k, request, chain in picked])
        argmax = logits.argmax(axis=1) if any(chain.batch == "argmax" for _, _, chain in picked) else None
        outputs: dict[int, TokenOutput | Exception] = {}
        for k, request, chain in picked:
            token: int | None
            if argmax is not None and chain.batch == "argmax":
                token = int(argmax[k]) if not np.isnan(logits[k, argmax[k]]) else None
            else:
                token = sample_row(logits[k], chain.params, self._rng)
            if token is not None:
                chain.accept(token)
                outputs[request.request_id] = _with_logprobs(token, before_penalties.get(k),
                                                             self._logprobs.get(request.held_slot))
        return outputs

    def _sample(self, request: Request, row: int) -> TokenOutput:
        top_n = self._logprobs.get(request.held_slot)
        logits = self.ctx.logits(row) if top_n is not None else None
        try:
            token = self._samplers[request.held_slot].sample(self.ctx, row)
        except GrammarExhausted:  # the grammar allows nothing more: the generation ends here
            token = self._eog()[0]
        except GrammarTooSlow as error:  # the next token would take longer still: the client's grammar
            raise RequestRefused(str(error)) from error
        return _with_logprobs(token, logits, top_n)

    def _suppress_eog(self, logits: np.ndarray, rows: list[tuple[Request, int]]) -> None:
        """min_tokens: end-of-generation tokens get -inf in the rows of requests short of it, before
        any sampler sees them (where a grammar allows nothing else, the sampler still ends the
        generation)."""
        for k, (request, _) in enumerate(rows):
            if len(request.output_tokens) < request.params.min_tokens:
                logits[k, self._eog()] = -np.inf

    def _eog(self) -> list[int]:
        if self._eog_tokens is None:
            self._eog_tokens = [t for t in range(self.model.n_vocab) if self.model.is_eog(t)]
        return self._eog_tokens


def _with_logprobs(token: int, logits: np.ndarray | None, top_n: int | None) -> TokenOutput:
    """The token's log-probability and the top_n best, from float32 logits: one pass for the
    normalizer (summed in float64) and one partial sort, never a float64 copy of the row
    (10.4 ms a row for 262K tokens that way, against 2.5 ms)."""
    if logits is None or top_n is None:
        return TokenOutput(token)
    peak = float(logits.max())
    with np.errstate(invalid="ignore"):  # a row of -inf or NaN gives NaN, as the float64 path did
        log_total = peak + math.log(float(np.exp(logits - np.float32(peak)).sum(dtype=np.float64)))
    top: list[tuple[int, float]] = []
    if top_n > 0:
        best = np.argpartition(logits, -top_n)[-top_n:]
        best = best[np.argsort(-logits[best], kind="stable")]
        top = [(int(t), float(logits[t]) - log_total) for t in best]
    return TokenOutput(token, float(logits[token]) - log_total, top)
