"""llama.cpp's own path for a prompt with media, and how the batched engine's outputs compare with
it (issue 46's parity target). One copy for the tests (tests/test_media_engine.py) and the GPU
bench (bench/gpu/media_parity.py): libmtmd's mtmd_helper_eval_chunks decodes the prompt into a
plain one-sequence context, then greedy tokens one at a time, each step's log-softmax kept."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pflash_plugin.engine.request import TokenOutput
from pflash_plugin.llama import Batch, Context, ContextConfig, Model
from pflash_plugin.llama.media import Projector, helper_eval


@dataclass(frozen=True)
class Reference:
    """Greedy tokens by llama.cpp's own path, and the log-softmax over the vocabulary before each."""

    tokens: list[int]
    logprobs: list[np.ndarray]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - float(logits.max())
    return shifted - float(np.log(np.exp(shifted).sum()))


def mtmd_reference(model: Model, projector: str | os.PathLike[str], text: str, media: Sequence[tuple[str, bytes]],
                   n_tokens: int, n_batch: int, n_ctx: int = 1024, n_threads: int = 1) -> Reference:
    """`n_tokens` greedy tokens after `text` (one marker per item of `media`, as (kind, bytes)) by
    mtmd_helper_eval_chunks on a fresh context of `model` and a fresh libmtmd context of
    `projector` (on the GPU where the model has layers, as the engine loads it)."""
    ctx = Context(model, ContextConfig(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads,
                                       n_threads_batch=n_threads))
    mtmd = Projector(projector, model, n_threads=n_threads)
    batch = Batch(1)
    try:
        pos = helper_eval(mtmd, ctx, text, media, n_batch=n_batch)
        tokens: list[int] = []
        logprobs: list[np.ndarray] = []
        for _ in range(n_tokens):
            logits = ctx.logits(-1)
            logprobs.append(log_softmax(logits))
            tokens.append(int(np.argmax(logits)))
            batch.clear()
            batch.add(tokens[-1], pos, 0, True)
            ctx.decode(batch)
            pos += 1
        return Reference(tokens, logprobs)
    finally:
        batch.close()
        mtmd.close()
        ctx.close()


@dataclass(frozen=True)
class Parity:
    """The engine's greedy outputs against a Reference. `max_abs`: the largest |logprob difference|
    over the engine's top-k alternatives of every step up to the first divergence (`max_abs_first`:
    the first token's). A divergence is a `near_tie` where the reference's two candidates lie within
    twice the tolerance of each other: each side may move by the tolerance, so either is right."""

    tokens_equal: bool
    diverged_at: int | None
    near_tie: bool
    max_abs_first: float
    max_abs: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance and (self.tokens_equal or self.near_tie)


def compare(reference: Reference, outputs: Sequence[TokenOutput], tolerance: float) -> Parity:
    """`outputs`: the engine's TokenOutputs (with top_logprobs) in order, as many as the reference's."""
    if len(outputs) != len(reference.tokens) or any(not out.top_logprobs for out in outputs):
        raise ValueError(f"{len(outputs)} outputs with top logprobs needed, one per reference token "
                         f"({len(reference.tokens)})")
    diverged = next((i for i, (out, ref) in enumerate(zip(outputs, reference.tokens)) if out.token != ref), None)
    steps = len(outputs) if diverged is None else diverged + 1
    diffs = [max(abs(logprob - reference.logprobs[i][token]) for token, logprob in outputs[i].top_logprobs or ())
             for i in range(steps)]
    near_tie = False
    if diverged is not None:
        row = reference.logprobs[diverged]
        near_tie = bool(row[reference.tokens[diverged]] - row[outputs[diverged].token] <= 2 * tolerance)
    return Parity(diverged is None, diverged, near_tie, float(diffs[0]), float(max(diffs)), tolerance)
