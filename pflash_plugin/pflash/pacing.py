"""How one prompt's draft shares the device with the engine's slots: the rule, in one place, pure,
with a clock that a test injects.

A draft is background work, so it is polite: while requests wait for their first token it steps
aside (waits between chunks, and has llama.cpp abort a chunk in flight, redone afterwards), and
while slots decode it drafts short chunks, each followed by a pause (its duty cycle). Politeness
has a bound: once the prompt has waited `bound_s` since its compression job was made (its
arrival), the draft runs as if alone, full chunks and no pauses, to its end. So a prompt never
waits longer than the bound plus its own draft (and the drafts queued ahead of it) for its
first token, however long its neighbours decode: with a yield bound per chunk instead, an 84K
prompt drafted beside two long answers waited 15-22 s on an H200 (issue 28).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

SHARED_CHUNK = 512  # tokens per drafter chunk while slots decode beside it (short device bursts)
POLITE_S = 2.0  # the default bound: how long after its arrival a prompt's draft may step aside


class Neighbours(Protocol):
    """What the engine tells background work about the requests it serves (engine.seams.Activity)."""

    # requests that hold a slot wait for a first token (queued ones do not count: they wait for a
    # slot, not for the device): pause, abort a chunk
    def interactive_waiting(self) -> bool: ...
    def slots_decoding(self) -> bool: ...  # slots are decoding: short chunks, paced to a duty cycle


class Alone:
    """No neighbours: a drafter run on its own (tests, benchmarks, calibration)."""

    def interactive_waiting(self) -> bool:
        return False

    def slots_decoding(self) -> bool:
        return False


@dataclass(frozen=True)
class Turn:
    """How the next chunk runs."""

    chunk: int | None  # its tokens at most (None: the drafter's ubatch)
    duty: float  # the share of time computing: after the chunk, a pause of (1 / duty - 1) x its time


ALONE = Turn(None, 1.0)


@dataclass
class Pacing:
    """One prompt's draft beside `neighbours`; `duty` is the share of time this draft (or this lane
    of it) computes while slots decode."""

    neighbours: Neighbours = field(default_factory=Alone)
    started: float = field(default_factory=time.monotonic)  # on `clock`: when the prompt's job was made
    bound_s: float = POLITE_S
    duty: float = 1.0
    clock: Callable[[], float] = time.monotonic

    def polite(self) -> bool:
        """Whether the prompt is still within its bound."""
        return self.clock() - self.started < self.bound_s

    def turn(self) -> Turn:
        """The next chunk's size and duty (whether it steps aside is `stepping_aside`'s)."""
        if not self.polite():
            return ALONE
        if self.neighbours.slots_decoding():
            return Turn(SHARED_CHUNK, self.duty)
        return ALONE

    def stepping_aside(self) -> bool:
        """Whether to wait (or abort the chunk in flight) now: requests wait for a first token, and
        the prompt is within its bound."""
        return self.neighbours.interactive_waiting() and self.polite()

    def lane(self, duty: float) -> "Pacing":
        """The same prompt's pacing for one of its lanes, which computes `duty` of the time."""
        return replace(self, duty=duty)
