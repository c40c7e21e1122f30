"""Continuous batching over slots whose KV the prefix cache (engine/prefix_cache.py) accounts for.

Pure Python: the scheduler decides, a runner executes. Each step decodes one token for every
generating slot and fills the rest of the token budget with prefill chunks, so a long prefill
never stalls decoding (the rule, and what background drafting is told: step_policy.py). Idle
slots keep their KV as a prefix cache; a new request reuses the longest cached prefix of any
slot (in place, or shared through `seq_cp`), and idle caches are evicted least recently used when
pages are needed. A queued request whose prefix another is prefilling waits for that prefill and
reuses it (prefill_sharing.py), so a prompt is prefilled once.

Every request moves through one `RequestStatus` lifecycle, and `finish` is the only way out of it.
The scheduler never calls a sink while it decides: it queues events, and `emit` delivers them, so
a sink that raises costs its own request and nothing else.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from .kv_pool import PagePool
from .host_cache import HostCache
from .prefill_sharing import PrefillSharing
from .prefix_cache import KVOps, PrefixCache, Slot
from .request import (
    ErrorEvent,
    ErrorKind,
    Event,
    FinishEvent,
    Report,
    Request,
    RequestRefused,
    RequestStatus,
    TextEvent,
    TokenOutput,
    discard,
)
from .stats import CompressingStats, SchedulerStats, SlotStats
from .step_policy import Flags, Seat, StepPolicy, flags
from .text_stream import TextStream

log = logging.getLogger(__name__)
_ENDED_CLEANLY = (RequestStatus.FINISHED_STOP, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_CANCELLED)


SHUTTING_DOWN = "the server is shutting down"


class AdmissionError(Exception):
    """Requests refused before they run, and why (the server answers each kind in its own way)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message

    @classmethod
    def unavailable(cls, reason: str) -> AdmissionError:
        """The model takes no requests now (failed, stalled, SHUTTING_DOWN)."""
        return cls(ErrorKind.UNAVAILABLE, reason)


class SlotRunner(KVOps, Protocol):
    """What the scheduler asks of its runner: the KV operations (the prefix cache's), and a
    request's sampler bound to the slot it takes for as long as it holds it (the runner's sampling:
    a request's lifecycle, not its KV)."""

    def start_request(self, slot: int, request: Request) -> None: ...  # ValueError: its own parameters
    def end_request(self, slot: int) -> None: ...


@dataclass
class _Live:
    """What the scheduler keeps for a request while it holds a slot."""

    stream: TextStream
    unread: list[TokenOutput] = field(default_factory=list)  # taken, not yet through the text stream
    pending: list[TokenOutput] = field(default_factory=list)  # through the stream, their text held back
    starved: int = 0  # steps it was left out of while prefilling (aging)


@dataclass
class BatchItem:
    request: Request
    tokens: list[int]
    start_pos: int
    wants_logits: bool


@dataclass
class Step:
    items: list[BatchItem]

    @property
    def n_tokens(self) -> int:
        return sum(len(item.tokens) for item in self.items)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits and policies."""

    n_slots: int
    max_batch_tokens: int  # tokens of one step (decode tokens first, prefill chunks in the rest)
    max_ctx: int  # per request: prompt + max_tokens
    max_queue: int  # live requests beyond the slots; more are refused for load
    # while requests decode, a step prefills at most this many tokens times the prompts prefilling,
    # all of it to the shortest first, so steps stay short and the decoding ones keep their latency
    # (None: no cap)
    prefill_chunk: int | None = None
    # a prompt prefilling alone in a step of more tokens than this is aborted for a newcomer, so
    # the newcomer's first token need not wait for the whole step (None: never)
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
    # a queued request whose prefix a running one is prefilling waits for it (prefill_sharing.py)
    # where that saves at least this many tokens (and min_copy_tokens); None: never
    share_prefill_tokens: int | None = 64


class Scheduler:
    def __init__(
        self,
        kv: SlotRunner,
        pools: list[PagePool],
        config: SchedulerConfig,
        piece: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        clock: Callable[[], float] = time.perf_counter,
        host: HostCache | None = None,
    ) -> None:
        assert len(pools) == config.n_slots, "one page pool per slot (the same one for a unified KV)"
        self.kv, self.config = kv, config
        self.policy = StepPolicy(config.max_batch_tokens, config.prefill_chunk, config.aging, config.preempt_chunk)
        self.cache = PrefixCache(kv, pools, clock, config.min_copy_tokens, config.reuse_compressed, host)
        share = config.share_prefill_tokens
        self.sharing = PrefillSharing(self.cache, None if share is None else max(share, config.min_copy_tokens))
        self.slots: list[Slot] = self.cache.slots
        self.piece, self.is_eog, self.clock = piece, is_eog, clock
        self.waiting: deque[Request] = deque()  # new arrivals, first come first served
        self.prepared: deque[Request] = deque()  # back from compression: ahead of new arrivals
        self.running: list[Request] = []
        self.compressing: list[Request] = []
        self._handed: list[Request] = []  # handed off, for the engine to give to its compressor
        self._live: dict[int, _Live] = {}
        self._outbox: deque[tuple[Request, Event]] = deque()
        self._lent: set[int] = set()  # requests that gave their slot to a shorter one (once each)

    # ---- admission -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Live requests (running, queued, compressing) the engine holds at most: slots + max_queue."""
        return len(self.slots) + self.config.max_queue

    def check(self, *requests: Request) -> None:
        """Refuse what can never be served, whatever the load (INVALID, TOO_LONG). Reads only fixed limits,
        so any thread may call it; the load is judged by `submit`, on the engine thread."""
        if len(requests) > self.capacity:
            raise AdmissionError(
                ErrorKind.INVALID,
                f"{len(requests)} choices can never be served together: this model runs "
                f"{len(self.slots)} at once (max_concurrency) and queues {self.config.max_queue} more (max_queue)",
            )
        for request in requests:
            self._check_fits(request)

    def _check_fits(self, request: Request) -> None:
        n_prompt = len(request.prompt_tokens)
        if n_prompt == 0:
            raise AdmissionError(ErrorKind.INVALID, "the prompt is empty")
        if n_prompt + request.params.max_tokens > self.config.max_ctx:
            raise AdmissionError(
                ErrorKind.TOO_LONG,
                f"prompt ({n_prompt} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{n_prompt + request.params.max_tokens} exceeds the context limit max_ctx "
                f"({self.config.max_ctx} tokens)",
            )
        capacity = self.cache.slot_capacity
        if self.cache.pages_for(request.reserve_tokens) * self.cache.page_size > capacity:
            where = "a slot's KV stream holds" if self.cache.per_slot else "the KV pool holds"
            raise AdmissionError(
                ErrorKind.TOO_LONG,
                f"the request needs {request.reserve_tokens} KV tokens (prompt + max_tokens), {where} {capacity}",
            )

    def submit(self, *requests: Request) -> AdmissionError | None:
        """Admission on the engine thread, all of a client's requests or none: admitted while the
        live requests stay within slots + max_queue (so one that a free slot can take is admitted
        whatever max_queue is), else each is finished as refused and the error is returned.
        Queued requests that a free slot can take move into it first; an admitted request nobody
        waits ahead of goes straight into a free slot."""
        self.admit()
        try:
            self.check(*requests)
            live = len(self.live)
            if live + len(requests) > self.capacity:
                raise AdmissionError(
                    ErrorKind.BUSY,
                    f"no room for {len(requests)} more request(s): {live} are running or queued, of "
                    f"{self.capacity} ({len(self.slots)} slots + max_queue {self.config.max_queue}); retry later",
                )
        except AdmissionError as error:
            self.refuse(requests, error)
            return error
        for request in requests:
            if (request.compression is None and not self.waiting and not self.prepared
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
        self.waiting.append(request)

    def _hand_off(self) -> None:
        """Hand off waiting requests that asked for compression, unless the prefix cache already
        holds most of the prompt (measured here: the compression thread never reads the cache)."""
        reuse_turns = self.config.can_compress and self.config.reuse_compressed
        for request in [r for r in self.waiting if r.compression is not None]:
            assert request.compression is not None
            extended = self.cache.compressed_source(request.prompt_tokens) if reuse_turns else None
            if extended is not None:
                self._reuse_compressed(request, extended)
                continue
            reuse = self.cache.cached_prefix(request.prompt_tokens)
            if not self.config.can_compress or reuse * 2 >= len(request.prompt_tokens):
                if self.config.can_compress:
                    request.pflash = request.compression.skipped(f"{reuse} prompt tokens are cached", "cached")
                else:
                    request.pflash = request.compression.skipped("no compressor", "no_compressor")
                request.compression = None
                continue
            self.waiting.remove(request)
            request.status = RequestStatus.COMPRESSING
            request.timings.handed = self.clock()
            self.compressing.append(request)
            self._handed.append(request)

    def _reuse_compressed(self, request: Request, slot: Slot) -> None:
        """Prefill the compressed prompt `slot` caches in place of the original it extends, then the
        rest of `request`'s prompt: the cached cells serve again and nothing is drafted."""
        assert slot.source is not None and request.compression is not None
        n_source = len(slot.source)
        request.prefill_tokens = slot.tokens[:slot.source_len] + request.prompt_tokens[n_source:]
        request.pflash = request.compression.skipped(
            f"extends a prompt compressed earlier: its first {n_source} tokens reuse the {slot.source_len} "
            "cached cells of its compressed form", "extends_compressed")
        request.compression = None

    def take_handed(self) -> list[Request]:
        """The requests handed off since the last call, for the engine's compressor."""
        handed, self._handed = self._handed, []
        return handed

    def resume(self, request: Request, tokens: list[int], report: Report) -> None:
        """A compression came back: queue the (maybe compressed) prompt ahead of new arrivals."""
        if request.status is not RequestStatus.COMPRESSING:
            return  # finished meanwhile (cancelled): the late result is dropped
        self.compressing.remove(request)
        request.timings.resumed = self.clock()
        request.compression = None
        request.prefill_tokens = list(tokens)
        request.pflash = report
        request.status = RequestStatus.WAITING
        self.prepared.append(request)

    def admit(self) -> None:
        """Hand off what needs compression, then give free slots to queued requests in order
        (compressed ones first), passing over those that wait for another's prefill of their prefix
        (prefill_sharing.py); stops at the first that does not fit, so admission stays FIFO.
        Where no slot is free, a queued request may take the slot of a prompt at least twice as
        long that has not prefilled into it (`_loan`), even behind a longer one queued ahead of it
        (which could not take that slot): little is lost, and a short chat sent with long prompts
        need not wait behind all of them."""
        self._hand_off()
        while self._admit_next():
            pass

    def _admit_next(self) -> bool:
        """Start one queued request: the first that waits for no other's prefill (prefill_sharing.py)
        where a slot fits it, else the first queued request that a slot is lent to. False when
        neither is possible."""
        head = self.sharing.first(self.running, self.prepared, self.waiting)
        if head is None:
            return False
        queue, at = head
        if self.cache.place(queue[at]):
            request = queue[at]
            del queue[at]
            self._start(request)
            return True
        loan = self._loan()
        if loan is None:
            return False
        queue, at, lender = loan
        borrower = queue[at]
        del queue[at]
        self._requeue(lender)
        placed = self.cache.place(borrower)
        assert placed, "a lent slot fits any admissible request (a KV stream per slot)"
        self._start(borrower)
        return True

    def _loan(self) -> tuple[deque[Request], int, Request] | None:
        """The first queued request (compressed ones first) that a running prompt may lend its slot
        to, as its queue and place there, and that prompt: of those that have held their slot
        through a step without prefilling into it and have not lent before, the one with the most
        prefill left that reuses there no more cached tokens than the borrower has (the borrower
        may drop them: at most what it prefills itself is lost; a shared first token or system
        prompt it may reuse) and has at least twice the borrower's tokens to prefill. Only where
        each slot has its own KV stream: its slot then fits any admissible request, so the lending
        is never in vain."""
        if not self.cache.per_slot:
            return None
        lenders = [r for r in self.running if r.status is RequestStatus.PREFILLING
                   and r.n_prefilled == r.cached_tokens and self._live[r.request_id].starved
                   and r.request_id not in self._lent and not self.cache.copying(self.slots[r.held_slot])]
        most_left = max((r.prefill_left for r in lenders), default=0)
        for queue in (self.prepared, self.waiting):
            for at, borrower in enumerate(queue):
                n = len(borrower.prefill_tokens)
                if 2 * n > most_left or self.sharing.waits(borrower, self.running):
                    continue
                lender = max((r for r in lenders if r.cached_tokens <= n and r.prefill_left >= 2 * n),
                             key=lambda r: r.prefill_left, default=None)
                if lender is not None:
                    return queue, at, lender
        return None

    def _requeue(self, request: Request) -> None:
        """Back to its queue from a slot it has not prefilled into, behind the queued requests with
        shorter prompts; its slot is released as an idle prefix cache."""
        self._vacate(request, forget_kv=False)
        self._lent.add(request.request_id)
        request.status, request.slot, request.timings.admitted = RequestStatus.WAITING, None, None
        request.n_prefilled = request.cached_tokens = 0
        queue = self.prepared if request.timings.resumed is not None else self.waiting
        at = next((k for k, r in enumerate(queue) if len(r.prefill_tokens) >= len(request.prefill_tokens)), len(queue))
        queue.insert(at, request)

    def _start(self, request: Request) -> None:
        request.status = RequestStatus.PREFILLING
        request.timings.admitted = self.clock()
        self.running.append(request)
        self._live[request.request_id] = _Live(TextStream(request.params.stop))
        try:
            self.kv.start_request(request.held_slot, request)
        except ValueError as error:  # the client's (a grammar that does not parse)
            self.finish(request, RequestStatus.FINISHED_REJECTED, ErrorEvent(ErrorKind.INVALID, str(error)))
        except Exception as error:
            self.fail(request, error, "starting")

    # ---- stepping --------------------------------------------------------------------------
    def schedule(self) -> Step:
        """Admit what fits, then the step the policy composes (step_policy.py) from the running requests."""
        self.admit()
        plan = self.policy.plan(self._seats())
        items = [BatchItem(r, [r.output_tokens[-1]], len(self.slots[r.held_slot].tokens), True) for r in plan.decode]
        for request, n in plan.chunks:
            start, at = request.n_prefilled, len(self.slots[request.held_slot].tokens)
            items.append(BatchItem(request, request.prefill_tokens[start : start + n], at, n == request.prefill_left))
        for request in plan.left_out:
            self._live[request.request_id].starved += 1
        # in slot order: llama.cpp puts a run of consecutive sequences in one ubatch when each slot
        # has a KV stream of its own, and any order serves a unified one
        return Step(sorted(items, key=lambda item: item.request.held_slot))

    def _seats(self) -> list[Seat[Request]]:
        """The running requests as the step policy sees them."""
        return [Seat(r, r.status is RequestStatus.DECODING, r.prefill_left, self._live[r.request_id].starved,
                     r.timings.first_token is None) for r in self.running]

    def flags(self) -> Flags:
        """What background work is told now, from the requests the steps serve (step_policy.flags)."""
        return flags(self._seats())

    def preemptible(self, step: Step) -> bool:
        """A step worth aborting for a newcomer (StepPolicy.preemptible)."""
        return self.policy.preemptible([len(item.tokens) for item in step.items])

    def rollback(self, step: Step) -> None:
        """A decode was aborted: drop whatever it wrote past each slot's known tokens (earlier
        ubatches of a multi-ubatch step may have landed) so the step can be redone."""
        self.cache.decoded()
        for item in step.items:
            self.cache.trim(self.slots[item.request.held_slot])

    def update(self, step: Step, outputs: dict[int, TokenOutput | Exception], release: bool = True) -> None:
        """Apply a successful decode: extend the slots, take the sampled tokens, finish some.
        `outputs` holds an exception for a request whose sampling failed: that request fails.
        `release`: their text too (`release_text`); else the caller releases it later."""
        self.cache.decoded()
        now = self.clock()
        for item in step.items:
            request = item.request
            if not request.status.running:
                # finished while the step ran: drop what the step wrote past the slot's tokens
                slot = self.slots[request.held_slot]
                if slot.request is None:
                    self.cache.trim(slot)
                continue
            try:
                self._apply(item, outputs.get(request.request_id), now)
            except Exception as error:
                self.fail(request, error, "taking its token")
        if release:
            self.release_text()

    def _apply(self, item: BatchItem, out: TokenOutput | Exception | None, now: float) -> None:
        request = item.request
        self.slots[request.held_slot].tokens.extend(item.tokens)
        if request.status is RequestStatus.PREFILLING:
            request.n_prefilled += len(item.tokens)
            if not request.prefill_left:
                request.status = RequestStatus.DECODING
                request.timings.prefill_done = now
        if not item.wants_logits:
            return
        if isinstance(out, RequestRefused):  # the client's (a grammar too costly to go on)
            self.finish(request, RequestStatus.FINISHED_REJECTED, ErrorEvent(ErrorKind.INVALID, str(out)))
            return
        if isinstance(out, Exception):
            self.fail(request, out, "sampling")
            return
        assert out is not None, f"no sampled token for request {request.request_id}"
        self._take_token(request, out, now)

    def _take_token(self, request: Request, out: TokenOutput, now: float) -> None:
        """Take the token; its text waits for `release_text` (a stop string in it ends the request
        then), unless the request ends here (end of generation, max_tokens)."""
        if request.timings.first_token is None:
            request.timings.first_token = now
        request.timings.last_token = now
        if self.is_eog(out.token):
            self.finish(request, RequestStatus.FINISHED_STOP)
            return
        request.output_tokens.append(out.token)
        live = self._live[request.request_id]
        live.unread.append(out)
        if len(request.output_tokens) >= request.params.max_tokens:
            stopped = self._release(request, live)
            self.finish(request, RequestStatus.FINISHED_STOP if stopped else RequestStatus.FINISHED_LENGTH)

    def release_text(self) -> None:
        """The text of the tokens taken since the last call, as events; a request whose text
        reaches a stop string finishes. The engine calls it while the next step's decode runs on a
        GPU (a step after the stop then has a row for the finished request: `update` drops what it
        wrote), right after `update` otherwise."""
        for request in [r for r in self.running if self._live[r.request_id].unread]:
            try:
                if self._release(request, self._live[request.request_id]):
                    self.finish(request, RequestStatus.FINISHED_STOP)
            except Exception as error:
                self.fail(request, error, "releasing its text")

    def _release(self, request: Request, live: _Live) -> bool:
        """Push the request's unread tokens through its text stream; True once a stop string hit."""
        for out in live.unread:
            live.pending.append(out)
            text = live.stream.push(self.piece(out.token))
            if text:
                self._emit(request, TextEvent(text, live.pending[:]))
                live.pending.clear()
            if live.stream.stopped:
                break
        live.unread.clear()
        return live.stream.stopped

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
            self._release(request, self._live[request.request_id])
        self._lent.discard(request.request_id)
        request.status = status
        request.timings.finished = self.clock()
        stop = None
        if prior is RequestStatus.WAITING:
            for queue in (self.waiting, self.prepared):
                if request in queue:
                    queue.remove(request)
        elif prior is RequestStatus.COMPRESSING:
            self.compressing.remove(request)
            assert request.compression is not None
            if not any(other.compression is request.compression for other in self.compressing):
                request.compression.cancelled.set()  # no sample waits for it: the worker drops it at its next chunk
        else:
            live = self._vacate(request, forget_kv)
            stop = live.stream.stop_hit if status is RequestStatus.FINISHED_STOP else None
            if error is None and not live.stream.stopped:
                tail = live.stream.flush()
                if tail:
                    self._emit(request, TextEvent(tail, live.pending))
        self._emit(request, error or FinishEvent(status.value, request.usage(), stop))

    def _vacate(self, request: Request, forget_kv: bool) -> _Live:
        """Take a running request off its slot (finished, or back to its queue): its sampler is
        freed, whatever becomes of the slot's KV (a prefix cache unless `forget_kv`)."""
        self.running.remove(request)
        self.kv.end_request(request.held_slot)
        self.cache.release(self.slots[request.held_slot], forget_kv)
        return self._live.pop(request.request_id)

    def fail(self, request: Request, error: BaseException, what: str) -> None:
        """An exception tied to one request fails that request alone (FAILED, naming it)."""
        log.error("request %s: %s failed", request.request_id, what, exc_info=error)
        message = f"request {request.request_id}: {what} failed: {type(error).__name__}: {error}"
        self.finish(request, RequestStatus.FINISHED_ERROR, ErrorEvent(ErrorKind.FAILED, message))

    # ---- output ------------------------------------------------------------------------------
    def _emit(self, request: Request, event: Event) -> None:
        self._outbox.append((request, event))

    def emit(self) -> None:
        """Deliver the queued events: the one place that calls sinks, then each distinct `flush`
        of the requests that got one, once. A sink or flush that raises (its client's event loop
        is gone) fails its requests alone, which then get nothing more."""
        flushes: dict[Callable[[], None], list[Request]] = {}
        while self._outbox:
            request, event = self._outbox.popleft()
            try:
                request.sink(event)
            except Exception as error:
                self._cut_off(request, error)
                continue
            if request.flush is not None:
                flushes.setdefault(request.flush, []).append(request)
        for flush, requests in flushes.items():
            try:
                flush()
            except Exception as error:
                for request in dict.fromkeys(requests):
                    self._cut_off(request, error)

    def _cut_off(self, request: Request, error: Exception) -> None:
        request.sink, request.flush = discard, None
        if not request.status.finished:
            self.fail(request, error, "delivering its output")

    # ---- reporting -------------------------------------------------------------------------
    @property
    def has_output(self) -> bool:
        """Events wait for `emit`."""
        return bool(self._outbox)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.prepared)  # compressing ones come back via resume

    @property
    def live(self) -> list[Request]:
        """Every request not finished: running, queued, compressing."""
        return [*self.running, *self.prepared, *self.waiting, *self.compressing]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            slots=tuple(
                SlotStats(s.index,
                          "idle" if s.request is None
                          else "prefill" if s.request.status is RequestStatus.PREFILLING else "decode",
                          s.request.request_id if s.request else None, len(s.tokens), len(s.pages))
                for s in self.slots
            ),
            running=len(self.running),
            waiting=len(self.waiting) + len(self.prepared),
            compressing=tuple(
                CompressingStats(r.request_id, len(r.prompt_tokens), r.compression.progress if r.compression else 0)
                for r in self.compressing
            ),
            waiting_prepared=len(self.prepared),
            cache=self.cache.stats(),
        )
