"""A step's rows from the step policy's plan (step_policy.py): the mechanism between the running
requests, their slots' KV and the batch a runner decodes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .live_text import LiveText
from .media_prompt import MediaRows, prefill_piece
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus
from .step_policy import Flags, Seat, StepPolicy, flags


@dataclass
class BatchItem:
    request: Request
    tokens: list[int]
    start_pos: int
    wants_logits: bool
    media: MediaRows | None = None  # a media piece: `tokens` are its pseudo-ids, `media.rows` what is decoded


@dataclass
class Step:
    items: list[BatchItem]

    @property
    def n_tokens(self) -> int:
        return sum(len(item.tokens) for item in self.items)


class Steps:
    """Composes steps by `policy` over the slots of `cache`; `text` counts the steps a prompt is left out of."""

    def __init__(self, policy: StepPolicy, cache: PrefixCache, text: LiveText) -> None:
        self.policy, self.cache, self.text = policy, cache, text

    def compose(self, running: Sequence[Request]) -> Step:
        """The step the policy plans for the running requests: a decode row each, prefill chunks."""
        slots = self.cache.slots
        plan = self.policy.plan(self.seats(running))
        items = [BatchItem(r, [r.output_tokens[-1]], len(slots[r.held_slot].tokens), True) for r in plan.decode]
        for request, n in plan.chunks:
            start, at = request.n_prefilled, len(slots[request.held_slot].tokens)
            piece = prefill_piece(request.media, start, n)  # cut at media edges (media_prompt.py)
            if piece is None:  # its media is still encoding: it sits this step out
                continue
            n, media = piece
            items.append(BatchItem(request, request.prefill_tokens[start : start + n], at, n == request.prefill_left,
                                   media=media))
        for request in plan.left_out:
            self.text.left_out(request)
        # in slot order: llama.cpp puts a run of consecutive sequences in one ubatch when each slot
        # has a KV stream of its own, and any order serves a unified one
        return Step(sorted(items, key=lambda item: item.request.held_slot))

    def seats(self, running: Sequence[Request]) -> list[Seat[Request]]:
        """The running requests as the step policy sees them."""
        return [Seat(r, r.status is RequestStatus.DECODING, r.prefill_left, self.text.starved(r),
                     r.timings.first_token is None) for r in running]

    def flags(self, running: Sequence[Request]) -> Flags:
        """What background work is told now, from the requests the steps serve (step_policy.flags)."""
        return flags(self.seats(running))

    def preemptible(self, step: Step) -> bool:
        """A step worth aborting for a newcomer (StepPolicy.preemptible)."""
        return self.policy.preemptible([len(item.tokens) for item in step.items])

    def rollback(self, step: Step) -> None:
        """A decode was aborted: drop whatever it wrote past each slot's known tokens (earlier
        ubatches of a multi-ubatch step may have landed) so the step can be redone."""
        self.cache.decoded()
        for item in step.items:
            self.cache.trim(self.cache.slots[item.request.held_slot])
