"""The draft-model proposer (engine/speculation/draft_model.py) on tiny generated models: a draft
that is the target drafts the target's own greedy continuation (everything accepted, the text
unchanged); another draft of the same vocabulary keeps the text too at a lower acceptance; after
a partial rejection the draft's sequence holds exactly the accepted tokens (no cell of a rejected
draft left) and drafts as a fresh one would; a model of another vocabulary is refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pflash_plugin.engine.speculation import DraftRow
from pflash_plugin.engine.speculation.acceptance import accept
from pflash_plugin.engine.speculation.draft_model import (DraftModelConfig, DraftModelError, DraftModelProposer,
                                                          check_draft_model)
from pflash_plugin.llama import Batch, Context, ContextConfig, Model, SamplerParams
from pflash_plugin.testing import cached_tiny_llama

PROMPTS = ["the quick brown fox jumps over the lazy dog", "once upon a time there was a", "hello world"]
GREEDY = SamplerParams(temperature=0.0)


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Model:
    return Model(tiny_model)


@pytest.fixture(scope="module")
def other_draft() -> Model:
    """The target's weights in Q4_0: a draft that agrees with it most of the time."""
    return Model(cached_tiny_llama(quant="q4_0"))


def proposer(model: Model, slots: int = 4) -> DraftModelProposer:
    return DraftModelProposer(model, DraftModelConfig(slots=slots, n_ctx=1024, n_batch=64, n_threads=1,
                                                      n_threads_batch=1))


class Verifier:
    """The target side of speculation, one sequence at a time: decode the last token and the drafts
    in one call, keep what `accept` keeps, remove the rest's cells."""

    def __init__(self, model: Model, prompt: list[int]) -> None:
        self.ctx = Context(model, ContextConfig(n_ctx=1024, n_batch=64, n_threads=1, n_threads_batch=1,
                                                n_outputs_max=64, n_outputs_max_per_seq=0))
        self.batch = Batch(64, 1)
        self.tokens = list(prompt)
        for first in range(0, len(prompt) - 1, 64):
            self.batch.clear()
            self.batch.add_sequence(prompt[first:min(first + 64, len(prompt) - 1)], first, 0, False)
            self.ctx.decode(self.batch)

    def step(self, drafts: list[int]) -> int:
        """Verify the drafts; returns how many were kept (the next token is appended too)."""
        self.batch.clear()
        start = len(self.tokens) - 1
        for j, token in enumerate([self.tokens[-1], *drafts]):
            self.batch.add(token, start + j, 0, True)
        self.ctx.decode(self.batch)
        logits = self.ctx.output_logits(len(drafts) + 1).copy()
        n, token = accept(logits, drafts, GREEDY, [], np.random.default_rng(0))
        assert token is not None
        self.ctx.memory.seq_rm(0, start + 1 + n, -1)  # the rejected drafts' cells
        self.tokens += [*drafts[:n], token]
        return n

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def greedy(model: Model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, one token a decode."""
    verifier = Verifier(model, prompt)
    try:
        for _ in range(n):
            verifier.step([])
        return verifier.tokens[len(prompt):]
    finally:
        verifier.close()


def speculate(target: Model, draft: DraftModelProposer, prompt: list[int], n: int, k: int) -> tuple[list[int], float]:
    """Greedy decoding with the draft's proposals verified: (tokens, share of drafts kept)."""
    verifier = Verifier(target, prompt)
    drafted = kept = 0
    try:
        while len(verifier.tokens) - len(prompt) < n:
            [drafts] = draft.propose([DraftRow(key=7, tokens=list(verifier.tokens), k=k)])
            drafted += len(drafts)
            kept += verifier.step(drafts)
        return verifier.tokens[len(prompt):len(prompt) + n], kept / drafted
    finally:
        draft.forget(7)
        verifier.close()


def test_a_draft_that_is_the_target_drafts_its_greedy_continuation_for_every_row(target):
    """Three rows together, k 6, 2 and 0: each row's drafts are the target's own next tokens."""
    prompts = [target.tokenize(p) for p in PROMPTS]
    draft = proposer(target)
    try:
        drafts = draft.propose([DraftRow(i, tokens, k) for i, (tokens, k) in enumerate(zip(prompts, (6, 2, 0)))])
    finally:
        draft.close()
    assert drafts == [greedy(target, prompts[0], 6), greedy(target, prompts[1], 2), []]


def test_speculation_with_the_target_as_draft_keeps_everything_and_the_text(target):
    prompt = target.tokenize(PROMPTS[0])
    draft = proposer(target)
    try:
        tokens, rate = speculate(target, draft, prompt, 40, k=4)
    finally:
        draft.close()
    assert tokens == greedy(target, prompt, 40)
    assert rate == 1.0


def test_another_draft_keeps_the_text_and_some_of_its_drafts(target, other_draft):
    prompt = target.tokenize(PROMPTS[0])
    draft = proposer(other_draft)
    try:
        tokens, rate = speculate(target, draft, prompt, 40, k=3)
        assert draft.ctx.memory.seq_pos_max(0) == -1  # forgotten: its cells are free
    finally:
        draft.close()
    assert tokens == greedy(target, prompt, 40)
    assert 0.3 < rate < 1.0  # 0.74 measured: drafts kept and drafts rejected


def test_after_a_partial_rejection_the_draft_holds_the_accepted_tokens_only(target, other_draft):
    """Drafts d0..d3 (d0..d2 decoded into the draft's sequence); the target keeps d0, d1 and then
    says t: the sequence drops d2's cell, decodes t, and drafts what a fresh proposer drafts."""
    prompt = target.tokenize(PROMPTS[0])
    draft, fresh = proposer(other_draft), proposer(other_draft)
    try:
        [drafts] = draft.propose([DraftRow(1, prompt, 4)])
        seq = draft._sequences[1].seq
        assert len(drafts) == 4 and draft.ctx.memory.seq_pos_max(seq) == len(prompt) + 2
        t = (drafts[2] + 1) % target.n_vocab
        after = [*prompt, *drafts[:2], t]
        [again] = draft.propose([DraftRow(1, after, 3)])
        assert draft._sequences[1].held == [*after, *again[:2]]
        assert draft.ctx.memory.seq_pos_max(seq) == len(after) + 1
        assert again == fresh.propose([DraftRow(1, after, 3)])[0]
    finally:
        draft.close()
        fresh.close()


def test_a_row_that_did_not_speculate_for_steps_drops_its_stale_drafts(target, other_draft):
    """Drafts d0..d2, then the row decodes five steps without speculation, the first token not d0:
    the sequence's stale drafts go, the five are decoded, and it drafts as a fresh proposer does."""
    prompt = target.tokenize(PROMPTS[1])
    draft, fresh = proposer(other_draft), proposer(other_draft)
    try:
        [drafts] = draft.propose([DraftRow(1, prompt, 3)])
        grown = [*prompt, (drafts[0] + 1) % target.n_vocab, *drafts[1:], 5, 6, 7]
        [again] = draft.propose([DraftRow(1, grown, 3)])
        assert draft._sequences[1].held == [*grown, *again[:2]]
        assert again == fresh.propose([DraftRow(1, grown, 3)])[0]
    finally:
        draft.close()
        fresh.close()


def test_the_draft_cost_is_measured_on_drafting_steps_only(target):
    """A prompt's first decode says nothing of what a draft token costs: no cost until a proposal
    that only syncs a step's new tokens, then the seconds per draft token of such proposals."""
    prompt = target.tokenize(PROMPTS[0])
    draft = proposer(target)
    try:
        [drafts] = draft.propose([DraftRow(1, prompt, 3)])
        assert len(drafts) == 3 and draft.draft_cost() == 0.0
        [again] = draft.propose([DraftRow(1, [*prompt, *drafts, 9], 3)])
        assert len(again) == 3 and 0.0 < draft.draft_cost() < 1.0
    finally:
        draft.close()


def test_more_requests_than_sequences_draft_nothing_until_one_is_forgotten(target):
    prompt = target.tokenize(PROMPTS[2])
    draft = proposer(target, slots=1)
    try:
        assert [len(d) for d in draft.propose([DraftRow(1, prompt, 2), DraftRow(2, prompt, 2)])] == [2, 0]
        draft.forget(1)
        assert draft.ctx.memory.seq_pos_max(0) == -1
        assert draft.propose([DraftRow(2, prompt, 2)])[0] == greedy(target, prompt, 2)
    finally:
        draft.close()


def test_a_row_that_finds_the_draft_context_full_drafts_nothing_until_a_request_leaves(target, caplog):
    """Two rows of 150 tokens in 256 cells: the first fits and drafts, the second's sync fails and
    it holds nothing; it is not tried again (its prompt decoded for nothing every step) until a
    request leaves, then it drafts."""
    a, b = ((list(target.tokenize(p)) * 20)[:150] for p in PROMPTS[:2])
    draft = DraftModelProposer(target, DraftModelConfig(slots=2, n_ctx=256, n_batch=64, n_threads=1, n_threads_batch=1))
    try:
        assert draft.ctx.n_ctx == 256
        first = draft.propose([DraftRow(1, a, 2), DraftRow(2, b, 2)])
        assert first == [greedy(target, a, 2), []]
        assert draft.ctx.memory.seq_pos_max(draft._sequences[2].seq) == -1
        caplog.clear()
        a += first[0]
        assert draft.propose([DraftRow(1, a, 2), DraftRow(2, b, 2)])[1] == []
        assert "could not decode" not in caplog.text
        draft.forget(1)
        assert draft.propose([DraftRow(2, b, 2)]) == [greedy(target, b, 2)]
    finally:
        draft.close()


def test_a_draft_of_another_vocabulary_is_refused(target):
    other = Model(cached_tiny_llama(vocab_extra=8))
    try:
        with pytest.raises(DraftModelError, match="does not share the vocabulary of the target"):
            check_draft_model(target, other)
        check_draft_model(target, target)
    finally:
        other.close()
