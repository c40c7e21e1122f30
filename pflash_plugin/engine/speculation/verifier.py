"""Verifying a speculating row's drafts against the target's logits of the step (issue 47).

Why apart from engine/sampling.py: sampling gives each row one token by its path; a speculating row
has k+1 rows of logits and keeps a prefix of its drafts (acceptance.accept), a job of its own.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from ...llama import SamplerChain
from ..batch_sampling import penalizes
from ..request import Request, SamplingParams, TokenOutput
from .acceptance import accept


class Verified(Protocol):
    """What sampling binds to a speculating row's slot, as verification reads it."""

    request: Request
    params: SamplingParams  # the request's, with its seed drawn
    chain: SamplerChain  # its host chain: the penalties' window, and the row without a finite maximum
    rng: np.random.Generator  # the batch path's draws


B = TypeVar("B", bound=Verified)


class Verifier(Generic[B]):
    """The speculating rows of a step: each one's drafts kept or not, and the token after them."""

    def __init__(self, eog: Callable[[], list[int]], fallback: Callable[[B, int], TokenOutput]) -> None:
        """`eog`: the end-of-generation tokens (min_tokens holds them back); `fallback`: the token
        of a row (batch index) that has no finite maximum, by the row's chain (as the batch path)."""
        self._eog = eog
        self._fallback = fallback

    def verify(self, logits: np.ndarray, rows: Mapping[int, tuple[B, list[tuple[int, int]]]],
               drafts: Mapping[int, Sequence[int]]) -> dict[int, TokenOutput | Exception]:
        """Each request's (by id) token after the drafts it keeps; `rows`: its bound slot and its
        k+1 rows (output index, batch index). An error belongs to its request alone."""
        outputs: dict[int, TokenOutput | Exception] = {}
        for key, (bound, at) in rows.items():
            try:
                outputs[key] = self._verify(logits, bound, at, drafts[key])
            except Exception as error:
                outputs[key] = error
        return outputs

    def _verify(self, logits: np.ndarray, bound: B, at: list[tuple[int, int]], drafts: Sequence[int]) -> TokenOutput:
        """A speculating row: its k+1 rows with min_tokens and the logit bias applied as the batch
        path applies them, then acceptance.accept (the greedy argmax or rejection sampling, the
        penalties' windows there); its chain accepts the tokens taken, so its penalty window stays whole."""
        p, generated = bound.params, bound.request.output_tokens
        outs = [k for k, _ in at]
        held = [k for j, k in enumerate(outs) if len(generated) + j < p.min_tokens]
        if held:
            logits[np.ix_(held, self._eog())] = -np.inf
        consecutive = outs == list(range(outs[0], outs[0] + len(outs)))  # as the runner lays them out
        # a view where nothing is added (a copy of 11 rows at a 128K vocabulary: ~0.5 ms a row and step)
        target = logits[outs[0]:outs[0] + len(outs)] if consecutive and not p.logit_bias else logits[outs]
        for token, bias in p.logit_bias.items():
            target[:, token] += np.float32(bias)
        n, drawn = accept(target, drafts, p, generated, bound.rng)
        if drawn is None:  # no finite maximum: its chain decides, as on the batch path
            return TokenOutput(self._fallback(bound, at[n][1]).token, accepted=tuple(drafts[:n]))
        if penalizes(p):
            for taken in (*drafts[:n], drawn):
                bound.chain.accept(taken)
        return TokenOutput(drawn, accepted=tuple(drafts[:n]))
