"""Drafts from a small model of the target's vocabulary (`--draft_model PATH.gguf`), run on its own
context, all rows of a step together.

Each request running on the target has a sequence in the draft's context that mirrors what the
target's slot holds. Per step the sequence is brought in sync incrementally: the common prefix of
what it holds and the row's tokens stays, the rest is removed (`seq_rm`: what the target rejected)
and only the new tokens are decoded, every row's in the same decode calls. Then k greedy tokens
are drafted with one decode per token, each carrying one token per row still drafting. Drafts are
argmaxes, a deterministic proposal, so the acceptance rule treats them as one-hot (draft_probs
None) for sampled rows too: rejection sampling stays exact, at a lower acceptance than sampling
the draft would give at high temperatures.

A draft model that cannot take a row (its context full, the row longer than it) drafts nothing
for that row; the target decodes it as without speculation.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...llama import Batch, Context, ContextConfig, DecodeError, Model
from .proposer import DraftRow

log = logging.getLogger(__name__)

COST_WINDOW = 16  # proposals whose per-token time `draft_cost` takes the least of
STEADY_SYNC = 2  # tokens a row decodes to sync in steady state: its last draft kept and the target's token


class DraftModelError(ValueError):
    """The draft model cannot serve this target (refused at start)."""


def check_draft_model(target: Model, draft: Model) -> None:
    """Refuse a draft model whose token ids mean something else than the target's."""
    if not target.shares_vocab(draft):
        raise DraftModelError(f"draft_model: {draft.path} ({draft.n_vocab} tokens) does not share the vocabulary of "
                              f"the target {target.path} ({target.n_vocab} tokens): use a model of the same family")


@dataclass
class _Sequence:
    key: int  # the request's
    seq: int  # the draft context's sequence id
    held: list[int] = field(default_factory=list)  # the tokens whose KV the sequence holds, from position 0
    confirmed: int = 0  # how many of `held` were the row's own tokens at the last sync (the rest: drafts)

    def kept(self, tokens: Sequence[int]) -> int:
        """How much of `held` the row's tokens keep. A row's tokens only grow (the Proposer's
        contract: the prompt as prefilled, then what was generated), so only what follows the
        confirmed part is compared (a whole comparison costs milliseconds at 128K tokens); a row
        whose confirmed part visibly changed starts over."""
        n = self.confirmed
        if len(tokens) < n or (n and tokens[n - 1] != self.held[n - 1]):
            return 0
        while n < min(len(self.held), len(tokens)) and self.held[n] == tokens[n]:
            n += 1
        return n


@dataclass
class _Row:
    """A row being drafted this step: its sequence and what it has drafted so far."""

    state: _Sequence
    k: int
    drafts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DraftModelConfig:
    slots: int  # sequences: the server's slots
    n_ctx: int  # KV cells of all sequences together (unified)
    n_batch: int = 512
    n_threads: int = 0  # 0: llama.cpp's default
    n_threads_batch: int = 0

    @property
    def batch_tokens(self) -> int:
        """Its n_batch and n_ubatch: a drafting step decodes a token per slot."""
        return max(self.n_batch, self.slots)


class DraftModelProposer:
    """A `Proposer` over a draft model; `close` frees its context (and the model where it owns it)."""

    reads_media = False  # a pseudo-token is no id of its vocabulary: the decode of every row with it fails
    cheap = False  # a decode a draft token

    def __init__(self, model: Model, config: DraftModelConfig, owns_model: bool = False) -> None:
        self.model, self.owns_model = model, owns_model
        n_batch = config.batch_tokens
        self.ctx = Context(model, ContextConfig(n_ctx=config.n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                                n_seq_max=config.slots, n_outputs_max=max(config.slots, 1),
                                                n_threads=config.n_threads, n_threads_batch=config.n_threads_batch))
        self.batch = Batch(n_batch, 1)
        self._free = list(range(config.slots - 1, -1, -1))
        self._sequences: dict[int, _Sequence] = {}
        self._no_room: set[int] = set()  # rows whose sync found the context full: none tried again until cells free
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)  # seconds a draft token, steady proposals

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        if self.owns_model:
            self.model.close()

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        """Each row's greedy continuation by the draft model, at most row.k tokens (stopping after an
        end-of-generation token)."""
        start = time.perf_counter()
        drafting = {i: _Row(state, row.k) for i, row in enumerate(rows) if row.k > 0 and row.tokens
                    and row.key not in self._no_room and (state := self._sequence(row.key)) is not None}
        synced = self._sync(drafting, rows)
        for step in range(1, max((r.k for r in drafting.values() if r.drafts), default=0)):
            self._draft_step({i: r for i, r in drafting.items() if 0 < len(r.drafts) == step < r.k
                              and not self.model.is_eog(r.drafts[-1])})
        drafted = sum(len(r.drafts) for r in drafting.values())
        if drafted and synced <= STEADY_SYNC * len(drafting):  # a prompt's first decode is no draft's cost
            self._costs.append((time.perf_counter() - start) / drafted)
        return [drafting[i].drafts if i in drafting else [] for i in range(len(rows))]

    def draft_cost(self) -> float:
        """Seconds a draft token cost: the least per-token time of the last COST_WINDOW proposals
        that decoded no prompt (on a CPU that other work loads, the least is what drafting costs)."""
        return min(self._costs, default=0.0)

    def forget(self, key: int) -> None:
        state = self._sequences.pop(key, None)
        self._no_room.discard(key)
        if state is not None:
            self.ctx.memory.seq_rm(state.seq)
            self._free.append(state.seq)
            self._no_room.clear()  # cells freed: the rows that found none may try again

    def _sequence(self, key: int) -> _Sequence | None:
        state = self._sequences.get(key)
        if state is None and self._free:
            state = self._sequences[key] = _Sequence(key, self._free.pop())
        return state

    def _sync(self, drafting: dict[int, _Row], rows: Sequence[DraftRow]) -> int:
        """Bring each row's sequence to its tokens, the new ones of all rows decoded together, in
        chunks of n_batch; each row's first draft is the argmax after its last token. Returns the
        tokens decoded."""
        pending: list[tuple[int, list[int]]] = []  # (row, tokens still to decode)
        for i, r in drafting.items():
            tokens = list(rows[i].tokens)
            if len(tokens) >= self.ctx.n_ctx:
                continue
            kept = min(r.state.kept(tokens), len(tokens) - 1)  # the last token is decoded again: its logits draft
            if kept < len(r.state.held):
                self.ctx.memory.seq_rm(r.state.seq, kept, -1)
                del r.state.held[kept:]
            r.state.confirmed = len(tokens)
            pending.append((i, tokens[kept:]))
        decoded = sum(len(tokens) for _, tokens in pending)
        while pending:
            pending = self._decode_chunk(drafting, pending)
        return decoded

    def _decode_chunk(self, drafting: dict[int, _Row],
                      pending: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        """One decode of as many pending tokens as fit; returns what is still pending."""
        self.batch.clear()
        room, finished, left = self.ctx.n_batch, [], []
        for i, tokens in pending:
            take = tokens[:room]
            if take:
                state = drafting[i].state
                self.batch.add_sequence(take, len(state.held), state.seq, len(take) == len(tokens))
                state.held += take
                room -= len(take)
                if len(take) == len(tokens):
                    finished.append(i)
            if len(take) < len(tokens):
                left.append((i, tokens[len(take):]))
        if not self._decode([drafting[i] for i, _ in pending]):
            return []
        self._take_argmaxes([drafting[i] for i in finished])
        return left

    def _draft_step(self, active: dict[int, _Row]) -> None:
        """One token more for each active row: its last draft decoded, the argmax after it taken."""
        if not active:
            return
        self.batch.clear()
        for r in active.values():
            self.batch.add(r.drafts[-1], len(r.state.held), r.state.seq, True)
            r.state.held.append(r.drafts[-1])
        if self._decode(list(active.values())):
            self._take_argmaxes(list(active.values()))

    def _decode(self, involved: list[_Row]) -> bool:
        """Decode the batch; on failure (no free cells) the rows involved drop their drafts, their
        sequences start over empty, so that what a sequence holds is always known, and they are not
        tried again (a whole prompt decoded for nothing each step) until a request leaves."""
        try:
            self.ctx.decode(self.batch)
            return True
        except DecodeError as error:
            log.warning("the draft model could not decode %d tokens (%s): %d rows draft nothing this step",
                        self.batch.n_tokens, error, len(involved))
            self._no_room.update(r.state.key for r in involved)
            for r in involved:
                self.ctx.memory.seq_rm(r.state.seq)
                r.state.held.clear()
                r.state.confirmed = 0
                r.drafts.clear()
                r.k = 0
            return False

    def _take_argmaxes(self, rows: list[_Row]) -> None:
        """The argmax of each output row, in the order the batch asked for them."""
        logits = self.ctx.output_logits(len(rows))
        for r, token in zip(rows, np.argmax(logits, axis=1)):
            r.drafts.append(int(token))

