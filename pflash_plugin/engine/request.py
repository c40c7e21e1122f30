"""Request state shared by the scheduler, the runner and the server.

A request carries two token lists: `prompt_tokens` is what the client sent (reported as
`usage.prompt_tokens`); `prefill_tokens` is what the target actually prefills, which PFlash may
have compressed. Everything the scheduler needs to decide is here, nothing about llama.cpp.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..llama import SamplerParams
from .line_limits import LineLimits
from .media_prompt import MediaSpan
from .reasoning_budget import ReasoningBudget, Thinking


class RequestStatus(enum.Enum):
    """Where a request is in its one lifecycle (the scheduler alone moves it):
    WAITING -> [COMPRESSING -> WAITING] -> PREFILLING -> DECODING -> FINISHED_*; any live status
    can go straight to a FINISHED_* one (cancel, error, refusal)."""

    WAITING = "waiting"  # queued for a slot
    COMPRESSING = "compressing"  # its prompt is on the compression thread
    PREFILLING = "prefilling"  # holds a slot, prompt tokens left to prefill
    DECODING = "decoding"  # holds a slot, generating
    FINISHED_STOP = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_CANCELLED = "cancelled"
    FINISHED_ERROR = "error"
    FINISHED_REJECTED = "rejected"  # refused before it ran (queue full, shutting down, bad input)

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def running(self) -> bool:
        return self in (RequestStatus.PREFILLING, RequestStatus.DECODING)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass
class SamplingParams(SamplerParams):
    """Per-request sampling, mirroring what llama_cpp.server accepts: the sampler chain's (its
    penalty window is the server's, set by the runner) and what the scheduler applies."""

    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    kept_stops: frozenset[str] = frozenset()  # of `stop`, those the text keeps (vLLM's include_stop_str_in_output)
    logprobs: int | None = None  # None: off; k >= 0: chosen token plus top-k alternatives
    min_tokens: int = 0
    reasoning_budget: ReasoningBudget | None = None  # the thinking's tokens at most (reasoning_budget.py)
    speculative: bool = True  # False: never draft tokens for it (where the engine speculates at all)
    # llguidance grammar text (engine/constraints.py) the output follows; `grammar` is llama.cpp's GBNF instead
    constraint: str | None = None
    # vLLM's: a generated token among these ends the request (stop), its text kept, once min_tokens are out
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Latency:
    """Where a finished request's time went, in milliseconds (0.0 for a stage it never reached)."""

    queue_ms: float  # waiting for a slot, its compression left out
    compress_ms: float  # on the compression thread
    prefill_ms: float
    ttft_ms: float  # arrival to first token
    decode_ms: float  # first token to the end
    # where a server sets the marks (0.0 otherwise): its headers reaching the server to the arrival
    # here (the body read and parsed, the prompt rendered and tokenized); the first token to its
    # first text event leaving the engine thread; that to the text handed to the client's socket
    # (a streamed answer; the server fills the last two in when it answers)
    prepare_ms: float = 0.0
    release_ms: float = 0.0
    emit_ms: float = 0.0


@dataclass
class Timings:
    """Wall-clock marks (time.perf_counter seconds); the server derives the reported ms."""

    arrival: float = field(default_factory=time.perf_counter)
    received: float | None = None  # its headers reached the server (set there; None in-process)
    body_read: float | None = None  # its body's last part was read (set there)
    handed: float | None = None  # to the compression thread
    resumed: float | None = None  # back from it
    admitted: float | None = None
    scheduled: float | None = None  # the step carrying its first prefill chunk was composed
    prefill_done: float | None = None
    first_token: float | None = None
    finished: float | None = None
    last_token: float | None = None
    first_released: float | None = None  # its first text event left the engine thread (a server sets these two)
    first_written: float | None = None  # the server handed its first text to the client

    def latency(self) -> Latency:
        def ms(a: float | None, b: float | None) -> float:
            return round((b - a) * 1000.0, 3) if a is not None and b is not None else 0.0

        compress = ms(self.handed, self.resumed)
        return Latency(
            queue_ms=round(max(ms(self.arrival, self.admitted) - compress, 0.0), 3),
            compress_ms=compress,
            prefill_ms=ms(self.admitted, self.prefill_done),
            ttft_ms=ms(self.arrival, self.first_token),
            decode_ms=ms(self.first_token, self.finished),
            prepare_ms=ms(self.received, self.arrival),
            release_ms=ms(self.first_token, self.first_released),
            emit_ms=ms(self.first_released, self.first_written),
        )

    def clock(self) -> dict[str, float]:
        """The marks set, as time.perf_counter seconds (the host's monotonic clock on Linux: a
        client on the same host places them on its own timeline, issue 48)."""
        marks = ("received", "body_read", "arrival", "admitted", "scheduled", "prefill_done", "first_token",
                 "first_released", "first_written", "finished")
        return {mark: round(at, 6) for mark in marks if (at := getattr(self, mark)) is not None}


@dataclass(frozen=True)
class Usage:
    """What a finished request used, in the engine's terms: the server formats it for each API."""

    prompt_tokens: int  # as the client sent them (PFlash may have prefilled fewer)
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused
    latency: Latency
    pflash: Report | None = None  # the compression report, if compression was asked for
    media_tokens: int = 0  # of prompt_tokens, its media's tokens (issue 46; not an M-RoPE image's positions)
    clock: dict[str, float] | None = None  # Timings.clock, where a server reports it (--usage_clock)


@dataclass
class TokenOutput:
    """One sampled token as the runner returns it; after the draft tokens the target accepted, where
    the row speculated (they come first, in order, then `token`)."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    accepted: tuple[int, ...] = ()

    def unrolled(self) -> list[TokenOutput]:
        """Each token taken, in order: the accepted drafts, then this one."""
        return [*(TokenOutput(token) for token in self.accepted), dataclasses.replace(self, accepted=())]


# Events pushed to the request's sink (the server turns them into JSON/SSE).
@dataclass
class TextEvent:
    text: str
    tokens: list[TokenOutput]


@dataclass
class FinishEvent:
    reason: str  # "stop" | "length" | "cancelled" (errors and refusals end with an ErrorEvent)
    usage: Usage
    stop: str | None = None  # the stop string that ended the text (reason "stop" without one: end of generation)


class ErrorKind(enum.Enum):
    """Why a request ended in an error or was refused, in the engine's terms: the server maps each
    kind to its answer (server/wire/errors.py: an HTTP status and an error type)."""

    INVALID = "invalid"  # the request as sent cannot be served (empty prompt, too many choices, bad grammar)
    TOO_LONG = "too_long"  # prompt + max_tokens over the context or a slot's KV
    BUSY = "busy"  # no room now: the live requests fill the slots and the queue; retry later
    UNAVAILABLE = "unavailable"  # the model takes no requests (shutting down, failed, stalled)
    FAILED = "failed"  # serving it raised (a bug, a step that failed): this request alone fails
    MODEL_FAILED = "model_failed"  # llama.cpp failed under it (no KV cells after eviction, a broken context)


@dataclass
class ErrorEvent:
    kind: ErrorKind
    message: str


Event = TextEvent | FinishEvent | ErrorEvent
_ids = itertools.count(1)


class RequestRefused(Exception):
    """The request's own input fails it mid-way (a grammar too costly to go on): INVALID, not FAILED."""


class Report(Protocol):
    """A compression report (pflash.report.PflashReport): the engine only passes it on."""

    def to_json(self) -> dict[str, Any]: ...


class CompressionJob(Protocol):
    """A prompt's compression still to run (pflash.compressor.CompressionJob), as the engine sees it."""

    cancelled: threading.Event  # set by the engine when the request ends first
    progress: int  # tokens drafted so far (for /status)

    def skipped(self, reason: str, cause: str) -> Report: ...


class Plan(Protocol):
    """A prompt's compression plan (pflash.planning.Plan), as the engine sees it."""

    @property
    def job(self) -> CompressionJob | None: ...  # the compression to run (the n samples of a prompt share it)

    @property
    def report(self) -> Report | None: ...  # else why there is none (neither: nothing to report)


class Sink(Protocol):
    """Where a request's events go: called by Scheduler.emit alone, on the engine thread."""

    def __call__(self, event: Event, /) -> None: ...


def discard(event: Event) -> None:
    """The sink of a request nobody listens to (or whose own sink raised)."""


@dataclass(eq=False)
class Request:
    prompt_tokens: list[int]
    params: SamplingParams
    sink: Sink = discard
    # called once after each burst of events (Scheduler.emit: one step's), for a sink that stages
    # events and hands them over together (the server wakes its event loop once per step)
    flush: Callable[[], None] | None = None
    request_id: int = field(default_factory=lambda: next(_ids))
    prefill_tokens: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    cached_tokens: int = 0  # prefix reused from the KV cache
    n_prefilled: int = 0  # prefill tokens already in the KV (cached ones included)
    output_tokens: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    pflash: Report | None = None  # compression report for usage.timings.pflash
    compression: CompressionJob | None = None  # the compression job still to run
    # vLLM's field: under the `priority` admission policy lower values take a slot first (admission.py)
    priority: int = 0
    thinking: Thinking | None = None  # its reasoning budget's state, where it has one
    # its media chunks (issue 46, media_prompt.py): prompt_tokens holds pseudo-token ids at their positions
    media: tuple[MediaSpan, ...] = ()
    line_limits: LineLimits | None = None  # a code editor's n_indent / t_max_predict_ms (line_limits.py)

    def __post_init__(self) -> None:
        if not self.prefill_tokens:
            self.prefill_tokens = list(self.prompt_tokens)
        if self.params.reasoning_budget is not None and self.thinking is None:
            self.thinking = Thinking(self.params.reasoning_budget)

    @classmethod
    def planned(cls, tokens: list[int], params: SamplingParams, plan: Plan, sink: Sink = discard,
                priority: int = 0, media: tuple[MediaSpan, ...] = ()) -> Request:
        """A request built with its prompt's compression plan (the HTTP path and the in-process
        one alike), so nothing attaches the job or the report afterwards. A prompt with `media`
        has no job: the planner reports it skipped (pflash/planning.py, MEDIA_KEPT)."""
        return cls(tokens, params, sink, compression=plan.job, pflash=plan.report, priority=priority, media=media)

    @property
    def finish_reason(self) -> str | None:
        """None while the request lives; "stop", "length", "cancelled", "error" or "rejected"."""
        return self.status.finish_reason

    @property
    def held_slot(self) -> int:
        """The slot of a request that holds one (prefilling or decoding)."""
        assert self.slot is not None, f"request {self.request_id} holds no slot"
        return self.slot

    @property
    def prefill_left(self) -> int:
        return len(self.prefill_tokens) - self.n_prefilled

    @property
    def reserve_tokens(self) -> int:
        """KV positions this request may occupy: its prefill plus every token it may generate."""
        return len(self.prefill_tokens) + self.params.max_tokens

    def usage(self) -> Usage:
        return Usage(len(self.prompt_tokens), len(self.output_tokens), self.cached_tokens,
                     self.timings.latency(), self.pflash, sum(span.chunk.n_tokens for span in self.media))
