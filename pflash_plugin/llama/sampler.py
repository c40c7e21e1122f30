"""A per-request llama.cpp sampler chain built from OpenAI-style parameters.

A grammar is the one sampler whose `accept` throws (a C++ exception through ctypes aborts the
process) when handed a token it does not allow, and llama.cpp hands it one whenever every allowed
candidate ends at -inf (min_tokens holding end-of-generation back, a penalty overflowing, NaN from
an extreme temperature). So a grammar never sits in the native chain: `SamplerChain.sample`
computes the allowed set itself, lets the chain choose among those tokens only, checks the choice,
and only then accepts it.
"""
from __future__ import annotations

import ctypes
import hashlib
import random
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence, cast

import numpy as np
import llama_cpp.llama_cpp as C

from .context import Context
from .held import holding_gil_all
from .grammar_cost import GrammarSyntaxError, grammar_cost, grammar_shape
from .model import Model

# a request's chain built and freed holding the GIL (held.py): microseconds each, on the engine thread
# as requests are admitted and end (5-6 calls a greedy request: 32 image chats admitted together
# released the GIL ~190 times; bench/vision_steps.py --calls); the samplers over a row release it
_HELD_SAMPLERS = ("llama_sampler_chain_default_params", "llama_sampler_chain_init", "llama_sampler_chain_add",
                  "llama_sampler_init_greedy", "llama_sampler_init_dist", "llama_sampler_init_top_k",
                  "llama_sampler_init_top_p", "llama_sampler_init_min_p", "llama_sampler_init_typical",
                  "llama_sampler_init_temp", "llama_sampler_init_penalties", "llama_sampler_init_logit_bias",
                  "llama_sampler_init_mirostat", "llama_sampler_init_mirostat_v2", "llama_sampler_free",
                  "llama_sampler_init_xtc", "llama_sampler_init_top_n_sigma", "llama_sampler_init_temp_ext")
H = holding_gil_all(C, _HELD_SAMPLERS)


class GrammarError(ValueError):
    pass


class GrammarExhausted(RuntimeError):
    """The grammar allows no token at all here, not even end-of-generation."""


class GrammarTooSlow(GrammarError):
    """The grammar's part of two token steps in a row ran past its limit: an ambiguous grammar whose
    parse stacks multiply with every token (`r ::= "a" r "b" | "a" r "c" | "a"`: 4x a token), which
    no estimate before the first token sees."""


class SlowSteps:
    """Ends a grammar on its second step in a row over `limit` CPU seconds. A grammar whose parse
    states grow runs past it on every later step too; one step alone can be a pause of the process
    (a garbage collection of a large heap, a hypervisor's steal): CI saw a demo-model tool call
    refused at 1.34 s for one token whose steps take 0.003-0.1 s on the same code."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.in_a_row = 0

    def over(self, took: float) -> bool:
        """Record one step's CPU seconds; True where this step and the one before ran past."""
        self.in_a_row = self.in_a_row + 1 if took > self.limit else 0
        return self.in_a_row >= 2


# llama.cpp parses and checks grammars recursively: a grammar nested ~18K groups deep, or whose rule
# references chain ~50K rules deep, overflows an 8 MiB thread stack (SIGSEGV). Each `{m,n}` also
# expands into up to n rules. These bounds sit far below that and far above real grammars.
MAX_GRAMMAR_NESTING = 256
MAX_GRAMMAR_RULES = 20_000
# What llama.cpp's parse pays per token (grammar_cost.py): the 60-property JSON schema of optional
# fields reaches 2,012 expansions and costs 8 ms a token on the tiny test model; nested optionals at
# 2,016 cost 28 ms, and the next level (8,128) 0.25 s. An enum of 1,024 values is 1,024 stacks.
MAX_GRAMMAR_STACKS = 1024
MAX_GRAMMAR_EXPANSIONS = 4096
MAX_GRAMMAR_ELEMENTS = 1_000_000  # 8 bytes each in llama.cpp, ~20 ms of its parse on the engine thread


class _Passed:
    """Digests of the grammars that passed the checks lately: the engine builds its sampler from a
    grammar the server checked on a worker thread, and the check (a Python parse: 0.9 s for a 4 MB
    literal) must not run again on the engine thread."""

    SIZE = 256

    def __init__(self) -> None:
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def digest(grammar: str) -> bytes:
        return hashlib.blake2b(grammar.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._digests:
                self._digests.move_to_end(digest)
                return True
            return False

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._digests[digest] = None
            if len(self._digests) > self.SIZE:
                self._digests.popitem(last=False)


_PASSED = _Passed()


def check_grammar_size(grammar: str) -> None:
    """Refuse a GBNF grammar whose nesting or rule count could overflow llama.cpp's stack (a cheap
    scan first: it bounds what the parse of `grammar_cost` then reads), or whose parse would
    stall every token step."""
    digest = _PASSED.digest(grammar)
    if digest in _PASSED:
        return
    _check_grammar_shape(grammar)
    _check_grammar_cost(grammar)
    _PASSED.add(digest)


def _check_grammar_shape(grammar: str) -> None:
    shape = grammar_shape(grammar, MAX_GRAMMAR_NESTING, MAX_GRAMMAR_RULES)
    if shape.nesting > MAX_GRAMMAR_NESTING:
        raise GrammarError(f"the grammar nests groups over {MAX_GRAMMAR_NESTING} deep")
    if shape.rules > MAX_GRAMMAR_RULES:
        raise GrammarError(f"the grammar expands to over {MAX_GRAMMAR_RULES} rules")


def _check_grammar_cost(grammar: str) -> None:
    try:
        cost = grammar_cost(grammar)
    except GrammarSyntaxError as error:
        raise GrammarError(str(error)) from None
    except RecursionError:  # groups nested within MAX_GRAMMAR_NESTING, on a thread already deep
        raise GrammarError("the grammar nests groups too deep") from None
    if cost.stacks > MAX_GRAMMAR_STACKS:
        raise GrammarError(f"the grammar keeps {cost.stacks} parse states at once, over {MAX_GRAMMAR_STACKS} "
                           "(llama.cpp pays for each at every token: a large alternation or enum, or nested "
                           "optionals)")
    if cost.expansions > MAX_GRAMMAR_EXPANSIONS:
        raise GrammarError(f"the grammar re-expands up to {cost.expansions} parse states per character, over "
                           f"{MAX_GRAMMAR_EXPANSIONS} (nested optionals such as `a ::= b? b?` multiply them)")
    if cost.elements > MAX_GRAMMAR_ELEMENTS:
        raise GrammarError(f"the grammar expands to {cost.elements} elements, over {MAX_GRAMMAR_ELEMENTS}")


def check_grammar(model: Model, grammar: str) -> None:
    """Raise GrammarError unless llama.cpp accepts `grammar` for this model's vocabulary."""
    C.llama_sampler_free(_grammar_sampler(model, grammar))


def _grammar_sampler(model: Model, grammar: str) -> C.llama_sampler_p:
    check_grammar_size(grammar)
    sampler = C.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
    if not sampler:
        raise GrammarError("the grammar could not be parsed (GBNF with a 'root' rule expected)")
    return sampler


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data
assert _TOKEN_DATA.itemsize == ctypes.sizeof(C.llama_token_data)


class _Candidates:
    """One reusable llama_token_data array over the whole vocabulary, with a numpy view of it."""

    def __init__(self, n_vocab: int) -> None:
        self.raw = (C.llama_token_data * n_vocab)()
        self.view = np.frombuffer(self.raw, dtype=_TOKEN_DATA)  # type: ignore[call-overload]  # a ctypes buffer
        self.ids = np.arange(n_vocab, dtype=np.int32)

    def fill(self, logits: np.ndarray | float) -> C.llama_token_data_array:
        self.view["id"], self.view["logit"], self.view["p"] = self.ids, logits, 0.0
        return self.part(0, len(self.ids))

    def part(self, start: int, stop: int) -> C.llama_token_data_array:
        """Entries start..stop as an array of their own (the buffer's, not a copy)."""
        data = ctypes.cast(ctypes.addressof(self.raw) + start * _TOKEN_DATA.itemsize, C.llama_token_data_p)
        return C.llama_token_data_array(data=data, size=stop - start, selected=-1, sorted=False)


class _GrammarPass:
    """A grammar's verdict on the whole vocabulary, split over threads. llama.cpp checks each
    candidate against the parse stacks without changing them (`llama_grammar_apply_impl` reads a
    const grammar and the vocabulary's piece cache), and ctypes lets go of the GIL for the call, so
    slices of one candidate array are checked at once. This is the one per-token cost of a grammar
    row that grows with the vocabulary (a 128K vocabulary: ~25 ms a token on one core, where the
    whole batch's decode step takes ~17 ms), and every row of the batch waits for it."""

    MIN_PART = 8192  # below this a slice's thread costs more than it saves
    WORKERS = 8

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def apply(self, grammar: C.llama_sampler_p, candidates: _Candidates, threads: int) -> float:
        """`threads`: the context's, idle while the step's rows are sampled. Returns the CPU
        seconds the pool's threads spent on it (the caller's own thread counts its own)."""
        n = len(candidates.ids)
        parts = max(1, min(threads, self.WORKERS, n // self.MIN_PART))
        bounds = [n * i // parts for i in range(parts + 1)]
        arrays = [candidates.part(start, stop) for start, stop in zip(bounds, bounds[1:])]
        if parts == 1:
            C.llama_sampler_apply(grammar, ctypes.byref(arrays[0]))
            return 0.0
        return sum(future.result() for future in [self.pool().submit(_cpu_timed_apply, grammar, a) for a in arrays])

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="grammar")
            return self._pool


def _cpu_timed_apply(grammar: C.llama_sampler_p, array: C.llama_token_data_array) -> float:
    """One slice of the grammar's pass, and the CPU seconds this thread spent on it."""
    started = time.thread_time()
    C.llama_sampler_apply(grammar, ctypes.byref(array))
    return time.thread_time() - started


_GRAMMAR_PASS = _GrammarPass()


@dataclass(frozen=True)
class Dry:
    """llama.cpp's DRY ("don't repeat yourself") penalty, as llama-server takes it: a token that
    would extend a sequence seen in the last `penalty_last_n` tokens (the prompt's included) past
    `allowed_length` loses multiplier * base ^ (length - allowed_length) from its logit; the
    breakers end sequences."""

    multiplier: float
    base: float = 1.75
    allowed_length: int = 2
    penalty_last_n: int = 64
    sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")


@dataclass(frozen=True)
class Xtc:
    """llama.cpp's XTC ("exclude top choices"): with `probability`, every token at or above
    `threshold` but the least likely of them is removed."""

    probability: float
    threshold: float = 0.1


@dataclass(frozen=True)
class DynaTemp:
    """llama.cpp's dynamic temperature: within temperature +- `range`, set by the row's entropy."""

    range: float
    exponent: float = 1.0


@dataclass
class SamplerParams:
    """What one request's sampler chain applies (the engine's SamplingParams extends it). An HTTP
    request fills every field from llama_cpp.server's request defaults (repeat_penalty 1.1 there);
    these defaults serve callers of the engine itself."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    typical_p: float = 1.0
    seed: int | None = None  # None: a random seed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64  # the penalties' window (the server's last_n_tokens_size)
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None
    mirostat: int = 0  # 0 off, 1 or 2: mirostat version
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # llama-server's samplers beyond stock llama_cpp's (None: off)
    dry: Dry | None = None
    xtc: Xtc | None = None
    top_n_sigma: float | None = None
    dynatemp: DynaTemp | None = None
    # a grammar whose two tokens in a row take more CPU seconds than this ends its request: CPU time,
    # not the clock, so that a machine loaded by other requests never refuses a schema (issue 49: a
    # 3-field pydantic model was refused at 1.53 s on the clock at load 10)
    max_grammar_step_s: float = 1.0

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as token (int64) and bias (float32) arrays, made once: the host's batch
        sampler gathers every row's each step, and a request's bias never changes (parameters are
        replaced, not mutated). As Python tuples, 32 rows banning 256 tokens each cost 1.4 ms a step
        on 2 CPU cores (bench/vision.py's requests); arrays joined, 0.05 ms."""
        return (np.fromiter(self.logit_bias.keys(), np.int64, len(self.logit_bias)),
                np.fromiter(self.logit_bias.values(), np.float32, len(self.logit_bias)))


class SamplerChain:
    """[grammar] -> logit bias -> penalties -> DRY -> top-n-sigma -> top-k -> typical -> top-p -> min-p
    -> XTC -> temp -> dist (or temp -> mirostat v1/v2): llama.cpp's common order. Temperature <= 0
    means greedy (after the bias, penalties and DRY). The chain owns its samplers; `close` frees all of them.
    Without a grammar, typical or mirostat every sampler in it has a backend version: the chain can
    also be handed to a context (`Context.set_sampler`), which then samples inside the decode.
    """

    def __init__(self, model: Model, p: SamplerParams, device: bool = False, history: Sequence[int] = ()) -> None:
        """`device`: the chain is for `Context.set_sampler` (greedy is written as top-k 1 -> dist).
        `history`: the prompt's tokens, which DRY's window starts with (as llama-server's does)."""
        self.params = p
        chain_params = H.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self.ptr = H.llama_sampler_chain_init(chain_params)
        self.grammar = None
        self._candidates: _Candidates | None = None
        self._slow = SlowSteps(p.max_grammar_step_s)
        try:
            if p.grammar:
                self.grammar = _grammar_sampler(model, p.grammar)
                self._candidates = _Candidates(model.n_vocab)
            if p.logit_bias:
                biases = (C.llama_logit_bias * len(p.logit_bias))()
                for i, (token, bias) in enumerate(p.logit_bias.items()):
                    model.check_token(token)
                    biases[i] = C.llama_logit_bias(token, bias)
                self._add(H.llama_sampler_init_logit_bias(model.n_vocab, len(p.logit_bias), biases))
            if p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                self._add(
                    H.llama_sampler_init_penalties(
                        model.n_vocab,
                        p.penalty_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
                    )
                )
            if p.dry is not None:
                self._add(DRY_TEMPLATES.clone(model, p.dry, history))
            seed = p.seed if p.seed is not None else random.getrandbits(32)
            if p.temperature <= 0 and device:  # llama.cpp copies a device chain's last logits to the host:
                self._add(H.llama_sampler_init_top_k(1))  # one value after top-k 1, the whole row before
                self._add(H.llama_sampler_init_dist(seed))  # greedy (whose device version ignores top-k's ids)
                return
            if p.temperature <= 0:
                self._add(H.llama_sampler_init_greedy())
                return
            if p.mirostat in (1, 2):  # mirostat replaces the truncation samplers, as in llama.cpp
                self._add(H.llama_sampler_init_temp(p.temperature))
                self._add(
                    H.llama_sampler_init_mirostat(model.n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100)
                    if p.mirostat == 1
                    else H.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta)
                )
                return
            if p.top_n_sigma is not None:
                self._add(H.llama_sampler_init_top_n_sigma(p.top_n_sigma))
            if p.top_k > 0:
                self._add(H.llama_sampler_init_top_k(p.top_k))
            if p.typical_p < 1.0:
                self._add(H.llama_sampler_init_typical(p.typical_p, 1))
            if p.top_p < 1.0:
                self._add(H.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0.0:
                self._add(H.llama_sampler_init_min_p(p.min_p, 1))
            if p.xtc is not None:
                self._add(H.llama_sampler_init_xtc(p.xtc.probability, p.xtc.threshold, 1, seed))
            self._add(H.llama_sampler_init_temp_ext(p.temperature, p.dynatemp.range, p.dynatemp.exponent)
                      if p.dynatemp is not None else H.llama_sampler_init_temp(p.temperature))
            self._add(H.llama_sampler_init_dist(seed))
        except BaseException:
            self.close()
            raise

    def _add(self, sampler: C.llama_sampler_p) -> None:
        H.llama_sampler_chain_add(self.ptr, sampler)

    def sample(self, ctx: Context, index: int) -> int:
        """Sample from batch row `index` and accept the token (penalties, grammar state).
        Raises GrammarExhausted where the grammar allows nothing, GrammarTooSlow where its steps
        ran past max_grammar_step_s of CPU time (this thread's and the grammar pool's) twice in a row."""
        if self.grammar is None:  # no sampler left that can throw: the native path
            return C.llama_sampler_sample(self.ptr, ctx.ptr, index)
        started, pooled = time.thread_time(), 0.0
        token = self._greedy_allowed(ctx.logits(index)) if self.params.temperature <= 0 else -1
        if token < 0:
            allowed, pooled = self._allowed(ctx.n_threads)
            logits = np.where(allowed, ctx.logits(index), -np.inf)
            token = self.apply(logits)
            if not (0 <= token < allowed.size and allowed[token]):  # every allowed logit was -inf or NaN
                token = int(np.flatnonzero(allowed)[np.argmax(logits[allowed])])
        C.llama_sampler_accept(self.grammar, token)
        C.llama_sampler_accept(self.ptr, token)
        took = time.thread_time() - started + pooled
        if self._slow.over(took):  # the next token would cost more: end it here
            raise GrammarTooSlow(f"the grammar took {took:.2f} s of CPU time for a token, the second in a row "
                                 f"over {self.params.max_grammar_step_s:g} s: its parse states grow with every token")
        return token

    def apply(self, logits: np.ndarray) -> int:
        """The chain's choice over one row of logits given as an array (-1 if none), not accepted."""
        if self._candidates is None:
            self._candidates = _Candidates(logits.size)
        candidates = self._candidates.fill(logits)
        C.llama_sampler_apply(self.ptr, ctypes.byref(candidates))
        selected = candidates.selected
        # ctypes gives a field's value as a Python int; llama_cpp annotates it as c_int32
        return cast(int, candidates.data[selected].id) if 0 <= selected < candidates.size else -1

    def accept(self, token: int) -> None:
        """Record a token chosen outside `sample` (the penalties' window)."""
        C.llama_sampler_accept(self.ptr, token)

    def _greedy_allowed(self, logits: np.ndarray) -> int:
        """A greedy chain's choice over the whole row where the grammar allows it (-1 where not):
        then it is also the choice among the allowed tokens, found by asking the grammar about one
        token instead of the whole vocabulary, as llama.cpp's common sampler does (demo model, 262K
        tokens, JSON grammar, 2 CPU cores: 27.9 against 47.1 ms a token, decode included)."""
        token = self.apply(logits)
        if token < 0:
            return -1
        one = (C.llama_token_data * 1)(C.llama_token_data(token, 0.0, 0.0))
        C.llama_sampler_apply(self.grammar, ctypes.byref(C.llama_token_data_array(
            data=ctypes.cast(one, C.llama_token_data_p), size=1, selected=-1, sorted=False)))
        return token if one[0].logit == 0.0 else -1

    def _allowed(self, threads: int) -> tuple[np.ndarray, float]:
        """The grammar's verdict on every token, whatever the logits (it only writes -inf), over
        up to `threads` threads; and the CPU seconds the other threads spent on it."""
        assert self._candidates is not None and self.grammar is not None
        self._candidates.fill(0.0)
        pooled = _GRAMMAR_PASS.apply(self.grammar, self._candidates, threads)
        allowed = self._candidates.view["logit"] == 0.0
        if not allowed.any():
            raise GrammarExhausted("the grammar allows no further token")
        return allowed, pooled

    def close(self) -> None:
        if self.grammar:
            H.llama_sampler_free(self.grammar)
            self.grammar = None
        if self.ptr:
            H.llama_sampler_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()


class _DryTemplates:
    """Built DRY samplers by model and parameters, cloned for each request: llama.cpp finds each
    breaker's tokens in a pass over the vocabulary, 45 ms at 262K tokens (2 CPU cores), where a
    clone takes 0.05 ms. `warm` builds one off the engine thread (a request's preparation)."""

    SIZE = 8  # per model: a server sees a few clients' settings

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: weakref.WeakKeyDictionary[Model, OrderedDict[Dry, C.llama_sampler_p]] = \
            weakref.WeakKeyDictionary()

    def warm(self, model: Model, dry: Dry) -> None:
        self.clone(model, dry, ())

    def clone(self, model: Model, dry: Dry, history: Sequence[int]) -> C.llama_sampler_p:
        """A DRY sampler with its window filled from `history`'s last tokens (media's pseudo-ids
        left out)."""
        with self._lock:
            built = self._by_model.get(model)
            if built is None:
                built = self._by_model[model] = OrderedDict()
                weakref.finalize(model, _free_all, built)
            template = built.get(dry)
            if template is None:
                breakers = [text.encode() for text in dry.sequence_breakers]
                template = C.llama_sampler_init_dry(model.vocab, dry.multiplier, dry.base, dry.allowed_length,
                                                    dry.penalty_last_n, (ctypes.c_char_p * len(breakers))(*breakers),
                                                    len(breakers))
                built[dry] = template
                if len(built) > self.SIZE:
                    C.llama_sampler_free(built.popitem(last=False)[1])
            built.move_to_end(dry)
            sampler = C.llama_sampler_clone(template)
        for token in history[len(history) - dry.penalty_last_n:] if dry.penalty_last_n else ():
            if 0 <= token < model.n_vocab:
                C.llama_sampler_accept(sampler, token)
        return sampler


def _free_all(samplers: OrderedDict[Dry, C.llama_sampler_p]) -> None:
    for sampler in samplers.values():
        C.llama_sampler_free(sampler)


DRY_TEMPLATES = _DryTemplates()
