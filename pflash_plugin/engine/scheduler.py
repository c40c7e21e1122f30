"""Continuous batching over slots that share one paged KV pool.

Pure Python: the scheduler decides, a runner executes. Each step decodes one token for every
generating slot and fills the rest of the token budget with prefill chunks, so a long prefill
never stalls decoding. Idle slots keep their KV as a prefix cache; a new request reuses the
longest cached prefix of any slot (in place, or shared through `seq_cp`), and idle caches are
evicted least recently used when pages are needed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from .kv_pool import PagePool
from .request import (
    ErrorEvent,
    FinishEvent,
    Request,
    RequestState,
    TextEvent,
    TokenOutput,
)
from .text_stream import TextStream


class KVOps(Protocol):
    """The KV operations the scheduler asks of the runner (llama_memory_* on a real context)."""

    def seq_rm(self, slot: int, start: int) -> None: ...
    def seq_cp(self, src: int, dst: int, n_tokens: int) -> None: ...
    def start_request(self, slot: int, request: Request) -> None: ...
    def end_request(self, slot: int) -> None: ...


class AdmissionError(Exception):
    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # what its KV sequence holds
    pages: list[int] = field(default_factory=list)
    request: Request | None = None
    last_used: float = 0.0


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


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(
        self,
        kv: KVOps,
        pool: PagePool,
        n_slots: int,
        max_batch_tokens: int,
        max_ctx: int,
        max_queue: int,
        piece: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        clock: Callable[[], float] = time.perf_counter,
        handoff: Callable[[Request], None] | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        """`prefill_chunk`: while other requests are active, a prompt prefills at most this many
        tokens per step, so steps stay short and the others keep their latency."""
        self.kv, self.pool = kv, pool
        self.slots = [Slot(i) for i in range(n_slots)]
        self.max_batch_tokens = max_batch_tokens
        self.max_ctx, self.max_queue = max_ctx, max_queue
        self.prefill_chunk = prefill_chunk
        self.piece, self.is_eog, self.clock = piece, is_eog, clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.compressing: list[Request] = []
        self.handoff = handoff  # gives a request to the compression thread
        self._streams: dict[int, TextStream] = {}
        self._pending_tokens: dict[int, list[TokenOutput]] = {}

    # ---- admission -------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Reject what can never be served, before it queues (HTTP 400 / 429)."""
        n_prompt = len(request.prompt_tokens)
        if n_prompt == 0:
            raise AdmissionError(400, "the prompt is empty", "invalid_request_error")
        if n_prompt + request.params.max_tokens > self.max_ctx:
            raise AdmissionError(
                400,
                f"prompt ({n_prompt} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{n_prompt + request.params.max_tokens} exceeds the context limit max_ctx "
                f"({self.max_ctx} tokens)",
                "context_length_exceeded",
            )
        if self.pool.pages_for(request.reserve_tokens) > self.pool.n_pages:
            raise AdmissionError(
                400,
                f"the request needs {request.reserve_tokens} KV tokens, the pool holds "
                f"{self.pool.n_pages * self.pool.page_size}",
                "context_length_exceeded",
            )
        if len(self.waiting) + len(self.compressing) >= self.max_queue:
            raise AdmissionError(429, "the request queue is full, retry later", "rate_limit_exceeded")

    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        if request.prepared:
            # behind other prepared (compressed) requests, ahead of new arrivals
            index = 0
            while index < len(self.waiting) and self.waiting[index].prepared:
                index += 1
            self.waiting.insert(index, request)
        else:
            self.waiting.append(request)

    def _hand_off(self) -> None:
        """Send waiting requests that asked for compression to the compression thread, unless
        the prefix cache already holds most of the prompt (measured here: the worker never
        reads the cache)."""
        for request in [r for r in self.waiting if r.compression is not None]:
            _, reuse = self.best_prefix(request.prompt_tokens)
            if self.handoff is None or reuse * 2 >= len(request.prompt_tokens):
                reason = f"{reuse} prompt tokens are cached" if self.handoff else "no compressor"
                request.pflash = {"status": "skipped", "reason": reason, "original_tokens": len(request.prompt_tokens)}
                request.compression = None
                continue
            self.waiting.remove(request)
            request.state = RequestState.COMPRESSING
            self.compressing.append(request)
            self.handoff(request)

    def resume(self, request: Request, tokens: list[int], report: dict) -> None:
        """A compression came back: queue the (maybe compressed) prompt ahead of new arrivals."""
        if request.state is not RequestState.COMPRESSING:
            return  # cancelled meanwhile
        self.compressing.remove(request)
        request.compression = None
        request.prefill_tokens = list(tokens)
        request.pflash = report
        request.prepared = True
        self.add(request)

    def _admit(self) -> None:
        while self.waiting:
            request = self.waiting[0]
            if not self._try_place(request):
                if request.state is RequestState.FINISHED:
                    continue  # refused (bad parameters): the next one may fit
                return
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            request.timings.admitted = self.clock()
            self.running.append(request)
            self._streams[request.request_id] = TextStream(request.params.stop)
            self._pending_tokens[request.request_id] = []

    def best_prefix(self, tokens: list[int]) -> tuple[Slot | None, int]:
        """The slot holding the longest prefix of `tokens` (at most len - 1: one token must run)."""
        best, best_len = None, 0
        for slot in self.slots:
            n = min(common_prefix(slot.tokens, tokens), len(tokens) - 1)
            if n > best_len:
                best, best_len = slot, n
        return best, best_len

    def _try_place(self, request: Request) -> bool:
        idle = [s for s in self.slots if s.request is None]
        if not idle:
            return False
        tokens = request.prefill_tokens

        def usable(slot: Slot) -> int:
            return min(common_prefix(slot.tokens, tokens), len(tokens) - 1)

        src, reuse = self.best_prefix(tokens)
        # in place: the idle slot with the longest prefix; on a tie an empty one (no cache lost)
        in_place = max(idle, key=lambda s: (usable(s), not s.tokens, -s.last_used))
        if src is None or reuse <= usable(in_place) or src is in_place:
            dst, src, reuse = in_place, None, usable(in_place)
        else:  # copy the prefix from another slot into an empty or least recently used idle one
            dst = min(idle, key=lambda s: (bool(s.tokens), s.last_used))
        needed = self.pool.pages_for(request.reserve_tokens)
        victims = sorted((s for s in idle if s is not dst and s is not src and s.pages), key=lambda s: s.last_used)
        while True:
            kept = self._reused_pages(dst, src, reuse)
            if needed - kept <= self.pool.free_pages + self._droppable(dst, kept if src is None else 0):
                return self._bind(request, dst, src, reuse, needed)
            if not victims:
                return False
            self._evict(victims.pop(0))

    def _reused_pages(self, dst: Slot, src: Slot | None, reuse: int) -> int:
        """Pages `dst` keeps (in place) or shares (from `src`) for a prefix of `reuse` tokens.

        Only whole pages are shared; in place, a partial last page is kept unless another slot
        shares it (then its new tokens get new cells: copy-on-write)."""
        if src is not None:
            return reuse // self.pool.page_size
        keep = self.pool.pages_for(reuse)
        if reuse % self.pool.page_size and self.pool.shared(dst.pages[keep - 1]):
            keep -= 1
        return keep

    def _droppable(self, slot: Slot, keep_pages: int) -> int:
        """Pages of `slot` past its first `keep_pages` that would become free when released."""
        return sum(1 for p in slot.pages[keep_pages:] if not self.pool.shared(p))

    def _evict(self, slot: Slot) -> None:
        self.kv.seq_rm(slot.index, 0)
        self.pool.release(slot.pages)
        slot.pages, slot.tokens = [], []

    def _bind(self, request: Request, dst: Slot, src: Slot | None, reuse: int, needed: int) -> bool:
        """Give `dst` to the request with `reuse` tokens of prefix in place; False if it was refused."""
        kept = self._reused_pages(dst, src, reuse)
        if src is None:
            self.pool.release(dst.pages[kept:])
            dst.pages = dst.pages[:kept]
            self.kv.seq_rm(dst.index, reuse)
        else:
            self.kv.seq_rm(dst.index, 0)
            self.pool.release(dst.pages)
            dst.pages = self.pool.share(src.pages[:kept])
            self.kv.seq_cp(src.index, dst.index, reuse)
        dst.pages += self.pool.allocate(needed - len(dst.pages))
        dst.tokens = list(request.prefill_tokens[:reuse])
        dst.request = request
        request.slot = dst.index
        request.cached_tokens = request.n_prefilled = reuse
        try:
            self.kv.start_request(dst.index, request)
        except Exception as error:
            dst.request = None
            self._release_slot(dst)
            if not isinstance(error, ValueError):
                raise
            # a ValueError is the client's (a grammar that does not parse): refuse this one only
            self.waiting.remove(request)
            request.sink(ErrorEvent(400, str(error), "invalid_request_error"))
            request.state = RequestState.FINISHED
            request.finish_reason = "error"
            return False
        return True

    # ---- stepping --------------------------------------------------------------------------
    def schedule(self) -> Step:
        self._hand_off()
        self._admit()
        budget = self.max_batch_tokens
        items: list[BatchItem] = []
        for request in self.running:
            if not request.prefilling and budget > 0:
                slot = self.slots[request.slot]
                items.append(BatchItem(request, [request.output_tokens[-1]], len(slot.tokens), True))
                budget -= 1
        # shortest remaining prefill first: a short prompt beside a long one starts at once
        prefilling = sorted(
            (r for r in self.running if r.prefilling), key=lambda r: len(r.prefill_tokens) - r.n_prefilled
        )
        busy = len(self.running) > 1
        cap = self.prefill_chunk if busy and self.prefill_chunk else budget
        finishing = [r for r in prefilling if len(r.prefill_tokens) - r.n_prefilled <= min(cap, budget)]
        if finishing:
            prefilling = finishing  # their first tokens come first: a long chunk would delay them
        for request in prefilling:
            if budget > 0:
                start = request.n_prefilled
                n = min(budget, cap, len(request.prefill_tokens) - start)
                chunk = request.prefill_tokens[start : start + n]
                done = start + n == len(request.prefill_tokens)
                items.append(BatchItem(request, chunk, len(self.slots[request.slot].tokens), done))
                budget -= n
        return Step(items)

    def preemptible(self, step: Step) -> bool:
        """A step worth aborting for a newcomer: one prompt prefilling alone in a chunk bigger
        than a newcomer would have to wait for (with others active it would be capped)."""
        return self.prefill_chunk is not None and len(step.items) == 1 and len(step.items[0].tokens) > self.prefill_chunk

    def rollback(self, step: Step) -> None:
        """A decode was aborted: drop whatever it wrote past each slot's known tokens (earlier
        ubatches of a multi-ubatch step may have landed) so the step can be redone."""
        for item in step.items:
            slot = self.slots[item.request.slot]
            self.kv.seq_rm(slot.index, len(slot.tokens))

    def update(self, step: Step, outputs: dict[int, TokenOutput]) -> None:
        """Apply a successful decode: extend the slots, take the sampled tokens, finish some."""
        now = self.clock()
        for item in step.items:
            request = item.request
            if request.state is not RequestState.RUNNING:
                # finished while the step ran: drop what the step wrote past the slot's tokens
                slot = self.slots[request.slot]
                if slot.request is None:
                    self.kv.seq_rm(slot.index, len(slot.tokens))
                continue
            self.slots[request.slot].tokens.extend(item.tokens)
            if request.prefilling:
                request.n_prefilled += len(item.tokens)
                if not request.prefilling:
                    request.timings.prefill_done = now
            if item.wants_logits:
                self._take_token(request, outputs[request.request_id], now)

    def _take_token(self, request: Request, out: TokenOutput, now: float) -> None:
        if request.timings.first_token is None:
            request.timings.first_token = now
        request.timings.last_token = now
        if self.is_eog(out.token):
            self.finish(request, "stop")
            return
        request.output_tokens.append(out.token)
        stream = self._streams[request.request_id]
        pending = self._pending_tokens[request.request_id]
        pending.append(out)
        text = stream.push(self.piece(out.token))
        if text or stream.stopped:
            if text:
                request.sink(TextEvent(text, pending[:]))
                pending.clear()
        if stream.stopped:
            self.finish(request, "stop")
        elif len(request.output_tokens) >= request.params.max_tokens:
            self.finish(request, "length")

    def finish(self, request: Request, reason: str) -> None:
        """End a request for any reason; its slot keeps the KV as a prefix cache."""
        if request.state is RequestState.FINISHED:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.compressing:
            self.compressing.remove(request)
            request.compression.cancelled.set()  # the worker drops it at its next chunk
        state = request.state
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.timings.finished = self.clock()
        if state is RequestState.RUNNING:
            self.running.remove(request)
            stream = self._streams.pop(request.request_id)
            pending = self._pending_tokens.pop(request.request_id)
            if reason != "stop" or not stream.stopped:
                tail = stream.flush()
                if tail and reason != "error":
                    request.sink(TextEvent(tail, pending))
            self._release_slot(self.slots[request.slot])
        if reason != "error":
            request.sink(FinishEvent(reason, request.usage()))

    def fail(self, request: Request, status: int, message: str) -> None:
        request.sink(ErrorEvent(status, message))
        self.finish(request, "error")

    def drop_kv(self, request: Request) -> None:
        """Forget a slot's KV after a decode error left it in an unknown state."""
        if request.slot is not None:
            slot = self.slots[request.slot]
            if slot.request is None:
                self._evict(slot)

    def _release_slot(self, slot: Slot) -> None:
        self.kv.end_request(slot.index)
        slot.request = None
        slot.last_used = self.clock()
        keep = self.pool.pages_for(len(slot.tokens))
        self.pool.release(slot.pages[keep:])
        slot.pages = slot.pages[:keep]

    def evict_idle(self) -> int:
        """Free every idle cache (after llama.cpp reported no free cells despite our accounting)."""
        idle = [s for s in self.slots if s.request is None and s.pages]
        for slot in idle:
            self._evict(slot)
        return len(idle)

    # ---- reporting -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)  # compressing requests come back via resume

    def status(self) -> dict:
        cached = sum(len(s.tokens) for s in self.slots if s.request is None)
        return {
            "slots": [
                {
                    "id": s.index,
                    "state": "idle" if s.request is None else "prefill" if s.request.prefilling else "decode",
                    "request_id": s.request.request_id if s.request else None,
                    "kv_tokens": len(s.tokens),
                    "kv_pages": len(s.pages),
                }
                for s in self.slots
            ],
            "running": len(self.running),
            "waiting": len(self.waiting),
            "compressing": [
                {
                    "request_id": r.request_id,
                    "prompt_tokens": len(r.prompt_tokens),
                    "drafted_tokens": r.compression.progress,
                }
                for r in self.compressing
            ],
            "waiting_prepared": sum(1 for r in self.waiting if r.prepared),
            "kv_pages_used": self.pool.used_pages,
            "kv_pages_total": self.pool.n_pages,
            "kv_page_size": self.pool.page_size,
            "prefix_cache_tokens": cached,
        }
