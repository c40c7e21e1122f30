"""Saved sequence states in host RAM: the prefix cache's second tier (stock's `--cache`).

A slot's cells are lost when a new request takes the slot or the pool evicts them. With this tier
their state (llama.cpp's `llama_state_seq_get_data`) is kept first, bounded in bytes, least
recently used out first, and a later prompt that extends it restores it instead of prefilling
again. Keyed by the tokens the cells hold, so a compressed prompt's cells only ever serve prompts
that start with its compressed tokens. Pure Python: the runner saves and restores.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .prefixes import longest_prefix


@dataclass(frozen=True)
class Saved:
    tokens: tuple[int, ...]
    data: bytes
    first_cell: int = 0  # the lowest KV position it holds (a window-sized SWA cache drops the early ones)


class HostCache:
    def __init__(self, capacity_bytes: int, min_tokens: int) -> None:
        """`min_tokens`: shorter sequences are not worth a save (their prefill is cheap)."""
        self.capacity_bytes, self.min_tokens = capacity_bytes, min_tokens
        self._entries: OrderedDict[tuple[int, ...], Saved] = OrderedDict()
        self.bytes_used = 0
        self.saved = 0  # states put, for /status

    def __len__(self) -> int:
        return len(self._entries)

    def worth_saving(self, tokens: list[int]) -> bool:
        """Long enough, and not already held by an entry that starts with these tokens."""
        if len(tokens) < self.min_tokens:
            return False
        key = tuple(tokens)
        return not any(k[:len(key)] == key for k in self._entries)

    def put(self, tokens: list[int], data: bytes, first_cell: int = 0) -> None:
        """Keep `data` for `tokens` (its cells from KV position `first_cell` on), dropping entries
        it extends, then the least recently used until it fits; a state larger than the whole tier
        is not kept."""
        if len(data) > self.capacity_bytes:
            return
        key = tuple(tokens)
        for k in [k for k in self._entries if key[:len(k)] == k]:
            self._drop(k)
        while self.bytes_used + len(data) > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = Saved(key, data, first_cell)
        self.bytes_used += len(data)
        self.saved += 1

    def best(self, tokens: list[int]) -> tuple[Saved | None, int]:
        """The entry sharing the longest prefix with `tokens` (at most len - 1: one token must
        run)."""
        return longest_prefix(self._entries.values(), lambda saved: saved.tokens, tokens)

    def touch(self, saved: Saved) -> None:
        """`saved` was restored: the last to go."""
        if saved.tokens in self._entries:
            self._entries.move_to_end(saved.tokens)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_used = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes_used -= len(self._entries.pop(key).data)
