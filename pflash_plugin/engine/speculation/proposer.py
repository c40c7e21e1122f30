"""The seam between the engine's verification and whatever drafts tokens (issue 47).

A proposer sees, for each row that may speculate, every token its slot holds (the prompt as
prefilled and what was generated so far) and returns at most ``k`` draft tokens for it. The engine
verifies them in its next decode step and keeps what the target agrees with. Proposers keep their
own per-request state (an n-gram index, a draft model's KV) keyed by the request's id and free it
in ``forget`` when the request leaves.

Acceptance (``acceptance.accept``) is the other half:
``accept(target, drafts, params, generated, rng, draft_probs=None) -> (n_accepted, next_token)``
where ``target`` is the [k+1, n_vocab] float32 logits of the row's verified positions after logit
bias.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftRow:
    """One row's request for drafts."""

    key: int  # the request's id (stable while it runs)
    tokens: Sequence[int]  # everything the slot holds for it: prompt (as prefilled) + generated
    k: int  # at most this many draft tokens wanted


class Proposer(Protocol):
    """Drafts tokens for rows; the engine verifies them."""

    @property
    def reads_media(self) -> bool:
        """Whether it may be given rows whose tokens hold media pseudo-tokens (negative ids,
        engine/media_prompt.py): a lookup skips them, a draft model cannot decode them."""
        ...

    @property
    def cheap(self) -> bool:
        """Whether a draft costs next to nothing (a lookup, not a draft model's decodes): then steps
        that do not draft still ask it for a token a row, to measure acceptance for free (drafting.py)."""
        ...

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        """One draft (at most ``row.k`` tokens, maybe empty) per row, in order."""
        ...

    def forget(self, key: int) -> None:
        """The request left: free what was kept for it."""
        ...

    def close(self) -> None:
        """The engine closes: free what the proposer holds (a draft model's context and weights)."""
        ...

    def draft_cost(self) -> float:
        """Seconds a draft token costs the proposer, as measured (0: next to nothing, as a lookup):
        the policy adds it to a draft token's price."""
        ...
