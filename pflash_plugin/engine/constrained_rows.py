"""A step's constrained rows between llguidance's masks and the samplers: masked (or forced) before
sampling, their tokens settled against their masks and committed to their matchers after.

Why apart from engine/sampling.py: sampling gives each row a token by its path; a constrained row
also has a matcher that can break, a mask that may force its token, and a token that must pass
the mask before its matcher takes it, the same on every path (engine/constraints.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..llama import SamplerChain
from .constraints import Constraints
from .logprobs import with_logprobs
from .request import Request, RequestRefused, SamplingParams, TokenOutput


class Constrained(Protocol):
    """What sampling binds to a constrained row's slot, as these steps read it."""

    request: Request
    params: SamplingParams  # the request's, with its seed drawn
    path: str  # sampling's path: only the batch path takes a forced token unsampled
    chain: SamplerChain  # its penalties' window
    rng: np.random.Generator  # the batch path's draws
    penalizes: bool


def constrain(constraints: Constraints, logits: np.ndarray, rows: Sequence[tuple[int, Constrained]],
              raw: dict[int, np.ndarray], n_threads: int) -> dict[int, TokenOutput | Exception]:
    """The constrained rows' (logits row, bound slot) masks applied in place; a row whose matcher
    can go no further gets its request's error instead, and a batch-path row whose mask allows one
    token alone (a JSON key, a bracket) that token, with neither mask nor sampler (a 128K row's
    store and scan each): the token either would give, its generator drawn from as the sampler
    would. `raw`: the rows before the masks, for log-probabilities."""
    forced = {}
    for k, bound in rows:
        token = constraints.masks.forced(bound.request.held_slot) if bound.path == "batch" else None
        if token is not None:
            forced[k] = token
    broken = constraints.apply(logits, [(b.request.held_slot, k) for k, b in rows], n_threads,
                               frozenset(b.request.held_slot for k, b in rows if k in forced))
    outputs: dict[int, TokenOutput | Exception] = {
        b.request.request_id: RequestRefused(f"the grammar cannot go on: {broken[b.request.held_slot]}")
        for _, b in rows if b.request.held_slot in broken}
    for k, bound in rows:
        if k in forced and bound.request.request_id not in outputs:
            outputs[bound.request.request_id] = _forced_token(bound, forced[k], raw.get(k))
    return outputs


def _forced_token(bound: Constrained, token: int, raw: np.ndarray | None) -> TokenOutput:
    """What the batch path gives a row whose mask allows `token` alone: its generator's draw spent
    (so the row's later draws are the same), its penalties' window extended."""
    if bound.params.temperature > 0:
        bound.rng.random()
    if bound.penalizes:
        bound.chain.accept(token)
    return with_logprobs(token, raw, bound.params.logprobs)


def commit(constraints: Constraints, logits: np.ndarray, rows: Sequence[tuple[int, Constrained]],
           raw: dict[int, np.ndarray], outputs: dict[int, TokenOutput | Exception],
           eog: Callable[[], list[int]]) -> None:
    """Each constrained row's token in `outputs` into its matcher, the token its mask allows in
    place of one it forbids (Constraints.settle); nothing allowed ends the generation (`eog`'s
    first token), a matcher's refusal is its request's error."""
    for k, bound in rows:
        slot, request_id = bound.request.held_slot, bound.request.request_id
        output = outputs.get(request_id)
        if slot not in constraints or not isinstance(output, TokenOutput):
            continue
        token = constraints.settle(slot, output.token, logits[k])
        if token is None:  # the grammar allows nothing more: the generation ends here
            outputs[request_id] = with_logprobs(eog()[0], raw.get(k), bound.params.logprobs)
            continue
        if token != output.token:
            output = outputs[request_id] = with_logprobs(token, raw.get(k), bound.params.logprobs)
        why = constraints.commit(slot, output.token)
        if why is not None:
            outputs[request_id] = RequestRefused(f"the grammar cannot go on: {why}")
