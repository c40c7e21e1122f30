"""A model-free runner that simulates llama.cpp's KV cache faithfully enough to check the
scheduler's accounting, unified or with one stream per slot (`kv_unified = false`).

The KV is a fixed array of `n_ctx` cells, split into `n_streams` equal streams (stream k holds
sequence k when there are several); a used cell has a position, the token written there and the
set of sequence ids (slots) that see it, exactly like llama.cpp's `llama_kv_cells`:

* `seq_cp(src, dst, n)` in one stream adds `dst` to every cell of `src` with pos < n (no new cell
  is used); across streams it copies src's whole stream over dst's and removes positions >= n
  (what the runner does, since llama.cpp copies only whole streams),
* `seq_rm(slot, start)` removes `slot` from its cells with pos >= start and frees cells left
  with no sequence,
* `execute(step)` writes each item's tokens at positions start_pos.. into free cells of the item's
  stream, raising `DecodeError(1)` before writing anything when a stream has too few free cells.

Every step is recorded, and `check_scheduler` verifies after every admission and step that the
scheduler's view (slot tokens, pages, refcounts) matches the simulated cells and that the page
accounting never undercounts the cells in use.
"""
from __future__ import annotations

import itertools
import json
import threading
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from pflash_plugin.engine.engine import Engine
from pflash_plugin.engine.host_cache import HostCache
from pflash_plugin.engine.kv_pool import PagePool
from pflash_plugin.engine.request import (
    ErrorEvent,
    Event,
    FinishEvent,
    Request,
    SamplingParams,
    TextEvent,
    TokenOutput,
)
from pflash_plugin.engine.prefix_cache import PrefixCache
from pflash_plugin.engine.scheduler import Scheduler, SchedulerConfig, Step
from pflash_plugin.llama import DecodeError
from pflash_plugin.pflash.report import PflashReport

VOCAB = 1000
EOG = VOCAB  # never produced by the default rule (which works modulo VOCAB)


def default_piece(token: int) -> bytes:
    if token == EOG:
        return b"<EOS>"
    return f"<{token}>".encode()


def is_eog(token: int) -> bool:
    return token == EOG


@dataclass
class Cell:
    pos: int
    token: int | None  # None: a stream copy llama.cpp has not made yet
    seqs: set[int]


@dataclass(frozen=True)
class ItemRecord:
    request_id: int
    slot: int
    tokens: tuple[int, ...]
    start_pos: int
    wants_logits: bool


@dataclass
class StepRecord:
    index: int  # 1-based count of execute calls (failed ones included)
    items: list[ItemRecord]
    ok: bool = False
    error: BaseException | None = None

    def for_request(self, request_id: int) -> ItemRecord | None:
        return next((i for i in self.items if i.request_id == request_id), None)


class MockRunner:
    """SlotRunner (KVOps, start_request, end_request) + launch/collect (execute(step) does the work), with a
    simulated KV and recorded operations."""

    def __init__(
        self,
        n_ctx: int,
        pool: PagePool | PrefixCache | None = None,
        scheduler: Scheduler | None = None,
        check_every_step: bool = True,
        n_streams: int = 1,
    ) -> None:
        self.n_ctx = n_ctx
        self.cells: list[Cell | None] = [None] * n_ctx
        self.data: list[int | None] = [None] * n_ctx  # what each cell's K/V holds: kept when the cell is freed
        self.pending_copies: list[tuple[int, int]] = []  # (from, to) cell indices, copied at the next execute
        self.n_streams, self.stream_size = n_streams, n_ctx // n_streams
        self.pool = pool  # whose used pages must cover the cells in use
        self.scheduler = scheduler
        self.check_every_step = check_every_step
        self.scripts: dict[int, list[int]] = {}  # request_id -> tokens to sample, in order
        self.bad_grammar = "bad"  # start_request raises ValueError for this grammar
        self.start_error: Callable[[Request], BaseException | None] | None = None
        self.sample_error: Callable[[Request], Exception | None] | None = None  # returned in its place
        self.fail_steps: dict[int, tuple[BaseException, bool]] = {}  # index -> (error, write first)
        self.hook: Callable[[int, Step], None] | None = None  # runs at the start of execute
        self.steps: list[StepRecord] = []
        self.ops: list[tuple] = []  # ("seq_rm", slot, start), ("seq_cp", src, dst, n), ...
        self.active: dict[int, Request] = {}  # slot -> request between start/end_request
        self.started: list[int] = []  # request ids passed to start_request, in order
        self.max_cells_used = 0
        self.require_active = True  # items must belong to a request between start/end_request
        self.overlaps = False  # the engine releases text between launch and collect (a GPU's order)
        self.n_ubatch: int | None = None  # overlapping, a step of more tokens launches as one that waits (a GPU's)
        self._outputs: dict[int, TokenOutput | Exception] = {}
        # slot -> the lowest KV position llama.cpp still holds for it where a test says so: a
        # window-sized SWA cache overwrites cells n_swa behind a sequence's end (first_cell)
        self.window_first: dict[int, int] = {}

    # ---- simulated KV ----------------------------------------------------------------------
    @property
    def cells_used(self) -> int:
        return sum(1 for c in self.cells if c is not None)

    @property
    def free_cells(self) -> int:
        return self.n_ctx - self.cells_used

    def stream_range(self, seq: int) -> range:
        """The cell indices of `seq`'s stream."""
        k = seq if self.n_streams > 1 else 0
        return range(k * self.stream_size, (k + 1) * self.stream_size)

    def seq_cells(self, seq: int) -> list[Cell]:
        return sorted((c for c in self.cells if c is not None and seq in c.seqs), key=lambda c: c.pos)

    def seq_tokens(self, seq: int) -> list[int]:
        return [c.token for c in self.seq_cells(seq)]

    def first_cell(self, seq: int) -> int:
        """llama_memory_seq_pos_min: -1 for an empty sequence."""
        cells = self.seq_cells(seq)
        return max(cells[0].pos, self.window_first.get(seq, 0)) if cells else -1

    def seq_pos_max(self, seq: int) -> int:
        return max((c.pos for c in self.cells if c is not None and seq in c.seqs), default=-1)

    def _check_seq_contiguous(self, seq: int) -> None:
        positions = [c.pos for c in self.seq_cells(seq)]
        assert positions == list(range(len(positions))), f"seq {seq} positions not 0..n-1: {positions}"

    # ---- KVOps -----------------------------------------------------------------------------
    def seq_rm(self, slot: int, start: int) -> None:
        self.ops.append(("seq_rm", slot, start))
        self._remove(slot, start)

    def _remove(self, slot: int, start: int) -> None:
        for i, cell in enumerate(self.cells):
            if cell is not None and slot in cell.seqs and cell.pos >= start:
                cell.seqs.discard(slot)
                if not cell.seqs:
                    self.cells[i] = None

    def seq_cp(self, src: int, dst: int, n_tokens: int) -> None:
        self.ops.append(("seq_cp", src, dst, n_tokens))
        assert src != dst
        if self.n_streams > 1:  # a whole-stream copy, then the tail removed
            # llama.cpp copies the cells' positions now and their data at the next decode: until
            # then the copied cells hold no known token (None), and the data comes from wherever
            # src's buffer is then
            for i, j in zip(self.stream_range(src), self.stream_range(dst)):
                cell = self.cells[i]
                self.cells[j] = Cell(cell.pos, None, {dst}) if cell is not None and src in cell.seqs else None
                self.pending_copies.append((i, j))
            self._remove(dst, n_tokens)
            return
        dst_positions = {c.pos for c in self.cells if c is not None and dst in c.seqs}
        for cell in self.cells:
            if cell is not None and src in cell.seqs and cell.pos < n_tokens:
                assert cell.pos not in dst_positions, f"seq_cp would give seq {dst} two cells at pos {cell.pos}"
                cell.seqs.add(dst)

    def save(self, slot: int, max_bytes: int) -> bytes | None:
        """The slot's cells, serialized (llama_state_seq_get_data); None when over `max_bytes`."""
        self.ops.append(("save", slot))
        data = json.dumps([[c.pos, c.token] for c in self.seq_cells(slot)]).encode()
        return data if len(data) <= max_bytes else None

    def restore(self, slot: int, data: bytes, n_tokens: int) -> None:
        """Write every saved cell into `slot`'s stream (llama.cpp fails with too few free cells),
        then drop those at positions >= n_tokens, as the runner does."""
        self.ops.append(("restore", slot, n_tokens))
        assert not self.seq_cells(slot), f"restore into slot {slot}, which is not empty"
        cells = json.loads(data)
        assert self._free_in(slot) >= len(cells), f"restoring {len(cells)} cells, {self._free_in(slot)} free"
        free = (i for i in self.stream_range(slot) if self.cells[i] is None)
        for pos, token in cells:
            index = next(free)
            self.cells[index], self.data[index] = Cell(pos, token, {slot}), token  # written at once
        self._remove(slot, n_tokens)

    def _copy_pending(self) -> None:
        """The stream copies llama.cpp makes at the start of a decode."""
        for i, j in self.pending_copies:
            self.data[j] = self.data[i]
            if self.cells[j] is not None:
                self.cells[j].token = self.data[i]
        self.pending_copies.clear()

    def start_request(self, slot: int, request: Request) -> None:
        self.ops.append(("start", slot, request.request_id))
        assert slot not in self.active, f"start_request on slot {slot} that is still active"
        # the slot's KV must hold exactly the reused prefix of the request
        assert request.slot == slot
        known = [t if t is not None else e for t, e in zip(self.seq_tokens(slot), request.prefill_tokens)]  # copies due
        assert known == request.prefill_tokens[: request.cached_tokens], (
            f"slot {slot} KV {self.seq_tokens(slot)} is not the reused prefix "
            f"{request.prefill_tokens[: request.cached_tokens]}"
        )
        self._check_seq_contiguous(slot)
        if self.start_error is not None:
            error = self.start_error(request)
            if error is not None:
                raise error
        if request.params.grammar == self.bad_grammar:
            raise ValueError("the grammar could not be parsed")
        self.active[slot] = request
        self.started.append(request.request_id)

    def end_request(self, slot: int) -> None:
        self.ops.append(("end", slot))
        self.active.pop(slot, None)  # tolerated after a start_request that raised, like LlamaRunner

    def arm_abort(self, armed: bool) -> None:
        self.armed = armed

    def set_abort(self, should_abort: Callable[[], bool]) -> None:
        """llama.cpp's abort callback: the mock never polls it (tests that do replace this)."""

    def kv_tokens(self, slot: int) -> int:
        return self.seq_pos_max(slot) + 1

    def close(self) -> None:
        pass

    # ---- stepping --------------------------------------------------------------------------
    def returns_early(self, step: Step) -> bool:
        return self.overlaps and (self.n_ubatch is None or step.n_tokens <= self.n_ubatch)

    def launch(self, step: Step) -> None:
        """The engine's half of a step: the whole decode runs here (as on the CPU); with `overlaps`
        set, the engine does its overlapped host work before `collect`, as on a GPU."""
        self._outputs = self.execute(step)

    def collect(self, step: Step) -> dict[int, TokenOutput | Exception]:
        return self._outputs

    def execute(self, step: Step) -> dict[int, TokenOutput | Exception]:
        index = len(self.steps) + 1
        record = StepRecord(
            index,
            [
                ItemRecord(i.request.request_id, i.request.slot, tuple(i.tokens), i.start_pos, i.wants_logits)
                for i in step.items
            ],
        )
        self.steps.append(record)
        self._copy_pending()
        if self.scheduler is not None and self.check_every_step:
            check_scheduler(self.scheduler, self)  # admission (seq_rm / seq_cp) kept everything right
        if self.hook is not None:
            self.hook(index, step)
        seen: set[int] = set()
        for item in step.items:
            slot = item.request.slot
            assert slot is not None, "item of a request with no slot"
            assert slot not in seen, f"slot {slot} twice in one step"
            seen.add(slot)
            if self.require_active:
                assert self.active.get(slot) is item.request, f"slot {slot} runs a request it was not started for"
            assert item.tokens, "empty batch item"
            assert item.start_pos == self.seq_pos_max(slot) + 1, (
                f"slot {slot}: item starts at {item.start_pos}, KV ends at {self.seq_pos_max(slot)}"
            )
        failure = self.fail_steps.pop(index, None)
        if failure is not None and not failure[1]:
            record.error = failure[0]
            raise failure[0]
        short = any(self._free_in(item.request.slot) < len(item.tokens) for item in step.items)
        if short or self.free_cells < step.n_tokens:
            record.error = DecodeError(1)
            raise record.error  # llama.cpp finds the slots of the whole batch before computing
        for item in step.items:
            self._write(item.request.slot, item.tokens, item.start_pos)
        self.max_cells_used = max(self.max_cells_used, self.cells_used)
        if self.pool is not None:
            assert self.cells_used <= self.pool.used_pages * self.pool.page_size, (
                f"page accounting undercounts: {self.cells_used} cells in use, "
                f"{self.pool.used_pages} pages of {self.pool.page_size}"
            )
        if self.scheduler is not None and self.check_every_step:
            check_pages_cover_cells(self.scheduler, self)
        if failure is not None:  # failed after writing part of the batch
            record.error = failure[0]
            raise failure[0]
        outputs: dict[int, TokenOutput | Exception] = {}
        for item in step.items:
            if item.wants_logits:
                error = self.sample_error(item.request) if self.sample_error else None
                outputs[item.request.request_id] = error or TokenOutput(self._sample(item))
        record.ok = True
        return outputs

    def _free_in(self, slot: int | None) -> int:
        assert slot is not None
        return sum(1 for i in self.stream_range(slot) if self.cells[i] is None)

    def _write(self, slot: int, tokens: list[int], start: int) -> None:
        free = (i for i in self.stream_range(slot) if self.cells[i] is None)
        for offset, token in enumerate(tokens):
            index = next(free)
            self.cells[index], self.data[index] = Cell(start + offset, token, {slot}), token

    def _sample(self, item) -> int:
        script = self.scripts.get(item.request.request_id)
        if script:
            return script.pop(0)
        return (item.tokens[-1] + 1) % VOCAB

    # ---- queries on the record ---------------------------------------------------------------
    def items_of(self, request_id: int, ok_only: bool = True) -> list[ItemRecord]:
        return [
            item
            for step in self.steps
            if step.ok or not ok_only
            for item in step.items
            if item.request_id == request_id
        ]

    def ops_of(self, kind: str) -> list[tuple]:
        return [op for op in self.ops if op[0] == kind]


# ---- invariants ------------------------------------------------------------------------------
def check_pages_cover_cells(sched: Scheduler, runner: MockRunner) -> None:
    """Every cell in use is covered by a page of every slot that sees it, and no page covers
    more than page_size distinct cells; hence cells in use <= used_pages * page_size."""
    cache = sched.cache
    page = cache.page_size
    cells_of_page: dict[tuple[int, int], set[int]] = defaultdict(set)
    for index, cell in enumerate(runner.cells):
        if cell is None:
            continue
        for seq in cell.seqs:
            slot = sched.slots[seq]
            k = cell.pos // page
            assert k < len(slot.pages), (
                f"slot {seq} has a cell at pos {cell.pos} but only {len(slot.pages)} pages"
            )
            assert index in runner.stream_range(seq), f"slot {seq} sees cell {index} outside its stream"
            cells_of_page[(id(slot.pool), slot.pages[k])].add(index)
    for p, cells in cells_of_page.items():
        assert len(cells) <= page, f"page {p} stands for {len(cells)} distinct cells (> {page})"
    assert runner.cells_used <= cache.used_pages * page, (
        f"page accounting undercounts: {runner.cells_used} cells, {cache.used_pages} pages of {page}"
    )


def check_scheduler(sched: Scheduler, runner: MockRunner) -> None:
    """The scheduler's bookkeeping matches the simulated KV, between steps."""
    cache = sched.cache
    holders: dict[tuple[int, int], int] = defaultdict(int)
    for slot in sched.slots:
        assert len(set(slot.pages)) == len(slot.pages), f"slot {slot.index} holds a page twice"
        for p in slot.pages:
            holders[(id(slot.pool), p)] += 1
        # the slot's KV sequence holds exactly slot.tokens at positions 0..n-1
        cells = runner.seq_cells(slot.index)
        assert [c.pos for c in cells] == list(range(len(cells))), (
            f"slot {slot.index} KV positions {[c.pos for c in cells]}"
        )
        assert [c.token for c in cells] == slot.tokens, (
            f"slot {slot.index}: KV holds {[c.token for c in cells]}, scheduler thinks {slot.tokens}"
        )
        if slot.request is None:
            assert len(slot.pages) == cache.pages_for(len(slot.tokens)), (
                f"idle slot {slot.index}: {len(slot.pages)} pages for {len(slot.tokens)} tokens"
            )
        else:
            request = slot.request
            assert request.slot == slot.index
            assert request in sched.running
            assert len(slot.pages) == cache.pages_for(request.reserve_tokens)
            assert len(slot.tokens) == request.n_prefilled + max(len(request.output_tokens) - 1, 0)
    assert cache.used_pages == len(holders), (
        f"pool says {cache.used_pages} pages used, slots hold {len(holders)}"
    )
    pools = {id(p): p for p in cache.pools}
    for (pool_id, p), n in holders.items():
        shared = pools[pool_id].shared(p)
        assert shared == (n > 1), f"page {p} held by {n} slots, shared={shared}"
    for request in sched.running:
        assert sched.slots[request.slot].request is request
    check_pages_cover_cells(sched, runner)


# ---- helpers for tests -----------------------------------------------------------------------
class Collector:
    """A request sink that records events and signals the end (thread safe)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)
        if isinstance(event, (FinishEvent, ErrorEvent)):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextEvent))

    @property
    def text_tokens(self) -> list[int]:
        return [t.token for e in self.events if isinstance(e, TextEvent) for t in e.tokens]

    @property
    def finish(self) -> FinishEvent | None:
        return next((e for e in self.events if isinstance(e, FinishEvent)), None)

    @property
    def errors(self) -> list[ErrorEvent]:
        return [e for e in self.events if isinstance(e, ErrorEvent)]

    @property
    def terminal(self) -> list[Event]:
        return [e for e in self.events if isinstance(e, (FinishEvent, ErrorEvent))]


def make_request(
    prompt: list[int],
    max_tokens: int = 4,
    stop: list[str] | None = None,
    grammar: str | None = None,
    prefill: list[int] | None = None,
) -> Request:
    sink = Collector()
    request = Request(
        list(prompt),
        SamplingParams(max_tokens=max_tokens, stop=list(stop or []), grammar=grammar),
        sink=sink,
        prefill_tokens=list(prefill) if prefill else [],
    )
    return request


def sink_of(request: Request) -> Collector:
    assert isinstance(request.sink, Collector)
    return request.sink


def make_scheduler(
    n_slots: int = 2,
    n_pages: int = 16,
    page_size: int = 4,
    max_batch_tokens: int = 8,
    max_ctx: int = 64,
    max_queue: int = 16,
    n_ctx: int | None = None,
    piece: Callable[[int], bytes] = default_piece,
    check_every_step: bool = True,
    per_slot: bool = False,
    host: HostCache | None = None,
    **scheduler_kw,
) -> tuple[Scheduler, MockRunner]:
    """A scheduler over a mock runner whose KV has exactly the pool's cells (unless n_ctx).
    `per_slot`: each slot has a KV stream (and a pool) of n_pages pages of its own."""
    n_streams = n_slots if per_slot else 1
    shared = PagePool(n_pages, page_size)
    pools = [PagePool(n_pages, page_size) if per_slot else shared for _ in range(n_slots)]
    n_cells = n_ctx if n_ctx is not None else n_pages * page_size * n_streams
    runner = MockRunner(n_cells, check_every_step=check_every_step, n_streams=n_streams)
    ticks = itertools.count(1)
    config = SchedulerConfig(n_slots=n_slots, max_batch_tokens=max_batch_tokens, max_ctx=max_ctx,
                             max_queue=max_queue, **scheduler_kw)
    sched = Scheduler(runner, pools, config, piece, is_eog, clock=lambda: float(next(ticks)), host=host)
    runner.scheduler, runner.pool = sched, sched.cache
    return sched, runner


def step_once(sched: Scheduler, runner: MockRunner) -> Step:
    """One engine round without the thread: schedule, execute, update, deliver the events."""
    step = sched.schedule()
    if step.items:
        outputs = runner.execute(step)
        sched.update(step, outputs)
        if runner.check_every_step:
            check_scheduler(sched, runner)
    sched.emit()
    return step


def run_until_idle(sched: Scheduler, runner: MockRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_work:
        step = step_once(sched, runner)
        assert step.items, f"stalled: {len(sched.running)} running, {len(sched.waiting)} waiting, no step"
        steps += 1
        assert steps < max_steps, "did not finish"
    return steps


def idle_pages(sched: Scheduler) -> int:
    """Pages the idle caches hold (shared pages counted once): the pool's figure when idle."""
    return len({(id(s.pool), p) for s in sched.slots if s.request is None for p in s.pages})


class FakeCompressor:
    """The engine's compression service, delivering only when the test says so."""

    def __init__(self) -> None:
        self.jobs: list[tuple[object, Callable]] = []
        self.neighbours: list[object] = []
        self.submitted = threading.Semaphore(0)

    def submit(self, job, neighbours, deliver) -> None:
        self.jobs.append((job, deliver))
        self.neighbours.append(neighbours)
        self.submitted.release()

    def deliver(self, index: int, tokens: list[int], report: PflashReport | None = None) -> None:
        job, deliver = self.jobs[index]
        report = report or PflashReport("compressed", len(job.tokens), kept_tokens=len(tokens))
        deliver(SimpleNamespace(tokens=tokens, report=report))


def compressed_request(prompt: list[int], max_tokens: int = 3) -> Request:
    """A request that asks for compression (its job: a cancel flag, a progress counter, the report
    of a skip)."""
    request = make_request(prompt, max_tokens=max_tokens)

    def skipped(reason: str, cause: str) -> PflashReport:
        return PflashReport.skipped(len(prompt), reason, cause)

    request.compression = SimpleNamespace(cancelled=threading.Event(), progress=0, tokens=request.prompt_tokens,
                                          skipped=skipped)
    return request


class EngineHarness:
    """Engines over mock runners for one test; `stop` ends every thread it started."""

    def __init__(self) -> None:
        self.engines: list[Engine] = []

    def __call__(self, start: bool = True, compressor=None, max_step_s: float = 0.0,
                 **kw) -> tuple[Engine, Scheduler, MockRunner]:
        sched, runner = make_scheduler(can_compress=compressor is not None, **kw)
        engine = Engine(sched, runner, name="test", compressor=compressor, max_step_s=max_step_s)
        self.engines.append(engine)
        if start:
            engine.start()
        return engine, sched, runner

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
            assert not engine._thread.is_alive(), "the engine thread did not stop"


def wait_done(*requests: Request, timeout: float = 5.0) -> None:
    for request in requests:
        assert sink_of(request).done.wait(timeout), f"request {request.request_id} never finished"
