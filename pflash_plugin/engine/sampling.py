"""Turning each step's logits into tokens: everything about sampling, for every slot of a context.

A request's parameters are bound to its slot when it starts (`bind`) and let go when it ends
(`unbind`). Each bound slot takes one of three paths, the first whose positive list (below) names
every field the request sets:
- "device": llama.cpp's backend sampling. The slot's chain is handed to the context, which samples
  inside the decode, so only the token id leaves the device (no logits copy, no host pass).
- "batch": the host, numpy over all of the step's rows together (engine/batch_sampling.py).
- "chain": llama.cpp's own chain on the host, row by row (llama.cpp grammars, typical-p, mirostat).
The module also owns what every path shares: min_tokens (end-of-generation tokens held back),
the penalties' history, seeds, log-probabilities (engine/logprobs.py), and llguidance's masks
(engine/constraints.py): a constrained row's logits are masked in place before the batch path or its
chain sees them, and its token settled against its mask after (engine/constrained_rows.py).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.random  # noqa: F401  numpy imports it at first use: here, not in a first request's bind on the engine thread

from ..llama import Context, GrammarExhausted, GrammarTooSlow, Model, SamplerChain, native
from .batch_sampling import RowParams, bias_rows, greedy_rows, penalize_rows, penalizes, sample_rows
from .constrained_rows import commit, constrain
from .constraints import Constraints
from .logprobs import with_logprobs
from .request import Request, RequestRefused, SamplingParams, TokenOutput
from .speculation.verifier import Verifier

# Which path serves which field of SamplingParams: positive lists. A field missing from every
# list (a new parameter) sends its requests nowhere: `choose_path` raises, and so does the test
# that walks SamplingParams' fields. SCHEDULER_FIELDS are the scheduler's, not sampling's.
SCHEDULER_FIELDS = frozenset({"max_tokens", "stop", "kept_stops", "reasoning_budget", "speculative",
                              "stop_token_ids"})
DEVICE_FIELDS = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty",
                           "frequency_penalty", "repeat_penalty", "penalty_last_n", "logit_bias", "min_tokens"})
BATCH_FIELDS = DEVICE_FIELDS | {"logprobs", "constraint"}
CHAIN_FIELDS = BATCH_FIELDS | {"typical_p", "grammar", "mirostat", "mirostat_tau", "mirostat_eta",
                               "max_grammar_step_s", "dry", "xtc", "top_n_sigma", "dynatemp"}
PATHS = (("device", DEVICE_FIELDS), ("batch", BATCH_FIELDS), ("chain", CHAIN_FIELDS))
# A field at its neutral value asks nothing of a path; a field with no neutral value always asks.
NEUTRAL: dict[str, object] = {
    "seed": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0, "logit_bias": {},
    "min_tokens": 0, "logprobs": None, "constraint": None, "typical_p": 1.0, "grammar": None, "mirostat": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "max_grammar_step_s": 1.0, "dry": None, "xtc": None,
    "top_n_sigma": None, "dynatemp": None,
}


DEVICE_MODES = ("none", "sampled", "all")


def device_sampling(setting: str, model: Model) -> str:
    """Which rows the backend samples (`--backend_sampling`): "on": "all" it serves; "off": "none";
    "auto": "none" where the native host sampler is built (llama/native.py), else where the output
    layer runs on a GPU "sampled" (temperature > 0). On an H200 at a 128K vocabulary and 64 rows,
    llama.cpp's device chains cost about 10 ms of GPU a step (a top-k over 128K logits per row):
    a sampled step took 21.6 ms on the device against 32.6 ms with numpy on the host, and a greedy
    step 25.2 ms against 18.0 ms; the native sampler takes a sampled row for about what an argmax
    costs (docs/sampling.md). On the CPU the logits are in host memory already."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"backend_sampling must be auto, on or off, not {setting!r}")
    if setting != "auto":
        return "all" if setting == "on" else "none"
    return "sampled" if model.output_on_gpu and native.load() is None else "none"


def asked_fields(p: SamplingParams) -> set[str]:
    """The sampling fields a request sets away from their neutral values."""
    return {f.name for f in dataclasses.fields(p) if f.name not in SCHEDULER_FIELDS
            and (f.name not in NEUTRAL or getattr(p, f.name) != NEUTRAL[f.name])}


def choose_path(p: SamplingParams, device: bool) -> str:
    """The first path (device only where `device`) whose list names every field `p` asks for."""
    asked = asked_fields(p)
    for name, served in PATHS:
        if (device or name != "device") and asked <= served:
            return name
    raise ValueError(f"no sampling path serves {sorted(asked - CHAIN_FIELDS)}")


@dataclasses.dataclass
class _Bound:
    """One slot's request as sampling sees it."""

    request: Request
    params: SamplingParams  # the request's, with its seed drawn and the server's penalty window
    path: str
    chain: SamplerChain  # the host chain, or on the device path the chain the context runs
    rng: np.random.Generator  # the batch path's draws
    holds_eog: bool = False  # device path: the chain biases end-of-generation tokens to -inf
    # fixed by the parameters, asked every step: penalties (its chain keeps the window), an argmax with
    # no bias or penalties (`greedy_rows`), a constraint (llguidance's mask)
    penalizes: bool = dataclasses.field(init=False)
    plain_greedy: bool = dataclasses.field(init=False)
    constrained: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.penalizes = penalizes(p)
        self.plain_greedy = p.temperature <= 0 and not p.logit_bias and not self.penalizes
        self.constrained = bool(p.constraint)

    @property
    def short_of_min_tokens(self) -> bool:
        return len(self.request.output_tokens) < self.params.min_tokens


class Sampling:
    """The slots' bound parameters and every step's sampling, for one context."""

    def __init__(self, model: Model, ctx: Context, seed: int | None = None, penalty_last_n: int = 64,
                 device: str = "none") -> None:
        """`seed`: requests without their own seed draw one from an RNG seeded with it, so a server
        started with a seed repeats its answers (llama_cpp.server's --seed); None: random seeds.
        `device` (DEVICE_MODES, `device_sampling`): which of the rows whose parameters the backend
        serves are sampled inside the decode."""
        if device not in DEVICE_MODES:
            raise ValueError(f"device must be one of {DEVICE_MODES}, not {device!r}")
        self.model, self.ctx = model, ctx
        self._seeds = random.Random(seed) if seed is not None else random.Random()
        self.penalty_last_n = penalty_last_n
        self.device = device
        self._slots: dict[int, _Bound] = {}
        self._eog_tokens = model.eog_tokens  # the scan of the vocabulary, at build
        # device chains let go while a decode that runs them is in flight: freed once it has landed
        self._retired: list[SamplerChain] | None = None  # None: no decode in flight
        self.constraints = Constraints(model)  # llguidance's matchers, by slot
        self.verifier: Verifier[_Bound] = Verifier(self._eog, self._chain_token)  # the speculating rows

    def bind(self, slot: int, request: Request) -> None:
        """Take a starting request's parameters: its path, chain and generator."""
        p = request.params
        seed = p.seed if p.seed is not None else self._seeds.getrandbits(32)
        params = dataclasses.replace(p, seed=seed, penalty_last_n=self.penalty_last_n)
        path = choose_path(p, self.device == "all" or (self.device == "sampled" and p.temperature > 0))
        chain = SamplerChain(self.model, params, history=request.prompt_tokens if p.dry else ())
        bound = _Bound(request, params, path, chain, np.random.default_rng(seed))
        self.unbind(slot)
        if p.constraint:
            try:
                self.constraints.bind(slot, p.constraint)
            except BaseException:
                bound.chain.close()
                raise
        self._slots[slot] = bound
        if path == "device" and not self._set_device_chain(slot, bound, bound.short_of_min_tokens):
            bound.path = "batch"  # llama.cpp cannot run the chain there: the host serves it

    def unbind(self, slot: int) -> None:
        self.constraints.unbind(slot)
        bound = self._slots.pop(slot, None)
        if bound is None:
            return
        if bound.path == "device":
            self.ctx.set_sampler(slot, None)
            if self._retired is not None:
                self._retired.append(bound.chain)
                return
        bound.chain.close()

    def close(self) -> None:
        for slot in list(self._slots):
            self.unbind(slot)
        self.constraints.masks.close()

    # ---- one step --------------------------------------------------------------------------
    def before_decode(self, rows: list[tuple[Request, int]]) -> None:
        """The device chains of this step's rows, as they must be at its decode: a request that
        reached its min_tokens gets a chain that lets end-of-generation through again. The decode
        is in flight from here until `landed`. A row of a request that ended since the step was
        planned (a stop string in the text released before a launch of several ubatches) has no
        chain: its row decodes, nothing samples it (`sample`), and the scheduler drops what it wrote."""
        self.landed()  # chains a decode that never landed (a failed step) let go
        self.constraints.masks.stale()  # masks filled for a step that was never sampled
        self._retired = []
        for request, _ in rows:
            if not request.status.running:
                continue
            slot = request.held_slot
            bound = self._slots[slot]
            if bound.path == "device" and bound.holds_eog != bound.short_of_min_tokens \
                    and not self._set_device_chain(slot, bound, bound.short_of_min_tokens):
                self.ctx.set_sampler(slot, None)
                bound.path = "batch"

    def beside_decode(self, rows: list[tuple[Request, int]]) -> None:
        """The constrained rows' masks, while the device decodes (the runner calls it where its
        launch returns early): the mask of a row's next token depends only on the tokens it has.
        They fill on their own thread while the engine thread goes on (`sample` waits for them)."""
        self.constraints.masks.fill_ahead(_running_slots(rows))

    def landed(self) -> None:
        """The decode since `before_decode` has ended (or failed): the chains it ran can go."""
        for chain in self._retired or ():
            chain.close()
        self._retired = None

    def sample(self, rows: list[tuple[Request, int]],
               drafts: Mapping[int, Sequence[int]] | None = None) -> dict[int, TokenOutput | Exception]:
        """One token per row (request, batch index), in the step's output order, for the requests
        still running (one that a stop string ended while the decode ran gets none). A request with
        `drafts` (by its id) has a row for its last token and one per draft, consecutive: they are
        verified (speculation/verifier.py), and its token comes after the drafts the target accepted. A sampling
        error belongs to its request alone: it is returned in that request's place. Every entry
        comes after a read of the decode's outputs (LlamaRunner.collect waits only where there is none)."""
        drafts = drafts or {}
        outputs: dict[int, TokenOutput | Exception] = {}
        host = []
        verified: dict[int, tuple[_Bound, list[tuple[int, int]]]] = {}
        for k, (request, row) in enumerate(rows):
            if not request.status.running:
                continue
            bound = self._slots[request.held_slot]
            if request.request_id in drafts:
                verified.setdefault(request.request_id, (bound, []))[1].append((k, row))
            elif bound.path == "device":
                outputs[request.request_id] = self._device_token(bound, row)
            else:
                host.append((k, bound, row))
        if not host and not verified:
            return outputs
        constrained = [(k, bound) for k, bound, _ in host if bound.constrained]
        self.constraints.masks.fill_due([bound.request.held_slot for _, bound in constrained])
        waited = time.perf_counter()  # the device's logits (llama_get_logits synchronizes), after the fill
        logits = self.ctx.output_logits(len(rows))  # a view, written in place: the rows' own buffer
        landed = time.perf_counter()
        # min_tokens: end-of-generation at -inf before any sampler sees the rows (a grammar that allows
        # nothing else still ends the generation), one assignment for all (64 rows cost 0.3 ms row by row)
        held = [k for k, bound, _ in host if bound.short_of_min_tokens]
        if held:
            logits[np.ix_(held, self._eog())] = -np.inf
        # log-probabilities as llama.cpp's grammar path gave them: after min_tokens, before the mask
        raw = {k: logits[k].copy() for k, bound, _ in host if bound.params.logprobs is not None}
        if constrained:
            outputs.update(constrain(self.constraints, logits, constrained, raw, self.ctx.n_threads))
            host = [(k, bound, row) for k, bound, row in host if bound.request.request_id not in outputs]
        outputs.update(self._batch(logits, [(k, bound) for k, bound, _ in host if bound.path == "batch"], raw))
        for k, bound, row in host:
            if bound.request.request_id not in outputs:
                try:
                    outputs[bound.request.request_id] = self._chain_token(bound, row, raw.get(k))
                except Exception as error:
                    outputs[bound.request.request_id] = error
        if constrained:
            commit(self.constraints, logits, constrained, raw, outputs, self._eog)
        outputs.update(self.verifier.verify(logits, verified, drafts))
        self.constraints.counts.sampled(landed - waited, time.perf_counter() - landed)
        return outputs

    def speculates(self, request: Request) -> bool:
        """Whether the request's rows may carry drafts: on the batch path (not the device's chain),
        asking only what the Verifier applies (DEVICE_FIELDS: no log-probabilities, no grammar)."""
        bound = self._slots.get(request.held_slot)
        return bound is not None and bound.path == "batch" and asked_fields(bound.params) <= DEVICE_FIELDS

    def _device_token(self, bound: _Bound, row: int) -> TokenOutput | Exception:
        token = self.ctx.sampled_token(row)
        if token < 0:
            return RuntimeError("llama.cpp's backend sampler returned no token")
        bound.chain.accept(token)  # the penalties' history, which the chain uploads at the next decode
        return TokenOutput(token)

    def _batch(self, logits: np.ndarray, rows: list[tuple[int, _Bound]],
               raw: dict[int, np.ndarray]) -> dict[int, TokenOutput | Exception]:
        """The batch path's rows together: bias and penalties in one pass, then each row's argmax or
        draw (engine/batch_sampling.py). Log-probabilities come from the row as the chain's path
        takes them (after min_tokens, before bias and penalties). A row whose maximum is not a
        number is left to its chain, as before (which biases and penalizes it again: such a row
        means nothing either way). The chains of penalizing rows accept the tokens, so their
        windows stay whole for such a row (a chain without penalties keeps no history)."""
        plain = [(k, bound) for k, bound in rows if bound.plain_greedy]
        rows = [(k, bound) for k, bound in rows if not bound.plain_greedy] if plain else rows
        tokens = greedy_rows(logits, np.asarray([k for k, _ in plain], dtype=np.int64), self.ctx.host_threads) \
            if plain else []
        if rows:
            rp = RowParams.of([(k, bound.params, bound.request.output_tokens, bound.rng) for k, bound in rows])
            bias_rows(logits, rp)
            penalize_rows(logits, rp)
            tokens += sample_rows(logits, rp, self.ctx.host_threads)
        outputs: dict[int, TokenOutput | Exception] = {}
        for (k, bound), token in zip(plain + rows, tokens):
            if token is not None:
                if bound.penalizes:
                    bound.chain.accept(token)
                outputs[bound.request.request_id] = with_logprobs(token, raw.get(k), bound.params.logprobs)
        return outputs

    def _chain_token(self, bound: _Bound, row: int, logits: np.ndarray | None = None) -> TokenOutput:
        """`logits`: the row for its log-probabilities (None: none asked)."""
        top_n = bound.params.logprobs
        try:
            token = bound.chain.sample(self.ctx, row)
        except GrammarExhausted:  # the grammar allows nothing more: the generation ends here
            token = self._eog()[0]
        except GrammarTooSlow as error:  # the next token would take longer still: the client's grammar
            raise RequestRefused(str(error)) from error
        return with_logprobs(token, logits, top_n)

    def _set_device_chain(self, slot: int, bound: _Bound, hold_eog: bool) -> bool:
        """A new device chain for the slot (llama.cpp builds a chain into its graph once): the
        request's, with end-of-generation biased to -inf while `hold_eog`; the penalties' window
        replayed into it. False: llama.cpp cannot run it on the device (the old chain stays)."""
        params = bound.params
        if hold_eog:
            params = dataclasses.replace(params, logit_bias={**params.logit_bias,
                                                             **{t: -math.inf for t in self._eog()}})
        chain = SamplerChain(self.model, params, device=True)
        if params.penalty_last_n > 0:
            for token in bound.request.output_tokens[-params.penalty_last_n:]:
                chain.accept(token)
        if not self.ctx.set_sampler(slot, chain.ptr):
            chain.close()
            return False
        bound.chain.close()
        bound.chain, bound.holds_eog = chain, hold_eog
        return True

    def _eog(self) -> list[int]:
        return self._eog_tokens


def _running_slots(rows: list[tuple[Request, int]]) -> list[int]:
    return [request.held_slot for request, _ in rows if request.status.running]

