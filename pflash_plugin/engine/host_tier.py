"""The host-RAM tier (host_cache.py) as the slots use it: a slot's cells saved before they are
dropped, a saved sequence restored into a slot. Both are a cache's: a save that fails leaves the
cells dropped unsaved, a restore that fails leaves the request to prefill them."""
from __future__ import annotations

import logging
from typing import Protocol

from .host_cache import HostCache, Saved
from .positions import kv_position

log = logging.getLogger(__name__)


class StateOps(Protocol):
    """The KV operations the tier needs (prefix_cache.KVOps has them)."""

    def seq_rm(self, slot: int, start: int) -> None: ...
    def first_cell(self, slot: int) -> int: ...
    def save(self, slot: int, max_bytes: int) -> bytes | None: ...
    def restore(self, slot: int, data: bytes, n_tokens: int) -> None: ...


class HostTier:
    def __init__(self, kv: StateOps, host: HostCache) -> None:
        self.kv, self.host = kv, host

    def save(self, slot: int, tokens: list[int], keep: int) -> None:
        """Save the slot's cells before those past `keep` are dropped, where enough are dropped and
        the host cache would keep them."""
        host = self.host
        if len(tokens) - keep < host.min_tokens or not host.worth_saving(tokens):
            return
        try:
            first, data = self.kv.first_cell(slot), self.kv.save(slot, host.capacity_bytes)
        except Exception as error:
            log.warning("slot %d: saving %d tokens to host RAM failed: %s", slot, len(tokens), error)
            return
        if data is not None:
            host.put(tokens, data, first)

    def restore(self, slot: int, saved: Saved, n: int) -> bool:
        """Load a saved state's first `n` tokens into the slot; False (the slot emptied) where
        llama.cpp cannot place its cells."""
        try:
            self.kv.restore(slot, saved.data, kv_position(saved.tokens, n))
            self.host.touch(saved)
            return True
        except Exception as error:
            log.warning("slot %d: restoring %d saved tokens failed (%s): prefilling them", slot, n, error)
            self.kv.seq_rm(slot, 0)
            return False
