"""llguidance's masks of a step's constrained rows: filled on a thread of their own, read per slot,
applied to the step's logits.

Why apart from engine/constraints.py: a request's matcher lives as long as the request (bound,
fed each sampled token, asked for its errors), while the masks are the step's: a buffer refilled
every step, on a thread that may run beside the device's decode, read and applied before sampling.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np

from ..llama import native
from .stats import rounded

# a fill's seconds, its start's wait after the hand-over, its dense rows and its rows' forced tokens (_forced)
_Filled = tuple[float, float, int, np.ndarray]

# rows of masks per thread at least: on 2 busy cores a second thread made 4 rows 5x slower (2.8
# against 0.56 ms at a 262K vocabulary), and 64 rows 1.5x
ROWS_PER_THREAD = 16

# a row is dense where over half of every DENSE_STRIDE-th mask word allows a token (a string's
# characters: ~128K of a 128K vocabulary), counted on a sample of the words to stay cheap
DENSE_STRIDE = 16


@dataclass
class ConstraintCounts:
    """Sums since start of the constraint work's phases on the engine thread, for /status and
    bench/constrained.py's per-step split (issue 49: where an H200 step of schema rows goes)."""

    binds_prebuilt: int = 0  # starting requests' matchers built where the server checked them (Prebuilt)
    binds: int = 0  # those built on the engine thread instead (no check before: a second choice of n, a test)
    bind_s: float = 0.0
    fill_threads: int = 0  # llguidance's executor threads (0: no fill yet)
    fills_ahead: int = 0  # fills beside the device's decode (the runner's launch returned early) ...
    fill_ahead_s: float = 0.0  # ... on the fill thread, beside the engine thread's own work too
    fill_wait_s: float = 0.0  # the sampling step's wait for a fill beside the decode (its critical-path share)
    fill_start_s: float = 0.0  # fills' hand-over to the fill thread's start (its wait for the GIL)
    fills_due: int = 0  # fills on the critical path: just before the step's sampling
    fill_due_s: float = 0.0
    rows_filled: int = 0
    rows_forced: int = 0  # filled rows whose mask allows one token alone: taken without mask or sampler
    dense_rows: int = 0  # filled rows whose mask allows most of the vocabulary (DENSE_STRIDE)
    applies: int = 0  # steps whose constrained rows' logits were masked
    apply_s: float = 0.0
    rows_masked: int = 0
    commits: int = 0  # sampled tokens settled against their mask and committed to their matcher
    commit_s: float = 0.0
    logits_waits: int = 0  # host-sampled steps (any rows): the wait for the device's logits ...
    logits_wait_s: float = 0.0  # ... after the fill (near 0 where a fill beside the decode outlasts it)
    sample_s: float = 0.0  # those steps' host sampling after the logits arrived, masks included

    def sampled(self, wait_s: float, sample_s: float) -> None:
        """A host-sampled step: its wait for the device's logits and its sampling after."""
        self.logits_waits += 1
        self.logits_wait_s += wait_s
        self.sample_s += sample_s

    def as_dict(self) -> dict[str, float | int]:
        return rounded(self)


def _dense(masks: np.ndarray) -> int:
    """How many of these mask rows allow most of the vocabulary (sampled words, DENSE_STRIDE)."""
    sample = masks[:, ::DENSE_STRIDE]
    return int(np.count_nonzero(np.count_nonzero(sample, axis=1) * 2 > sample.shape[1]))


def _forced(masks: np.ndarray, n_vocab: int) -> np.ndarray:
    """Per mask row, the one token it allows, or -1 where it allows none or several (a JSON
    structure's next key or punctuation: about half of a schema answer's tokens)."""
    nonzero = masks != 0
    out = np.full(masks.shape[0], -1, dtype=np.int64)
    rows = np.flatnonzero(np.count_nonzero(nonzero, axis=1) == 1)
    if rows.size:
        words = nonzero[rows].argmax(axis=1)
        bits = masks[rows, words].astype(np.int64) & 0xFFFFFFFF
        one = (bits & (bits - 1)) == 0
        tokens = words[one] * 32 + np.log2(bits[one]).astype(np.int64)  # a power of two: exact
        out[rows[one]] = np.where(tokens < n_vocab, tokens, -1)
    return out


def _executor_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class ConstraintMasks:
    """The masks of the step in flight, for the constrained slots among its rows.

    The masks are filled on a thread of their own (`_fill_thread`, which owns llguidance's executor)
    and the engine thread waits for them only where it needs them: beside the device's decode,
    `fill_ahead` hands the fill over and returns, so the last step's text and events go out while
    the masks fill (llguidance's executor runs without the GIL), and `fill_due` waits for it."""

    def __init__(self, n_vocab: int, matchers: Mapping[int, llguidance.LLMatcher], counts: ConstraintCounts) -> None:
        """`matchers`: the constrained slots' matchers by slot, as Constraints binds and unbinds them
        (read on the engine thread, where a fill starts)."""
        self.n_vocab = n_vocab
        self._matchers = matchers
        self.counts = counts
        self._thread: ThreadPoolExecutor | None = None  # the fill thread, started on first use
        self._executor: llguidance.LLExecutor | None = None  # its threads start on first use (fill thread only)
        self._masks = np.zeros((0, 0), dtype=np.int32)
        self._filled: dict[int, int] = {}  # slot -> its row in _masks, for the step in flight
        self._ahead = False  # the step in flight's masks were filled beside its decode
        self._pending: Future[_Filled] | None = None  # a fill beside the decode, until waited for
        self._forced = np.zeros(0, dtype=np.int64)  # per row of _masks: the one token it allows, else -1
        self._entered = threading.Event()  # the fill thread has begun the fill handed to it

    def close(self) -> None:
        """The fill thread stopped (after a fill in flight)."""
        self._wait()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def drop(self, slot: int) -> None:
        """The slot's row no longer read (its matcher was let go)."""
        self._filled.pop(slot, None)

    def fill(self, slots: list[int]) -> int:
        """The masks of these slots' next tokens, in one call over llguidance's threads, waited for
        here (just before sampling); the rows filled."""
        pending = self._start(slots)
        if pending is None:
            return 0
        self._count(pending.result())
        return len(self._filled)

    def _start(self, slots: list[int]) -> Future[_Filled] | None:
        """The fill of these slots' masks handed to the fill thread (None: none is constrained)."""
        self._wait()
        slots = [slot for slot in slots if slot in self._matchers]
        self._filled = {slot: k for k, slot in enumerate(slots)}
        if not slots:
            return None
        words = (self.n_vocab + 31) // 32
        if self._masks.shape[0] < len(slots) or self._masks.shape[1] != words:
            self._masks = np.zeros((max(len(slots), 2 * self._masks.shape[0]), words), dtype=np.int32)
        if self._thread is None:
            self.counts.fill_threads = _executor_threads()
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="constraint-fill")
        jobs = [(self._matchers[slot], k) for slot, k in self._filled.items()]
        self._entered.clear()
        return self._thread.submit(self._fill_thread, jobs, self._masks, time.perf_counter())

    def _fill_thread(self, jobs: list[tuple[llguidance.LLMatcher, int]], masks: np.ndarray, handed: float) -> _Filled:
        """On the fill thread: the masks of `jobs` into `masks`' rows; its seconds, its start's wait,
        dense rows and forced tokens (read here, off the engine thread)."""
        start = time.perf_counter()
        self._entered.set()  # from here to llguidance's call (which drops the GIL) is a few lines
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.counts.fill_threads)
        self._executor.unsafe_compute_mask_ptr(jobs, masks.ctypes.data, masks.shape[1] * 4, masks.shape[0])
        filled = masks[:len(jobs)]
        return time.perf_counter() - start, start - handed, _dense(filled), _forced(filled, self.n_vocab)

    def _count(self, done: _Filled) -> float:
        seconds, start_wait, dense, self._forced = done
        self.counts.fill_start_s += start_wait
        self.counts.rows_filled += len(self._filled)
        self.counts.dense_rows += dense
        self.counts.rows_forced += int(np.count_nonzero(self._forced >= 0))
        return seconds

    def _wait(self) -> _Filled | None:
        """The fill in flight, waited for (the masks' buffer and matchers are the fill thread's until then)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def fill_ahead(self, slots: list[int]) -> None:
        """`fill` beside the device's decode (the runner's launch returned early), on the fill
        thread: the mask of a row's next token depends only on the tokens it has, so sampling need
        not wait for it, and the engine thread need not either until it samples (`fill_due`). It
        waits only for the fill thread to begin: a thread woken while the engine thread runs Python
        (the last step's text and events) gets the GIL at the next switch interval (up to 5 ms,
        beside an H100 step of ~20 ms at 64 rows), and its fill would begin that much later."""
        self._pending = self._start(slots)
        if self._pending is not None:
            self._entered.wait(1.0)  # bounded: fill_due waits for the fill itself anyway
        self._ahead = True

    def fill_due(self, slots: list[int]) -> None:
        """`fill` for the step being sampled, unless `fill_ahead` did (then its wait); the next
        step fills anew."""
        ahead, self._ahead = self._ahead, False
        start = time.perf_counter()
        if ahead:
            done = self._wait()
            if done is not None:
                self.counts.fills_ahead += 1
                self.counts.fill_ahead_s += self._count(done)
                self.counts.fill_wait_s += time.perf_counter() - start
        elif self.fill(slots):
            self.counts.fills_due += 1
            self.counts.fill_due_s += time.perf_counter() - start

    def stale(self) -> None:
        """A new step is launched: masks filled ahead for one that was never sampled are stale."""
        self._wait()
        self._ahead = False

    def filled(self, slot: int) -> bool:
        return slot in self._filled

    def forced(self, slot: int) -> int | None:
        """The one token the slot's filled mask allows, if it allows one alone: the row needs no
        mask and no sampler (its matcher still takes it: Constraints.commit)."""
        at = self._filled.get(slot)
        token = int(self._forced[at]) if at is not None else -1
        return token if token >= 0 else None

    def allows(self, slot: int, token: int) -> bool:
        """Whether the slot's filled mask allows `token` (one bit: no unpacking)."""
        return bool((int(self._masks[self._filled[slot], token >> 5]) >> (token & 31)) & 1)

    def allowed(self, slot: int) -> np.ndarray:
        """The ids the slot's filled mask allows, ascending."""
        return _allowed_ids(self._masks[self._filled[slot]], self.n_vocab)

    def mask_rows(self, logits: np.ndarray, rows: list[tuple[int, int]], n_threads: int = 1) -> None:
        """-inf in place wherever the slot's mask forbids a token: (slot, logits row) pairs whose
        slots were filled; in C over n_threads where the native library is built."""
        if not rows:
            return
        start = time.perf_counter()
        at = np.asarray([self._filled[slot] for slot, _ in rows], dtype=np.int64)
        where = np.asarray([row for _, row in rows], dtype=np.int64)
        threads = max(1, min(n_threads, len(rows) // ROWS_PER_THREAD))  # a row is ~0.15 ms of stores
        if not native.apply_bitmask(logits, where, self._masks, at, threads):
            for k, row in zip(at, where):
                _mask_row(logits[row], self._masks[k], self.n_vocab)
        self.counts.applies += 1
        self.counts.rows_masked += len(rows)
        self.counts.apply_s += time.perf_counter() - start


def _allowed_ids(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """The token ids of a bitmask's 1 bits: only the words with one are unpacked (a JSON grammar's
    mask allows a few hundred of 262K tokens)."""
    words = np.flatnonzero(mask)
    bits = np.unpackbits(mask[words].view(np.uint8), bitorder="little").reshape(-1, 32).view(bool)
    ids = (words[:, None] * 32 + np.arange(32)).reshape(-1)
    return ids[bits.reshape(-1) & (ids < n_vocab)]


def _mask_row(row: np.ndarray, mask: np.ndarray, n_vocab: int) -> None:
    """numpy's version of the native masking."""
    allowed = _allowed_ids(mask, n_vocab)
    values = row[allowed]
    row[:] = -np.inf
    row[allowed] = values
