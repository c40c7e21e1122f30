"""A reusable llama_batch with one or more sequence ids per token."""
from __future__ import annotations

from typing import Sequence

import llama_cpp.llama_cpp as C
import numpy as np


class Batch:
    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        self.capacity = capacity
        self.raw = C.llama_batch_init(capacity, 0, n_seq_max)
        self.n_tokens = 0
        # numpy views of the per-token arrays, for sequences written at once
        self._token, self._pos, self._n_seq_id, self._logits = (
            np.ctypeslib.as_array(array, shape=(capacity,))
            for array in (self.raw.token, self.raw.pos, self.raw.n_seq_id, self.raw.logits))

    def clear(self) -> None:
        self.n_tokens = 0
        self.raw.n_tokens = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        """Append one token; returns its index (the logits row when `logits` is set)."""
        i = self.n_tokens
        if i >= self.capacity:
            raise OverflowError(f"batch capacity {self.capacity} exceeded")
        raw = self.raw
        raw.token[i] = token
        raw.pos[i] = pos
        raw.n_seq_id[i] = 1
        raw.seq_id[i][0] = seq_id
        raw.logits[i] = logits
        self.n_tokens = raw.n_tokens = i + 1
        return i

    def add_sequence(self, tokens: Sequence[int], start_pos: int, seq_id: int, last_logits: bool,
                     n_logits: int = 1) -> int:
        """Append tokens at consecutive positions of one sequence; returns the last one's index.
        `last_logits`: the last `n_logits` tokens get logits (a speculating row's token and drafts).
        Written as arrays (a token at a time took 0.5 ms of a 512-token drafter ubatch's host time), but
        for one token (a decoding slot, every step), where the arrays' fixed cost is 3x `add`'s."""
        first, n = self.n_tokens, len(tokens)
        if n == 0:
            raise ValueError("add_sequence needs at least one token")
        if n == 1:
            return self.add(tokens[0], start_pos, seq_id, last_logits)
        if first + n > self.capacity:
            raise OverflowError(f"batch capacity {self.capacity} exceeded")
        end = first + n
        self._token[first:end] = tokens
        self._pos[first:end] = np.arange(start_pos, start_pos + n)
        self._n_seq_id[first:end] = 1
        self._logits[first:end] = 0
        self._logits[end - max(n_logits, 1):end] = last_logits
        seq_ids = self.raw.seq_id
        for index in range(first, end):
            seq_ids[index][0] = seq_id
        self.n_tokens = self.raw.n_tokens = end
        return end - 1

    def close(self) -> None:
        if self.raw is not None:
            C.llama_batch_free(self.raw)
            self.raw = None

    def __del__(self) -> None:
        self.close()
