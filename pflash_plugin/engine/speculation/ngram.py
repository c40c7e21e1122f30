"""Prompt lookup (n-gram) drafts: the tokens that followed the row's last n-gram where it occurred
before, in its prompt or its own output (stock's `LlamaPromptLookupDecoding`, llama-server's
`--spec-type ngram`). Copying tasks (quoting, editing code, repeating a passage) repeat long runs
of earlier tokens, and the target checks the guess at the cost of a few more tokens in a step.

Stock scans the whole input for each n-gram size every step (a 32K prompt: 32K comparisons a
token); here each request keeps an index, n-gram -> where its latest earlier occurrence ended,
extended with the tokens added since the last call: O(new tokens) a step. Stock takes the earliest
occurrence; the latest is taken here (llama-server's lookup prefers recent ones too): in a copy it
is where the copy is, and in code it is the nearest definition.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .proposer import DraftRow


@dataclass
class _Index:
    """One request's n-grams: for each, the position right after its latest occurrence that is not
    the sequence's own suffix (so there is always at least one token after it)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # end positions recorded: 1 .. indexed


class NgramProposer:
    """Prompt lookup: the row's last `max_ngram_size` tokens (then fewer) looked up in its index."""

    reads_media = True  # a draft stops at a media item's pseudo-ids (`_draft`)
    cheap = True  # an index lookup a row

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10) -> None:
        if max_ngram_size < 1 or num_pred_tokens < 1:
            raise ValueError("max_ngram_size and num_pred_tokens must be at least 1")
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens
        self._indexes: dict[int, _Index] = {}

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        return [self._draft(row) for row in rows]

    def forget(self, key: int) -> None:
        self._indexes.pop(key, None)

    def close(self) -> None:
        self._indexes.clear()

    def draft_cost(self) -> float:
        return 0.0  # a lookup in an index: nothing beside a decode step

    def _draft(self, row: DraftRow) -> list[int]:
        tokens, k = row.tokens, min(row.k, self.num_pred_tokens)
        index = self._indexes.get(row.key)
        if index is None or index.indexed > len(tokens):  # new, or its tokens were replaced
            index = self._indexes[row.key] = _Index()
        self._extend(index, tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram_size, len(tokens) - 1), 0, -1):
            end = index.ends.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:  # up to a media item's pseudo-ids (negative: no token to draft)
                return list(itertools.takewhile(lambda t: t >= 0, tokens[end:min(end + k, len(tokens))]))
        return []

    def _extend(self, index: _Index, tokens: Sequence[int]) -> None:
        """Record the n-grams ending at each position up to the one before the last token. The
        new tokens (and the `max_ngram_size - 1` before them) are read in one slice: a slice per
        position of a prompt joined to its output (drafting.Joined) cost a list each."""
        ends, top = index.ends, self.max_ngram_size
        first = max(index.indexed + 1 - top, 0)
        if len(tokens) - 1 <= index.indexed:
            return
        new = tuple(tokens[first:len(tokens) - 1])  # position p of `tokens` is new[p - first]
        for end in range(index.indexed + 1, len(tokens)):
            at = end - first
            for n in range(1, min(top, end) + 1):
                ends[new[at - n:at]] = end
        index.indexed = len(tokens) - 1
