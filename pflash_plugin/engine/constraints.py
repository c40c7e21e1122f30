"""Structured output with llguidance: a matcher per constrained row, every row's mask of allowed
tokens for a step filled in one call, applied to the step's logits before any sampler sees them.

Why: llama.cpp's grammar sampler checks the whole vocabulary against its parse stacks for each row,
one row at a time, and its stacks can multiply with every token (issue 49: a JSON schema ran ~25
tokens in 1.7-8.8 s on the CPU; a per-token time guard then refused schemas on a loaded machine).
llguidance (Earley parser over a lexer, a token trie) computes a row's mask in under a
millisecond (the demo's 262K vocabulary, a larger schema, 64 rows on 2 busy cores: 32 ms a step,
0.5 ms a row), its executor fills all rows' masks at once without the GIL, and its limits are
counts (lexer fuel, Earley items, grammar size), not time: the same grammar passes or fails alike
on an idle and a loaded machine.

A request's constraint arrives as llguidance grammar text (`SamplingParams.constraint`) that the
server compiled and checked (`compile_schema`, `compile_gbnf`, `check_constraint`).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from ..llama import Model, native
from ..llama.guidance import guidance_tokenizer
from .stats import rounded

# llguidance's own bounds, the same on any machine (its defaults, errors kept short: a verbose error
# prints the parser's state and the grammar back to the client)
LIMITS = llguidance.LLParserLimits(verbose_errors=False)

# a fill's seconds, its dense rows and its rows' forced tokens (_forced)
_Filled = tuple[float, int, np.ndarray]

# rows of masks per thread at least: on 2 busy cores a second thread made 4 rows 5x slower (2.8
# against 0.56 ms at a 262K vocabulary), and 64 rows 1.5x
ROWS_PER_THREAD = 16


class ConstraintError(ValueError):
    """llguidance refuses the grammar (or the schema) as given."""


# the whitespace llama_cpp's schema converter allows between tokens (its SPACE_RULE, one space):
# unbounded whitespace lets a weak model write newlines to max_tokens where a value should come
_SPACE = {"whitespace_pattern": r" ?"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def compile_schema(schema: dict[str, Any]) -> str:
    """A JSON schema as llguidance grammar text, its objects closed where they do not say
    (`additionalProperties` false by default, as llama_cpp's converter and llama-server read it: a
    model does not add keys of its own)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(_closed(schema), overrides=_SPACE)  # type: ignore[arg-type]
    except ValueError as error:
        raise ConstraintError(str(error)) from None


def _closed(schema: Any) -> Any:
    """A copy of the schema with `additionalProperties: false` on each object schema that lists
    properties and says nothing of others."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = _closed(out[key])
    return out


def compile_gbnf(gbnf: str) -> str:
    """A llama.cpp GBNF grammar as llguidance grammar text, through llguidance's GBNF -> Lark."""
    try:
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(gbnf))
    except (GbnfToLarkError, ValueError, RecursionError) as error:
        raise ConstraintError(f"llguidance cannot read it ({error})") from None


def check_constraint(model: Model, grammar: str) -> None:
    """Raise ConstraintError unless llguidance builds a matcher of `grammar` for this model; the
    matcher built is kept for the engine's `Constraints.bind` of the same grammar (PREBUILT)."""
    matcher = _matcher(model, grammar)
    PREBUILT.put(model, grammar, matcher)


def _matcher(model: Model, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(guidance_tokenizer(model), grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise ConstraintError(_worded(matcher.get_error()))
    return matcher


class Prebuilt:
    """Fresh matchers built where the server checked a request's constraint (its preparation
    thread: llguidance builds without the GIL), by model and grammar, for the engine's bind to take
    instead of building one on its own thread (0.3-0.8 ms a request for the bench's schemas at a
    128K vocabulary, 64 of them at once when 64 clients start). Bounded: a checked request that
    never starts leaves its matcher, and the oldest go past `limit` (a large grammar's matcher is
    megabytes)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ready: weakref.WeakKeyDictionary[Model, OrderedDict[str, list[llguidance.LLMatcher]]] = \
            weakref.WeakKeyDictionary()

    def put(self, model: Model, grammar: str, matcher: llguidance.LLMatcher) -> None:
        with self._lock:
            ready = self._ready.setdefault(model, OrderedDict())
            ready.setdefault(grammar, []).append(matcher)
            ready.move_to_end(grammar)
            if sum(len(matchers) for matchers in ready.values()) > self.limit:
                oldest = next(iter(ready))
                ready[oldest].pop(0)
                if not ready[oldest]:
                    del ready[oldest]

    def take(self, model: Model, grammar: str) -> llguidance.LLMatcher | None:
        with self._lock:
            ready = self._ready.get(model)
            if ready is None or not ready.get(grammar):
                return None
            matcher = ready[grammar].pop()
            if not ready[grammar]:
                del ready[grammar]
            return matcher


PREBUILT = Prebuilt()


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


class Constraints:
    """The matchers of one context's constrained slots, and their masks for the step in flight.

    The masks are filled on a thread of their own (`_fill_thread`, which owns llguidance's executor)
    and the engine thread waits for them only where it needs them: beside the device's decode,
    `fill_ahead` hands the fill over and returns, so the last step's text and events go out while
    the masks fill (llguidance's executor runs without the GIL), and `fill_due` waits for it."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.n_vocab = model.n_vocab
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._thread: ThreadPoolExecutor | None = None  # the fill thread, started on first use
        self._executor: llguidance.LLExecutor | None = None  # its threads start on first use (fill thread only)
        self._masks = np.zeros((0, 0), dtype=np.int32)
        self._filled: dict[int, int] = {}  # slot -> its row in _masks, for the step in flight
        self._ahead = False  # the step in flight's masks were filled beside its decode
        self._pending: Future[_Filled] | None = None  # a fill beside the decode, until waited for
        self._forced = np.zeros(0, dtype=np.int64)  # per row of _masks: the one token it allows, else -1
        self.counts = ConstraintCounts()

    def bind(self, slot: int, grammar: str) -> None:
        """A matcher for the slot's request (ConstraintError: llguidance refuses the grammar)."""
        self.unbind(slot)
        matcher = PREBUILT.take(self.model, grammar)
        if matcher is not None:
            self.counts.binds_prebuilt += 1
        else:
            start = time.perf_counter()
            try:
                matcher = _matcher(self.model, grammar)
            finally:
                self.counts.binds += 1
                self.counts.bind_s += time.perf_counter() - start
        self._matchers[slot] = matcher

    def unbind(self, slot: int) -> None:
        """The slot's matcher let go (a fill in flight keeps its own reference until it ends)."""
        self._matchers.pop(slot, None)
        self._filled.pop(slot, None)

    def __contains__(self, slot: int) -> bool:
        return slot in self._matchers

    def close(self) -> None:
        """The fill thread stopped (after a fill in flight)."""
        self._wait()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

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
        return self._thread.submit(self._fill_thread, jobs, self._masks)

    def _fill_thread(self, jobs: list[tuple[llguidance.LLMatcher, int]], masks: np.ndarray) -> _Filled:
        """On the fill thread: the masks of `jobs` into `masks`' rows; its seconds, dense rows and
        forced tokens (read here, off the engine thread)."""
        start = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.counts.fill_threads)
        self._executor.unsafe_compute_mask_ptr(jobs, masks.ctypes.data, masks.shape[1] * 4, masks.shape[0])
        filled = masks[:len(jobs)]
        return time.perf_counter() - start, _dense(filled), _forced(filled, self.n_vocab)

    def _count(self, done: _Filled) -> float:
        seconds, dense, self._forced = done
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
        not wait for it, and the engine thread need not either until it samples (`fill_due`)."""
        self._pending = self._start(slots)
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
        mask and no sampler (its matcher still takes it: `commit`)."""
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

    def apply(self, logits: np.ndarray, rows: list[tuple[int, int]], n_threads: int = 1,
              unmasked: frozenset[int] = frozenset()) -> dict[int, str]:
        """The filled masks of these (slot, logits row) pairs applied in place (rows of slots
        without a matcher, and `unmasked` slots, left alone); the slots whose matcher can go no
        further (its grammar broke a limit of llguidance's), with why: their rows are not masked."""
        broken: dict[int, str] = {}
        masked = []
        for slot, row in rows:
            if slot not in self._matchers:
                continue
            why = self.error(slot)
            if why is not None:
                broken[slot] = why
            elif slot in self._filled and slot not in unmasked:
                masked.append((slot, row))
        self.mask_rows(logits, masked, n_threads)
        return broken

    def settle(self, slot: int, token: int, row: np.ndarray) -> int | None:
        """The token the slot's filled mask lets through: `token` where allowed, else the allowed one
        with the best logit in `row` (the samplers chose among tokens all at -inf: min_tokens holding
        back the end the grammar allows, say); None where nothing is allowed (the generation ends)."""
        start = time.perf_counter()
        try:
            if self.allows(slot, token):
                return token
            ids = self.allowed(slot)
            return int(ids[np.argmax(row[ids])]) if ids.size else None
        finally:
            self.counts.commit_s += time.perf_counter() - start

    def error(self, slot: int) -> str | None:
        """Why the slot's matcher can go no further (a grammar error, a limit reached), if it cannot."""
        matcher = self._matchers[slot]
        return _worded(matcher.get_error()) if matcher.is_error() else None

    def commit(self, slot: int, token: int) -> str | None:
        """The sampled token into the slot's matcher; the matcher's error where it refuses it."""
        matcher = self._matchers.get(slot)
        if matcher is None:
            return None
        start = time.perf_counter()
        consumed = matcher.consume_token(token)
        self.counts.commits += 1
        self.counts.commit_s += time.perf_counter() - start
        if consumed:
            return None
        return _worded(matcher.get_error()) or f"the grammar does not allow token {token} here"


def _worded(error: str) -> str:
    """llguidance's error for a client: its marker of the details it leaves out removed."""
    return error.replace("<non-verbose/>", "").strip()


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
