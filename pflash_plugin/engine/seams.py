"""The engine's seams: what it asks of its runner and of its compressor, and what it tells
background work about the requests it serves. Passed at construction; typed here, so a mock runner
or another compressor only has to match these shapes."""
from __future__ import annotations

from typing import Callable, Protocol

from .request import CompressionJob, Report, TokenOutput
from .scheduler import SlotRunner, Step


class Runner(SlotRunner, Protocol):
    """Executes steps on one llama.cpp context (engine.runner.LlamaRunner)."""

    def execute(self, step: Step) -> dict[int, TokenOutput | Exception]: ...
    def set_abort(self, should_abort: Callable[[], bool]) -> None: ...
    def close(self) -> None: ...


class CompressionResult(Protocol):
    @property
    def tokens(self) -> list[int]: ...  # what the target prefills
    @property
    def report(self) -> Report: ...


class Activity:
    """What the engine serves right now, published by its thread after every round and read by
    background work (PFlash drafting) on its own thread; single bools, so no lock."""

    def __init__(self) -> None:
        self._interactive_waiting = False
        self._slots_decoding = False

    def interactive_waiting(self) -> bool:
        """Requests wait for their first token: background work steps aside."""
        return self._interactive_waiting

    def slots_decoding(self) -> bool:
        """Slots are decoding: background work shares the device."""
        return self._slots_decoding

    def publish(self, interactive_waiting: bool, slots_decoding: bool) -> None:
        self._interactive_waiting, self._slots_decoding = interactive_waiting, slots_decoding


class Compressor(Protocol):
    """Runs compression jobs on its own thread (pflash.compressor.CompressionWorker)."""

    def submit(self, job: CompressionJob, neighbours: Activity,
               deliver: Callable[[CompressionResult], None]) -> None:
        """Compress `job` politely beside `neighbours`, then call `deliver` (on its thread)."""
        ...
