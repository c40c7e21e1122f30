"""The slots' KV sequences: what each holds, the pages that account for it, and which slot a
request gets (the prefix it reuses, the idle caches evicted for it).

Pure Python, like the scheduler that uses it (nano-vllm's BlockManager, vLLM's KVCacheManager).
Two layouts of llama.cpp's KV cache:

* unified: one pool of cells for all slots. A cell can belong to several sequences, so a prefix
  is shared in place (`seq_cp` costs no copy) and idle caches of every slot compete for one pool.
* per-slot: one KV stream per slot (llama.cpp's `kv_unified = false`): a ubatch attends to, and
  llama.cpp masks, only its own slot's cells. Each slot has a pool of its own; a prefix held by
  another slot is copied (llama.cpp copies a whole stream, then the tail is removed), which pays
  only for long prefixes.

Below both, an optional host-RAM tier (engine/host_cache.py) keeps the cells a slot drops.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from .host_tier import HostTier
from .kv_pool import PagePool
from .positions import kv_position
from .prefixes import longest_prefix
from .request import Request
from .slot_placement import Prefix, Slot, SlotPlacement
from .stats import CacheStats, HostCacheStats

if TYPE_CHECKING:
    from .host_cache import HostCache


class KVOps(Protocol):
    """The KV operations the scheduler asks of the runner (llama_memory_* on a real context), at KV
    positions (positions.kv_position: a token's index but after an M-RoPE image)."""

    def seq_rm(self, slot: int, start: int) -> None: ...
    def seq_cp(self, src: int, dst: int, n_tokens: int) -> None: ...
    def save(self, slot: int, max_bytes: int) -> bytes | None: ...  # None: the state is larger
    def restore(self, slot: int, data: bytes, n_tokens: int) -> None: ...
    def first_cell(self, slot: int) -> int: ...  # the sequence's lowest KV position held (-1: none)


class PrefixCache:
    """The slots and their pages. `pools` holds one PagePool for every slot (unified) or one per
    slot (per-slot streams). Which slot and prefix a request gets is SlotPlacement's choice
    (`min_copy_tokens`: how much longer a prefix in another stream must be to be copied)."""

    def __init__(self, kv: KVOps, pools: list[PagePool], clock: Callable[[], float],
                 min_copy_tokens: int = 0, reuse_compressed: bool = False, host: HostCache | None = None,
                 swa_window: int = 0) -> None:
        self.kv, self.clock, self.host = kv, clock, host
        self.swa_window = swa_window  # n_swa of a window-sized SWA cache (0: every cell is kept)
        self.tier = HostTier(kv, host) if host is not None else None
        self.reused_tokens = {"in_place": 0, "copied": 0, "restored": 0}  # prefix tokens by where they came from
        self._copying: set[int] = set()  # slots a stream copy reads or writes at the next decode
        self.slots = [Slot(i, pool) for i, pool in enumerate(pools)]
        self.pools = list({id(p): p for p in pools}.values())
        self.per_slot = len(self.pools) > 1
        self.reuse_compressed = reuse_compressed
        self.placement = SlotPlacement(self.slots, self.per_slot, min_copy_tokens, host)
        self.page_size = self.pools[0].page_size
        self.pages_for = self.pools[0].pages_for
        self.slot_capacity = self.pools[0].n_pages * self.page_size  # the most KV tokens one request can hold
        self.n_pages = sum(p.n_pages for p in self.pools)

    @property
    def used_pages(self) -> int:
        return sum(p.used_pages for p in self.pools)

    # ---- lookups -----------------------------------------------------------------------------
    def best_prefix(self, tokens: list[int]) -> tuple[Slot | None, int]:
        """The slot holding the longest prefix of `tokens` (at most len - 1: one token must run)."""
        return longest_prefix(self.slots, lambda slot: slot.tokens, tokens)

    def cached_prefix(self, tokens: list[int], settled: bool = False) -> int:
        """Tokens of `tokens` whose KV a slot or the host tier holds; `settled`: leaving out the
        slots whose request is still prefilling (what they hold grows)."""
        slots = [s for s in self.slots if not (settled and s.request is not None and s.request.prefill_left)]
        _, n = longest_prefix(slots, lambda slot: slot.tokens, tokens)
        return max(n, self.host.best(tokens)[1]) if self.host is not None else n

    def compressed_source(self, prompt: list[int]) -> Slot | None:
        """The slot whose cached compressed prompt stands for the longest prefix of `prompt` (an
        earlier turn of the same conversation, say); None if no slot holds one."""
        best: Slot | None = None
        for slot in self.slots:
            source = slot.source
            if (source is not None and len(slot.tokens) >= slot.source_len and len(source) < len(prompt)
                    and (best is None or len(source) > len(best.source or ())) and prompt[:len(source)] == source):
                best = slot
        return best

    # ---- placing a request -------------------------------------------------------------------
    def place(self, request: Request) -> bool:
        """Bind an idle slot holding the best prefix to the request (SlotPlacement's choice),
        evicting idle caches LRU until its pages fit; False (nothing changed but evictions) if they
        never do."""
        idle = [s for s in self.slots if s.request is None]
        if not idle:
            return False
        choice = self.placement.choose(request.prefill_tokens, idle, self._copying)
        if self._fit(request, choice.dst, choice.prefix, idle):
            if choice.moved is not None:  # dst holds the prefix now, and the turn after it once it
                choice.moved.last_used = -math.inf  # ends; the old copy is the first cache to give up
            return True
        return choice.fallback is not None and self._fit(request, *choice.fallback, idle)

    def _fit(self, request: Request, dst: Slot, prefix: Prefix, idle: list[Slot]) -> bool:
        """Bind `dst` with `prefix` once its pages fit, evicting other idle caches of its pool LRU;
        False if they never do."""
        if not self._in_window(prefix, dst):
            prefix = Prefix(0)
        needed = self.pages_for(request.reserve_tokens)
        peak = max(needed, self.pages_for(len(prefix.saved.tokens))) if prefix.saved else needed
        victims = sorted((s for s in idle if s is not dst and s is not prefix.slot and s.pages and s.pool is dst.pool),
                         key=lambda s: s.last_used)
        while True:
            kept = _reused_pages(dst, prefix)
            droppable = sum(1 for p in dst.pages[kept if prefix.in_place else 0:] if not dst.pool.shared(p))
            if peak - kept <= dst.pool.free_pages + droppable:
                self._bind(request, dst, prefix, needed)
                return True
            if not victims:
                return False
            self.evict(victims.pop(0))

    def _bind(self, request: Request, dst: Slot, prefix: Prefix, needed: int) -> None:
        """Give `dst` to the request with the prefix's tokens in its KV."""
        kept = _reused_pages(dst, prefix)
        self._save(dst, prefix.n if prefix.in_place else 0)
        if prefix.in_place:
            dst.pool.release(dst.pages[kept:])
            dst.pages = dst.pages[:kept]
            self.kv.seq_rm(dst.index, kv_position(dst.tokens, prefix.n))
        else:
            self.kv.seq_rm(dst.index, 0)
            dst.pool.release(dst.pages)
            dst.pages = []
            if prefix.slot is not None:
                dst.pages = dst.pool.share(prefix.slot.pages[:kept])
                self.kv.seq_cp(prefix.slot.index, dst.index, kv_position(prefix.slot.tokens, prefix.n))
                if prefix.slot.pool is not dst.pool:  # llama.cpp copies the stream's data at the next decode
                    self._copying |= {prefix.slot.index, dst.index}
            elif prefix.saved is not None and self.tier is not None:
                restored = self.tier.restore(dst.index, prefix.saved, prefix.n)
                prefix = prefix if restored else Prefix(0)
        self.reused_tokens[prefix.kind] += prefix.n
        dst.pages += dst.pool.allocate(needed - len(dst.pages))
        dst.tokens = list(request.prefill_tokens[:prefix.n])
        compressed = self.reuse_compressed and request.prefill_tokens != request.prompt_tokens
        dst.source, dst.source_len = (request.prompt_tokens, len(request.prefill_tokens)) if compressed else (None, 0)
        dst.request = request
        request.slot = dst.index
        request.cached_tokens = request.n_prefilled = prefix.n

    def _in_window(self, prefix: Prefix, dst: Slot) -> bool:
        """Whether the KV the prefix comes from (`dst`'s own, another slot's, a saved state's) can go
        on after its first `n` tokens: a window-sized SWA cache drops cells n_swa or more behind a
        sequence's end, and the token at position p attends to the cells from p - n_swa + 1
        (llama_hparams::is_masked_swa), so they must all be there (llama-server checks seq_pos_min
        likewise, a cell or two stricter). A saved state's first cell was read when it was saved:
        one that cannot serve is never copied back."""
        if not self.swa_window or prefix.n == 0:
            return True
        tokens: Sequence[int]
        if prefix.saved is not None:
            first, tokens = prefix.saved.first_cell, prefix.saved.tokens
        else:
            holder = prefix.slot or dst
            first, tokens = self.kv.first_cell(holder.index), holder.tokens
        return 0 <= first <= max(0, kv_position(tokens, prefix.n) - self.swa_window + 1)

    # ---- giving back -------------------------------------------------------------------------
    def release(self, slot: Slot, forget_kv: bool) -> None:
        """The slot's request ended: its KV stays as a prefix cache (its reserve beyond the tokens
        written is freed) unless `forget_kv`."""
        slot.request = None
        slot.last_used = self.clock()
        keep = self.pages_for(len(slot.tokens))
        slot.pool.release(slot.pages[keep:])
        slot.pages = slot.pages[:keep]
        if forget_kv:  # a failed decode left the cells unknown: nothing to save
            self._drop(slot)

    def trim(self, slot: Slot) -> None:
        """Drop whatever the KV holds past the slot's known tokens (an aborted or dropped write)."""
        self.kv.seq_rm(slot.index, kv_position(slot.tokens, len(slot.tokens)))

    def evict(self, slot: Slot) -> None:
        """Free the slot's cells, saved first to the host tier if it has one."""
        self._save(slot, 0)
        self._drop(slot)

    def _drop(self, slot: Slot) -> None:
        self.kv.seq_rm(slot.index, 0)
        slot.pool.release(slot.pages)
        slot.pages, slot.tokens, slot.source = [], [], None

    def _save(self, slot: Slot, keep: int) -> None:
        """Save the slot's cells to the host tier before those past `keep` are dropped (not while a
        stream copy llama.cpp has not made yet is due to write them)."""
        if self.tier is not None and slot.index not in self._copying:
            self.tier.save(slot.index, slot.tokens, keep)

    def copying(self, slot: Slot) -> bool:
        """A stream copy that llama.cpp makes at the next decode reads or writes the slot."""
        return slot.index in self._copying

    def decoded(self) -> None:
        """A decode ran: llama.cpp made the stream copies it owed."""
        self._copying.clear()

    def clear(self) -> None:
        """Drop every idle cache and the host tier (a run that must start from scratch)."""
        for slot in [s for s in self.slots if s.request is None and s.pages]:
            self._drop(slot)
        if self.host is not None:
            self.host.clear()

    def evict_idle(self) -> int:
        """Free every idle cache (after llama.cpp reported no free cells despite our accounting);
        returns how many slots had one."""
        idle = [s for s in self.slots if s.request is None and s.pages]
        for slot in idle:
            self.evict(slot)
        return len(idle)

    # ---- reporting ---------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """The KV's part of the engine's stats."""
        running = [s for s in self.slots if s.request is not None]
        # a page is shared only within one pool: per slot, a running slot's pages are its own
        active = sum(len(s.pages) for s in running) if self.per_slot else len({p for s in running for p in s.pages})
        host = (HostCacheStats(len(self.host), self.host.bytes_used, self.host.capacity_bytes, self.host.saved)
                if self.host is not None else None)
        return CacheStats(
            kv_layout="per_slot" if self.per_slot else "unified",
            kv_pages_used=self.used_pages,
            kv_pages_active=active,
            kv_pages_total=self.n_pages,
            kv_page_size=self.page_size,
            prefix_cache_tokens=sum(len(s.tokens) for s in self.slots if s.request is None),
            prefix_reused_tokens=dict(self.reused_tokens),
            host=host,
        )


def _reused_pages(dst: Slot, prefix: Prefix) -> int:
    """Pages `dst` keeps (in place) or shares (from a slot in the same pool) for the prefix; a
    prefix copied from another stream or restored takes fresh pages.

    Only whole pages are shared; in place, a partial last page is kept unless another slot
    shares it (then its new tokens get new cells: copy-on-write)."""
    if not prefix.in_place:
        return prefix.n // dst.pool.page_size if prefix.slot is not None and prefix.slot.pool is dst.pool else 0
    keep = dst.pool.pages_for(prefix.n)
    if prefix.n % dst.pool.page_size and dst.pool.shared(dst.pages[keep - 1]):
        keep -= 1
    return keep
