"""One request submitted straight to a served model's engine: start-up calibration and benchmarks."""
from __future__ import annotations

import threading
import time
from typing import Protocol

import numpy as np

from ...engine.engine import Engine
from ...engine.request import ErrorEvent, Event, FinishEvent, Request, SamplingParams, TextEvent
from ...llama import Model
from ...pflash.planning import Planner
from ..wire.protocol import PflashMode, PflashOverride
from ..wire.usage import openai_usage, totals


class Target(Protocol):
    """What a run needs of a served model (models.ServedModel has it)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def planner(self) -> Planner: ...


def random_prompt(model: Model, n_tokens: int, seed: int) -> list[int]:
    """Random token ids after the BOS (where the vocabulary has one): prefill time does not depend on
    what the tokens say."""
    rng = np.random.default_rng(seed)
    head = [model.bos] if model.bos >= 0 else []
    return head + [int(t) for t in rng.integers(0, model.n_vocab, n_tokens - len(head))]


class Run:
    """Wall time to the request's first token (or its end), its text and its usage (as OpenAI's
    usage object: what the benchmarks record)."""

    def __init__(self, served: Target, tokens: list[int], mode: PflashMode, max_tokens: int = 1,
                 speculative: bool = True) -> None:
        self.first = threading.Event()
        self.done = threading.Event()
        self.token_times: list[float] = []
        self.text = ""
        self.usage: dict = {}
        self.error: str | None = None
        self.start = time.perf_counter()
        plan = served.planner.plan(tokens, PflashOverride(mode=mode))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=speculative)
        self.request = Request.planned(tokens, params, plan, self._on_event)
        served.engine.submit(self.request)

    def _on_event(self, event: Event) -> None:
        now = time.perf_counter()
        if isinstance(event, TextEvent):
            self.token_times.extend([now] * len(event.tokens))
            self.text += event.text
            self.first.set()
        elif isinstance(event, FinishEvent):
            self.usage = openai_usage(totals([event.usage], event.usage.prompt_tokens))
            self.first.set()
            self.done.set()
        elif isinstance(event, ErrorEvent):
            self.error = event.message
            self.first.set()
            self.done.set()

    def wait(self, timeout: float = 600.0) -> "Run":
        if not self.done.wait(timeout):
            raise TimeoutError("request did not finish")
        if self.error:
            raise RuntimeError(self.error)
        return self

    @property
    def ttft_s(self) -> float:
        return (self.token_times[0] if self.token_times else time.perf_counter()) - self.start
