"""One scheduler thread per model: owns the llama context, runs steps, serves messages.

Other threads talk to it only through typed messages in an inbox (`Submit`, `Cancel`,
`Compressed`, `ClearCache`, `Shutdown`); every scheduler and KV mutation happens on the engine
thread, so none of it needs a lock. Its runner and compressor are the seams of seams.py; what it
tells the compressor (its `activity`) and the stats /status and /metrics read (a frozen
`stats.SchedulerStats`) are published each round. Each step runs through stepping.py (the launch,
the last step's text beside the decode, preemption for a newcomer). A failure tied to one request
fails that request alone; only a failure of llama.cpp itself marks the model failed (`health`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from .failures import Failures
from .compression_feed import feed
from .media_encoder import MediaEncoder, want_media
from .published import Published
from .request import ErrorKind, Report, Request, RequestStatus
from .scheduler import SHUTTING_DOWN, AdmissionError, Scheduler, Step
from .seams import Compressor, Runner
from .stepping import Stepping
from .stats import SchedulerStats
from .watchdog import Watchdog
from .step_policy import arrival_order

log = logging.getLogger(__name__)
_JOIN_MARGIN_S = 30.0  # shutdown waits this long past the grace for a step in flight to end


@dataclass(frozen=True)
class Submit:
    requests: tuple[Request, ...]  # admitted together (or refused together), sharing their first step
    answer: Future = field(default_factory=Future)  # None once admitted, or the AdmissionError


@dataclass(frozen=True)
class Cancel:
    request: Request


@dataclass(frozen=True)
class Compressed:
    request: Request
    tokens: list[int]
    report: Report


@dataclass(frozen=True)
class ClearCache:
    """Drop the idle slots' prefix caches and the host tier (tests and benchmarks that must run from scratch)."""


@dataclass(frozen=True)
class Shutdown:
    deadline: float  # time.monotonic(): in-flight requests still running then are cancelled


Message = Submit | Cancel | Compressed | ClearCache | Shutdown


def _prompt_tokens(message: Message) -> int | None:
    """A submission's shortest prompt (its requests start together); None for any other message."""
    return min(len(r.prompt_tokens) for r in message.requests) if isinstance(message, Submit) else None


@dataclass(frozen=True)
class Health:
    state: str  # "ok" | "draining" (shutting down) | "failed" (llama.cpp failed) | "stalled" | "stopped"
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "ok"


class Engine:
    def __init__(self, scheduler: Scheduler, runner: Runner, name: str = "engine",
                 compressor: Compressor | None = None, max_step_s: float = 0.0,
                 media: MediaEncoder | None = None) -> None:
        """`compressor` runs the jobs of the requests the scheduler hands off (it must have been
        built with `can_compress`), on its own thread, beside this engine's `activity`.
        `max_step_s`: a step that has run longer marks the engine stalled (0: never).
        `media`: the projector's encoder where the model serves images (issue 46), else None."""
        self.scheduler, self.runner, self.name = scheduler, runner, name
        self.compressor = compressor
        self.media = media
        self.watchdog = Watchdog(max_step_s)
        self.published = Published(scheduler)
        self.activity = self.published.activity  # what the compressor is told
        self.failures = Failures(scheduler, name)
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake = threading.Event()
        if media is not None:
            media.on_done = self._wake.set  # a request whose media just encoded can step
        self._closing = False  # shutdown() was called: submit refuses
        self._closing_lock = threading.Lock()  # no Submit lands behind the Shutdown message
        self._deadline: float | None = None  # engine thread: draining until then
        self.stepping = Stepping(scheduler, runner, self.failures, self.published)  # runs and counts the steps
        self._thread = threading.Thread(target=self._loop, name=f"pflash-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- called from any thread ------------------------------------------------------------
    def submit(self, *requests: Request) -> Future:
        """Hand requests to the engine thread, which admits them all or none (in the same step
        when slots allow). Raises AdmissionError at once for what can never be served, or while
        the engine cannot serve; the engine thread's answer, judged on its own state, comes in
        the returned future: None once admitted (running or queued), or the AdmissionError (BUSY,
        UNAVAILABLE) it refused them with (the requests also end with that error as their event)."""
        if self.failures.reason is not None:
            raise AdmissionError.unavailable(f"the model {self.name} failed: {self.failures.reason}")
        stalled = self.watchdog.stalled()
        if stalled:
            raise AdmissionError.unavailable(f"the model {self.name} is stalled: {stalled}")
        self.scheduler.check(*requests)  # reads only fixed limits
        want_media(self.media, requests, self.name)
        message = Submit(requests)
        with self._closing_lock:
            if self._closing:
                raise AdmissionError.unavailable(SHUTTING_DOWN)
            self._post(message)
        self.stepping.arrived(requests)
        return message.answer

    def cancel(self, request: Request) -> None:
        """Finish the request as cancelled before the next step; its slot and pages come back."""
        self._post(Cancel(request))

    def clear_prefix_cache(self) -> None:
        self._post(ClearCache())

    def shutdown(self, grace_s: float) -> None:
        """Stop admitting (UNAVAILABLE), let in-flight requests finish for `grace_s` seconds, cancel
        the rest, then end the engine thread. Blocks until it has ended."""
        with self._closing_lock:
            self._closing = True
            self._post(Shutdown(time.monotonic() + grace_s))
        if self._thread.is_alive():
            self._thread.join(timeout=grace_s + _JOIN_MARGIN_S)

    def stop(self) -> None:
        """Cancel whatever is in flight and end the engine thread."""
        self.shutdown(0.0)

    def close(self) -> None:
        """Free the runner's llama.cpp context; only once the engine thread has ended (after
        `shutdown`), so no step can be using it."""
        if self._thread.is_alive():
            raise RuntimeError(f"engine {self.name} is still running: shut it down before closing it")
        if self.media is not None:
            self.media.close()
        if self.scheduler.steps.speculation is not None:
            self.scheduler.steps.speculation.close()
        self.runner.close()

    def health(self) -> Health:
        if self.failures.reason is not None:
            return Health("failed", self.failures.reason)
        stalled = self.watchdog.stalled()
        if stalled:
            return Health("stalled", stalled)
        if not self._thread.is_alive():
            return Health("stopped", "the engine thread is not running")
        if self._closing:
            return Health("draining", SHUTTING_DOWN)
        return Health("ok")

    @property
    def steps(self) -> int:
        """Steps run so far."""
        return self.stepping.count

    def stats(self) -> SchedulerStats:
        """The stats the engine thread last published (after each step, and before events go out)."""
        return self.published.stats

    def _hand_off(self) -> None:
        """The requests the scheduler handed off, to the compressor (compression_feed.py)."""
        feed(self.compressor, self.scheduler.take_handed(), self.activity,
             lambda request, tokens, report: self._post(Compressed(request, tokens, report)))

    def _post(self, message: Message) -> None:
        self._inbox.put(message)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        """Rounds until a shutdown has drained everything; the watchdog times each busy one whole."""
        running = True
        self.watchdog.thread = threading.get_ident()
        while running:
            self.stepping.arrival.clear()
            self.watchdog.started = time.monotonic()
            try:
                running = self._round()
            except Exception as error:  # a bug must cost the requests in flight, never the thread
                log.exception("engine %s: scheduling failed; failing the requests in flight", self.name)
                for request in self.scheduler.live:
                    self.failures.fail(request, ErrorKind.FAILED, f"internal scheduler error: {error}")
                self._publish_status()
                self.scheduler.emit()
            finally:
                self.watchdog.started = None

    def _round(self) -> bool:
        """Events go out only after stats that show them: where the runner overlaps, those a step
        queued (ends, failures) wait for the next round, which builds the stats before sending them."""
        self.published.new_round()
        self._drain_inbox()
        if self._deadline is not None and self._drained():
            self.scheduler.emit()
            return False
        step = self.scheduler.schedule() if self.scheduler.has_work and self.failures.reason is None else Step([])
        self._hand_off()
        self.published.activity_now()
        if self.scheduler.outbox or not step.items:
            self.published.stats_now(self.steps)  # before the events go out: a client that got its answer sees it
        self.scheduler.emit()
        if not step.items:
            self.watchdog.started = None  # idle: waiting is no stall
            timeout = 0.5 if self._deadline is None else max(0.0, min(0.5, self._deadline - time.monotonic()))
            self._wake.wait(timeout)
            self._wake.clear()
            return True
        self.stepping.run(step)
        # overlapped, the next round publishes them (activity before its step, stats before its
        # events or beside its decode) and then sends this step's events
        if not self.runner.overlaps:
            self._publish_status()
            self.scheduler.emit()
        return True

    def _drained(self) -> bool:
        """While shutting down: True once nothing is in flight, cancelling it all at the deadline."""
        assert self._deadline is not None
        if self.scheduler.live and time.monotonic() >= self._deadline:
            for request in self.scheduler.live:
                self.scheduler.finish(request, RequestStatus.FINISHED_CANCELLED)
        if self.scheduler.live:
            return False
        self._publish_status()
        return True

    def _drain_inbox(self) -> None:
        """Every message that arrived since the last round, submissions of the round shortest
        prompt first (step_policy.arrival_order)."""
        messages: list[Message] = []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for message in arrival_order(messages, _prompt_tokens):
            if isinstance(message, Submit):
                self._admit(message)
            elif isinstance(message, Cancel):
                _guarded(self.scheduler, message.request, "cancelling", self.scheduler.finish, message.request,
                              RequestStatus.FINISHED_CANCELLED)
            elif isinstance(message, Compressed):
                _guarded(self.scheduler, message.request, "resuming after compression", self.scheduler.resume,
                              message.request, message.tokens, message.report)
            elif isinstance(message, ClearCache):
                self.scheduler.cache.clear()
            elif isinstance(message, Shutdown):
                self._deadline = min(message.deadline, self._deadline or message.deadline)

    def _admit(self, message: Submit) -> None:
        """Admit or refuse a client's requests together and answer its submit; an exception
        fails these requests alone."""
        refusal: AdmissionError | None
        try:
            failure = self.failures.reason
            if failure is not None or self._deadline is not None:
                refusal = AdmissionError.unavailable(f"the model {self.name} failed: {failure}"
                                                     if failure else SHUTTING_DOWN)
                self.scheduler.refuse(message.requests, refusal)
            else:
                refusal = self.scheduler.submit(*message.requests)
        except Exception as error:
            for request in message.requests:
                self.scheduler.fail(request, error, "admission")
            refusal = AdmissionError(ErrorKind.FAILED, f"admission failed: {type(error).__name__}: {error}")
        if refusal is None:
            message.answer.set_result(None)
        else:
            message.answer.set_exception(refusal)

    def _publish_status(self) -> None:
        self.published.activity_now()
        self.published.stats_now(self.steps)


def _guarded(scheduler: Scheduler, request: Request, what: str, fn: Callable[..., None], *args: Any) -> None:
    """Apply one request's message; an exception fails that request alone."""
    try:
        fn(*args)
    except Exception as error:
        scheduler.fail(request, error, what)
