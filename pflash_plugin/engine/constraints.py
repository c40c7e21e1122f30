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
server compiled and checked (`compile_schema`, `compile_gbnf`, `check_constraint`); its matcher
lives here for the request's length, its masks step by step in engine/constraint_masks.py.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Union

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from ..llama import Model
from ..llama.guidance import guidance_tokenizer
from .constraint_masks import ConstraintCounts, ConstraintMasks

# llguidance's own bounds, the same on any machine (its defaults, errors kept short: a verbose error
# prints the parser's state and the grammar back to the client)
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


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


def compile_regex(regex: str) -> str:
    """A regular expression the whole output matches, as llguidance grammar text."""
    try:
        return llguidance.LLMatcher.grammar_from_regex(regex)
    except ValueError as error:
        raise ConstraintError(f"llguidance cannot read it ({error})") from None


def check_constraint(model: Model, grammar: str) -> None:
    """Raise ConstraintError unless llguidance builds a matcher of `grammar` for this model; the
    matcher built is kept for the engine's `Constraints.bind` of the same grammar (PREBUILT)."""
    matcher = _matcher(model, grammar)
    PREBUILT.put(model, grammar, matcher)


def prebuild(model: Model, grammar: str) -> None:
    """A matcher of a grammar checked before, built on a builder thread and kept for the engine's
    bind (PREBUILT): a request prepared on the event loop (its schema's constraint kept) neither
    builds on the loop nor leaves the build to the engine thread. Each request gets a matcher of its
    own: llguidance's deep_copy shares the lexer and its lock, so the copies' masks fill one at a time."""
    PREBUILT.put(model, grammar, _builder().submit(_matcher, model, grammar))


_BUILDER: ThreadPoolExecutor | None = None
_BUILDER_LOCK = threading.Lock()


def _builder() -> ThreadPoolExecutor:
    global _BUILDER
    with _BUILDER_LOCK:
        if _BUILDER is None:  # llguidance builds without the GIL: 64 clients starting at once, up to
            # 8 threads at a time (16 cores), ~0.5 ms a build at a 128K vocabulary, before their bind
            _BUILDER = ThreadPoolExecutor(max(2, min(8, (os.cpu_count() or 2) // 2)),
                                          thread_name_prefix="constraint-build")
        return _BUILDER


def _matcher(model: Model, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(guidance_tokenizer(model), grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise ConstraintError(_worded(matcher.get_error()))
    return matcher


_Ready = Union[llguidance.LLMatcher, "Future[llguidance.LLMatcher]"]  # built, or being built (prebuild)


class Prebuilt:
    """Fresh matchers built where the server checked a request's constraint (its preparation
    thread: llguidance builds without the GIL), by model and grammar, for the engine's bind to take
    instead of building one on its own thread (0.3-0.8 ms a request for the bench's schemas at a
    128K vocabulary, 64 of them at once when 64 clients start), or being built there (`prebuild`:
    a future, waited for at the bind). Bounded: a checked request that never starts leaves its
    matcher, and the oldest go past `limit` (a large grammar's matcher is megabytes)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ready: weakref.WeakKeyDictionary[Model, OrderedDict[str, list[_Ready]]] = weakref.WeakKeyDictionary()

    def put(self, model: Model, grammar: str, matcher: _Ready) -> None:
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
        if isinstance(matcher, Future):  # built by prebuild: done by now, or nearly (GIL released)
            try:
                return matcher.result()
            except ConstraintError:
                return None
        return matcher


PREBUILT = Prebuilt()


class Constraints:
    """The matchers of one context's constrained slots (bound for a request, fed each token it
    samples), and their masks for the step in flight (`masks`: filled, read and applied there)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self.counts = ConstraintCounts()
        self.masks = ConstraintMasks(model.n_vocab, self._matchers, self.counts)

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
        self.masks.drop(slot)

    def __contains__(self, slot: int) -> bool:
        return slot in self._matchers

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
            elif self.masks.filled(slot) and slot not in unmasked:
                masked.append((slot, row))
        self.masks.mask_rows(logits, masked, n_threads)
        return broken

    def settle(self, slot: int, token: int, row: np.ndarray) -> int | None:
        """The token the slot's filled mask lets through: `token` where allowed, else the allowed one
        with the best logit in `row` (the samplers chose among tokens all at -inf: min_tokens holding
        back the end the grammar allows, say); None where nothing is allowed (the generation ends)."""
        start = time.perf_counter()
        try:
            if self.masks.allows(slot, token):
                return token
            ids = self.masks.allowed(slot)
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
