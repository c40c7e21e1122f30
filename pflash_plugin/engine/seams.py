"""The engine's seams: what it asks of its runner and of its compressor, and what it tells
background work about the requests it serves. Passed at construction; typed here, so a mock runner
or another compressor only has to match these shapes."""
from __future__ import annotations

from typing import Callable, Protocol

from .request import CompressionJob, Report, TokenOutput
from .scheduler import SlotRunner, Step
from .step_policy import Flags


class Runner(SlotRunner, Protocol):
    """Executes steps on one llama.cpp context (engine.runner.LlamaRunner)."""

    # a step's decode is launched, then collected: between the two the engine does the host work
    # that needs nothing of this step (the last step's text and events) while a GPU computes
    overlaps: bool  # launch returns before the decode has run (a GPU)
    def returns_early(self, step: Step) -> bool: ...  # overlaps, and this step's launch returns before it has run
    def launch(self, step: Step) -> None: ...  # raises DecodeError
    def collect(self, step: Step) -> dict[int, TokenOutput | Exception]: ...
    def set_abort(self, should_abort: Callable[[], bool]) -> None: ...
    def arm_abort(self, armed: bool) -> None: ...  # polled in the next launch (a preemptible step) or not
    def kv_tokens(self, slot: int) -> int: ...  # the slot's KV positions (what an aborted step kept)
    def close(self) -> None: ...


class CompressionResult(Protocol):
    @property
    def tokens(self) -> list[int]: ...  # what the target prefills
    @property
    def report(self) -> Report: ...


class Activity:
    """What the engine serves right now (step_policy.Flags, computed with the steps), published by
    its thread after every round and read by background work (PFlash drafting, pflash.pacing's
    Neighbours) on its own thread; one frozen value replaced whole, so no lock and no torn read."""

    def __init__(self) -> None:
        self._flags = Flags()

    def interactive_waiting(self) -> bool:
        """Requests with a slot wait for their first token: background work steps aside."""
        return self._flags.interactive_waiting

    def first_token_next(self) -> bool:
        """A request's first token comes from the next step: a large request's preparation waits."""
        return self._flags.first_token_next

    def slots_decoding(self) -> bool:
        """Slots are decoding: background work shares the device."""
        return self._flags.slots_decoding

    def publish(self, flags: Flags) -> None:
        self._flags = flags


class Compressor(Protocol):
    """Runs compression jobs on its own thread (pflash.compressor.CompressionWorker)."""

    def submit(self, job: CompressionJob, neighbours: Activity,
               deliver: Callable[[CompressionResult], None]) -> None:
        """Compress `job` politely beside `neighbours`, then call `deliver` (on its thread)."""
        ...
