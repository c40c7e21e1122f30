"""A reusable llama_batch with one or more sequence ids per token."""
from __future__ import annotations

import llama_cpp.llama_cpp as C


class Batch:
    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        self.capacity = capacity
        self.raw = C.llama_batch_init(capacity, 0, n_seq_max)
        self.n_tokens = 0

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

    def add_sequence(self, tokens: list[int], start_pos: int, seq_id: int, last_logits: bool) -> int:
        for offset, token in enumerate(tokens):
            index = self.add(token, start_pos + offset, seq_id, last_logits and offset == len(tokens) - 1)
        return index

    def close(self) -> None:
        if self.raw is not None:
            C.llama_batch_free(self.raw)
            self.raw = None

    def __del__(self) -> None:
        self.close()
