"""Continuous batching over slots whose KV the prefix cache (engine/prefix_cache.py) accounts for.

Pure Python: the scheduler decides, a runner executes. The scheduler is the mechanism: it moves
requests through their lifecycle, places them in slots, takes their tokens and ends them. The rules
are policy objects beside it, each tested on its own:

- admission.py: the order in which queued requests are offered a slot (first come first served by
  default; `priority` per request, or shortest prompt first),
- lending.py: which queued request may take the slot of a long prompt that has not prefilled into it,
- prefill_sharing.py: which queued request waits for another's prefill of its prefix, so a prompt is
  prefilled once,
- step_policy.py: the split of each step between decoding and prefilling (a decode row for every
  generating slot, the rest of the token budget in prefill chunks, so a long prefill never stalls
  decoding), and what background drafting is told.

Its mechanism's parts are modules too: intake.py takes a row's sampled tokens into its request (end
of generation, the reasoning budget, max_tokens, stop strings) and releases their text.

Idle slots keep their KV as a prefix cache; a new request reuses the longest cached prefix of any
slot (in place, or shared through `seq_cp`), and idle caches are evicted least recently used when
pages are needed. Every request moves through one `RequestStatus` lifecycle, and `finish` is the
only way out of it. The scheduler never calls a sink while it decides: it queues events in its
outbox (outbox.py), and `emit` delivers them, so a sink that raises costs its own request alone.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .admission import SCHEDULE_POLICIES, RequestQueue
from .handoff import CompressionHandoff
from .host_cache import HostCache
from .intake import Intake
from .kv_pool import PagePool
from .lending import SlotLending
from .limits import AdmissionError, Limits
from .live_text import LiveText
from .media_prompt import media_failure
from .outbox import Outbox
from .prefill_sharing import PrefillSharing
from .prefix_cache import KVOps, PrefixCache, Slot
from .request import ErrorEvent, ErrorKind, FinishEvent, Report, Request, RequestStatus, TokenOutput
from .stats import CompressingStats, SchedulerStats, SlotStats
from .step_policy import StepPolicy
from .steps import BatchItem, Step, Steps

__all__ = ["SHUTTING_DOWN", "AdmissionError", "BatchItem", "Scheduler", "SchedulerConfig", "SlotRunner", "Step"]
log = logging.getLogger(__name__)
_ENDED_CLEANLY = (RequestStatus.FINISHED_STOP, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_CANCELLED)


SHUTTING_DOWN = "the server is shutting down"


class SlotRunner(KVOps, Protocol):
    """What the scheduler asks of its runner: the KV operations (the prefix cache's), and a
    request's sampler bound to the slot it takes for as long as it holds it (the runner's sampling:
    a request's lifecycle, not its KV)."""

    def start_request(self, slot: int, request: Request) -> None: ...  # ValueError: its own parameters
    def end_request(self, slot: int) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits and policies."""

    n_slots: int
    max_batch_tokens: int  # tokens of one step (decode tokens first, prefill chunks in the rest)
    max_ctx: int  # per request: prompt + max_tokens
    max_queue: int  # live requests beyond the slots; more are refused for load
    # while requests decode, a step prefills at most this many tokens times the prompts prefilling
    # (this many in all where chunk_per_step), all of it to the shortest first, so steps stay short
    # and the decoding ones keep their latency (None: no cap)
    prefill_chunk: int | None = None
    chunk_per_step: bool = False
    prefill_per_answer: int = 0  # the cap grows to this over the answers decoding where that is more (StepPolicy)
    # a step prefilling more tokens than this (one prompt or several) is aborted for a newcomer
    # whose prompt fits a step, so its first token need not wait for the whole step (None: never)
    preempt_chunk: int | None = None
    # each step a prefilling prompt is left out of counts as this many fewer tokens left, so a
    # long prompt gets through a steady stream of short ones
    aging: int = 128
    # requests that ask for compression are handed off (`take_handed`), else prefilled in full
    can_compress: bool = False
    # a prompt that extends a compressed prompt still cached (the next turn of a conversation)
    # prefills those compressed cells plus its new tokens instead of being compressed again: no
    # draft, but the kept segments were chosen for the earlier prompt's question
    reuse_compressed: bool = False
    # per-slot KV streams: a prefix another slot holds is copied (a whole stream) only when it is
    # this many tokens longer than what the chosen slot reuses in place (PrefixCache)
    min_copy_tokens: int = 0
    # n_swa of a window-sized SWA KV cache: a prefix is reused only where its last n_swa cells remain
    swa_window: int = 0
    # a queued request whose prefix a running one is prefilling waits for it (prefill_sharing.py)
    # where that saves at least this many tokens (and min_copy_tokens); None: never
    share_prefill_tokens: int | None = 64
    # the order queued requests are offered slots (admission.SCHEDULE_POLICIES): "fcfs", "priority"
    # (Request.priority, lower first), "shortest" (fewest prefill tokens first, passes bounded)
    schedule_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy {self.schedule_policy!r}: one of {', '.join(SCHEDULE_POLICIES)}")


class Scheduler:
    def __init__(self, kv: SlotRunner, pools: list[PagePool], config: SchedulerConfig, piece: Callable[[int], bytes],
                 is_eog: Callable[[int], bool], clock: Callable[[], float] = time.perf_counter,
                 host: HostCache | None = None) -> None:
        assert len(pools) == config.n_slots, "one page pool per slot (the same one for a unified KV)"
        self.kv, self.config, self.clock = kv, config, clock
        self.cache = PrefixCache(kv, pools, clock, config.min_copy_tokens, config.reuse_compressed, host,
                                 config.swa_window)
        self.slots: list[Slot] = self.cache.slots
        share = config.share_prefill_tokens
        self.sharing = PrefillSharing(self.cache, None if share is None else max(share, config.min_copy_tokens))
        self.queue = RequestQueue(SCHEDULE_POLICIES[config.schedule_policy]())
        self.lending = SlotLending(self.queue.policy.rank)
        self.limits = Limits(self.cache, config.n_slots, config.max_ctx, config.max_queue)
        self.compression = CompressionHandoff(self.queue, self.cache, clock, config.can_compress,
                                              config.reuse_compressed)
        self.outbox = Outbox(lambda request, error: self.fail(request, error, "delivering its output"))
        self.text = LiveText(piece, self.outbox)
        self.intake = Intake(self.text, is_eog, self.finish, self.fail)
        self.steps = Steps(StepPolicy(config.max_batch_tokens, config.prefill_chunk, config.aging, config.preempt_chunk,
                                      config.chunk_per_step, config.prefill_per_answer), self.cache, self.text)
        self.running: list[Request] = []
        # the queue's tiers and the compressing requests, under the names tests and stats read
        self.waiting, self.prepared = self.queue.waiting, self.queue.prepared
        self.compressing = self.compression.compressing

    # ---- admission -------------------------------------------------------------------------
    def check(self, *requests: Request) -> None:
        """Refuse what can never be served, whatever the load (Limits.check); any thread may call it,
        the load is judged by `submit`, on the engine thread."""
        self.limits.check(*requests)

    def submit(self, *requests: Request) -> AdmissionError | None:
        """Admission on the engine thread, all of a client's requests or none: admitted while the
        live requests stay within slots + max_queue (so one that a free slot can take is admitted
        whatever max_queue is), else each is finished as refused and the error is returned.
        Queued requests that a free slot can take move into it first; an admitted request nobody
        waits ahead of goes straight into a free slot."""
        self.admit()
        try:
            self.limits.check(*requests)
            self.limits.check_room(len(self.live), len(requests))
        except AdmissionError as error:
            self.refuse(requests, error)
            return error
        for request in requests:
            if (request.compression is None and not len(self.queue)
                    and not self.sharing.waits(request, self.running) and self.cache.place(request)):
                self._start(request)
            else:
                self.add(request)
        self.admit()
        return None

    def refuse(self, requests: tuple[Request, ...], error: AdmissionError) -> None:
        """End requests that were never admitted with the refusal as their event."""
        for request in requests:
            self.finish(request, RequestStatus.FINISHED_REJECTED, ErrorEvent(error.kind, error.message))

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.queue.add(request)

    def take_handed(self) -> list[Request]:
        """The requests handed off for compression since the last call, for the engine's compressor."""
        return self.compression.take_handed()

    def resume(self, request: Request, tokens: list[int], report: Report) -> None:
        """A compression came back: queue the (maybe compressed) prompt ahead of new arrivals."""
        self.compression.resume(request, tokens, report)

    def admit(self) -> None:
        """Hand off what needs compression, then give free slots to queued requests in the admission
        policy's order, passing over those that wait for another's prefill of their prefix
        (prefill_sharing.py); stops at the first that does not fit, so the order holds. Where no
        slot is free, a running prompt that has not prefilled into its slot may lend it to a queued
        request (lending.py): the lender goes back to the queue (RequestQueue.requeue)."""
        self.compression.hand_off()
        while True:
            head = self.sharing.first(self.running, self.queue.entries())
            if head is None:
                return
            if self.cache.place(head[0][head[1]]):
                self._start(self.queue.take(*head))
                continue
            idle = [r for r in self.running if r.status is RequestStatus.PREFILLING
                    and r.n_prefilled == r.cached_tokens and self.text.starved(r)
                    and not self.cache.copying(self.slots[r.held_slot])] if self.cache.per_slot else []
            loan = idle and self.lending.loan(idle, self.queue.entries(), lambda r: self.sharing.waits(r, self.running))
            if not loan:
                return
            queue, at, lender = loan
            borrower = self.queue.take(queue, at)
            self._vacate(lender, forget_kv=False)
            self.lending.lent(lender)
            lender.status, lender.slot, lender.timings.admitted = RequestStatus.WAITING, None, None
            lender.n_prefilled = lender.cached_tokens = 0
            self.queue.requeue(lender)
            placed = self.cache.place(borrower)
            assert placed, "a lent slot fits any admissible request (a KV stream per slot)"
            self._start(borrower)

    def _start(self, request: Request) -> None:
        request.status = RequestStatus.PREFILLING
        request.timings.admitted = self.clock()
        self.running.append(request)
        self.text.start(request)
        try:
            self.kv.start_request(request.held_slot, request)
        except ValueError as error:  # the client's (a grammar that does not parse)
            self.finish(request, RequestStatus.FINISHED_REJECTED, ErrorEvent(ErrorKind.INVALID, str(error)))
        except Exception as error:
            self.fail(request, error, "starting")

    # ---- stepping --------------------------------------------------------------------------
    def schedule(self) -> Step:
        """Admit what fits, then the step the step policy composes from the running requests."""
        self.admit()
        for request in [r for r in self.running if r.media and r.status is RequestStatus.PREFILLING]:
            error = media_failure(request.media, request.n_prefilled)
            if error is not None:  # its media failed to encode: it alone fails
                self.fail(request, error, "encoding its media")
        step = self.steps.compose(self.running)
        now = None
        for item in step.items:  # each prompt's first chunk: when the step carrying it was composed
            if item.request.timings.scheduled is None and item.request.status is RequestStatus.PREFILLING:
                item.request.timings.scheduled = now = now or self.clock()
        return step

    def update(self, step: Step, outputs: dict[int, TokenOutput | Exception], release: bool = True) -> None:
        """Apply a successful decode: extend the slots, take the sampled tokens, finish some.
        `outputs` holds an exception for a request whose sampling failed: that request fails.
        `release`: their text too (`release_text`); else the caller releases it later."""
        self.cache.decoded()
        now = self.clock()
        for item in step.items:
            request = item.request
            if not request.status.running:
                # finished while the step ran: drop what the step wrote past the slot's tokens (a
                # filler row's too where a request holds the slot: Steps._bridges)
                slot = self.slots[request.held_slot]
                if slot.request is None or item.filler:
                    self.cache.trim(slot)
                continue
            try:
                self._apply(item, outputs.get(request.request_id), now)
            except Exception as error:
                self.fail(request, error, "taking its token")
        if release:
            self.release_text()

    def _apply(self, item: BatchItem, out: TokenOutput | Exception | None, now: float) -> None:
        """One row's outcome: its tokens in the slot (drafts the target rejected leave it and the KV),
        its prefill's progress, then its sampled tokens taken in (intake.py)."""
        request = item.request
        self.steps.keep(item, out)
        if request.status is RequestStatus.PREFILLING:
            request.n_prefilled += len(item.tokens)
            if not request.prefill_left:
                request.status = RequestStatus.DECODING
                request.timings.prefill_done = now
        if item.wants_logits:
            self.intake.take(request, out, now)

    def release_text(self, fresh_only: bool = False) -> None:
        """The text of the tokens taken since the last call, as events (Intake.release); a request
        whose text reaches a stop string finishes. The engine calls it while the next step's decode
        runs on a GPU (a step after the stop then has a row for the finished request: `update` drops
        what it wrote), right after `update` otherwise. `fresh_only`: the requests' whose first
        token is among them (a GPU's engine sends those before the next launch)."""
        self.intake.release(self.running, fresh_only)

    # ---- the end of a request ----------------------------------------------------------------
    def finish(self, request: Request, status: RequestStatus, error: ErrorEvent | None = None,
               forget_kv: bool = False) -> None:
        """The one way a request ends, whatever the reason: it leaves its queue, its compression
        job is cancelled, its slot is given back (the KV stays as a prefix cache unless
        `forget_kv`: a failed decode left it unknown), and its last events are queued. Errors
        and refusals end with `error` alone; the others with a FinishEvent."""
        assert status.finished and (error is None) == (status in _ENDED_CLEANLY), (status, error)
        prior = request.status
        if prior.finished:
            return
        if error is None and prior.running:  # the text of its last tokens first: a failure there changes nothing yet
            self.text.release(request)
        self.lending.forget(request)
        request.status = status
        request.timings.finished = self.clock()
        stop = None
        if prior is RequestStatus.WAITING:
            self.queue.remove(request)
        elif prior is RequestStatus.COMPRESSING:
            self.compression.drop(request)
        else:
            hit = self._vacate(request, forget_kv, clean=error is None)
            stop = hit if status is RequestStatus.FINISHED_STOP else None
        self.outbox.push(request, error or FinishEvent(status.value, request.usage(), stop))

    def _vacate(self, request: Request, forget_kv: bool, clean: bool = False) -> str | None:
        """Take a running request off its slot (finished, or back to its queue): its sampler is
        freed, whatever becomes of the slot's KV (a prefix cache unless `forget_kv`), and its text
        stream closed (LiveText.close: the stop string it hit)."""
        self.running.remove(request)
        self.kv.end_request(request.held_slot)
        self.cache.release(self.slots[request.held_slot], forget_kv)
        return self.text.close(request, clean)

    def fail(self, request: Request, error: BaseException, what: str) -> None:
        """An exception tied to one request fails that request alone (FAILED, naming it)."""
        log.error("request %s: %s failed", request.request_id, what, exc_info=error)
        message = f"request {request.request_id}: {what} failed: {type(error).__name__}: {error}"
        self.finish(request, RequestStatus.FINISHED_ERROR, ErrorEvent(ErrorKind.FAILED, message))

    def emit(self) -> None:
        """Deliver the queued events (Outbox.emit)."""
        self.outbox.emit()

    # ---- reporting -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.running or len(self.queue))  # compressing ones come back via resume

    @property
    def live(self) -> list[Request]:
        """Every request not finished: running, queued, compressing."""
        return [*self.running, *self.prepared, *self.waiting, *self.compressing]

    def stats(self) -> SchedulerStats:
        return _stats(self)


def _stats(sched: Scheduler) -> SchedulerStats:
    """The scheduler's state as one frozen record (stats.py), for /status and /metrics."""
    def state(slot: Slot) -> str:
        if slot.request is None:
            return "idle"
        return "prefill" if slot.request.status is RequestStatus.PREFILLING else "decode"

    return SchedulerStats(
        slots=tuple(SlotStats(s.index, state(s), s.request.request_id if s.request else None, len(s.tokens),
                              len(s.pages)) for s in sched.slots),
        running=len(sched.running),
        waiting=len(sched.queue),
        compressing=tuple(CompressingStats(r.request_id, len(r.prompt_tokens),
                                           r.compression.progress if r.compression else 0)
                          for r in sched.compressing),
        waiting_prepared=len(sched.prepared),
        cache=sched.cache.stats(),
        speculation=sched.steps.speculation_stats(),
    )
