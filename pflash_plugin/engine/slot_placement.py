"""Which idle slot a request gets and which prefix it reuses there: a policy over the slots' tokens
and neighbours that decides, apart from the PrefixCache that binds pages and KV (SGLang's
SchedulePolicy beside its tree cache). Pure Python: a test drives it with plain slots and pools."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .kv_pool import PagePool
from .prefixes import reusable
from .request import Request

if TYPE_CHECKING:
    from .host_cache import HostCache, Saved


@dataclass
class Slot:
    index: int
    pool: PagePool  # where its pages come from: every slot's one pool, or its stream's own
    tokens: list[int] = field(default_factory=list)  # what its KV sequence holds
    pages: list[int] = field(default_factory=list)
    request: Request | None = None
    last_used: float = 0.0
    # the client's prompt whose compressed form is tokens[:source_len] (PFlash), while it is cached:
    # a later prompt that extends it reuses those cells instead of being compressed again
    source: list[int] | None = None
    source_len: int = 0


@dataclass(frozen=True)
class Prefix:
    """The prefix a request reuses: `n` tokens in place, or from another slot, or a saved state."""

    n: int
    slot: Slot | None = None
    saved: Saved | None = None

    @property
    def in_place(self) -> bool:
        return self.slot is None and self.saved is None

    @property
    def kind(self) -> str:
        return "in_place" if self.in_place else "copied" if self.slot is not None else "restored"


@dataclass(frozen=True)
class Placement:
    """Where a request goes: `dst` with `prefix`; `fallback` (in place, the slot's own prefix) when
    that never fits beside the running requests; `moved`: the slot whose prefix was copied away,
    the first cache to give up once the placement binds."""

    dst: Slot
    prefix: Prefix
    fallback: tuple[Slot, Prefix] | None = None
    moved: Slot | None = None


class SlotPlacement:
    """A prefix held by another slot's stream is copied only when it is at least `min_copy_tokens`
    longer than what the chosen slot reuses in place (a stream copy moves the whole stream); a saved
    state is restored when it is the host tier's `min_tokens` longer."""

    def __init__(self, slots: list[Slot], per_slot: bool, min_copy_tokens: int, host: HostCache | None) -> None:
        self.slots, self.per_slot, self.min_copy_tokens, self.host = slots, per_slot, min_copy_tokens, host

    def choose(self, tokens: list[int], idle: list[Slot], copying: set[int]) -> Placement:
        """The idle slot and prefix for a request's prefill `tokens`; `copying`: slots a stream copy
        llama.cpp has not made yet reads or writes."""
        usable = [reusable(slot.tokens, tokens) for slot in self.slots]  # by slot index
        # in place: the idle slot with the longest prefix (where it would decode as a run of its own,
        # only a prefix worth a stream copy beside the running slots counts); on a tie one beside
        # running slots, then an empty one (no cache lost), then the least recently used
        lone = self.lone_runs_move(idle, copying)

        def counted(s: Slot) -> int:
            n = usable[s.index]
            return n if not lone or n >= self.min_copy_tokens or self.beside_running(s) else 0

        in_place = max(idle, key=lambda s: (counted(s), self.beside_running(s), not s.tokens, -s.last_used))
        own = Prefix(usable[in_place.index])
        prefix = self.best_source(tokens, in_place, own.n, usable)
        if lone and prefix.in_place and own.n >= max(self.min_copy_tokens, 1) and not self.beside_running(in_place) \
                and in_place.index not in copying:
            prefix = Prefix(own.n, slot=in_place)  # copied beside the running slots; in_place keeps its cache
        # a prefix from elsewhere goes beside running slots, else into an empty or the least recently
        # used idle slot; a restore or a moved prefix never into one whose stream a copy llama.cpp
        # has not made yet reads or writes
        careful = prefix.saved is not None or prefix.slot is in_place
        targets = [s for s in idle if s is not prefix.slot and not (careful and s.index in copying)]
        if not targets:
            prefix = own
        dst = in_place if prefix.in_place else min(
            targets, key=lambda s: (-self.beside_running(s), bool(s.tokens), s.last_used))
        # a restore writes the whole saved sequence before its tail is trimmed, a moved prefix takes
        # pages of another stream: if that never fits beside the running requests, reuse in place
        risky = prefix.saved is not None or prefix.slot is in_place
        return Placement(dst, prefix, fallback=(in_place, own) if risky else None,
                         moved=in_place if prefix.slot is in_place else None)

    def lone_runs_move(self, idle: list[Slot], copying: set[int]) -> bool:
        """Whether a request whose slot has no running neighbour goes beside the running slots
        instead (per-slot streams, something running, an idle slot beside it that no stream copy
        is due on): there it adds no ubatch, where a run of its own adds a pass over all the
        weights to every step it decodes beside the others. A chat's next turn finds its cache in
        its last slot, wherever that is: a prefix worth a stream copy is copied across (the copy
        costs once what a few prompt tokens do: demo model, 2 CPU cores, a 5,120-cell stream as
        12-22 tokens), a shorter one is prefilled there."""
        return self.per_slot and any(s.request is not None for s in self.slots) and any(
            self.beside_running(s) and s.index not in copying for s in idle)

    def beside_running(self, slot: Slot) -> int:
        """How many of `slot`'s two neighbours hold a request, with a KV stream per slot (else 0).
        There llama.cpp splits a batch into one ubatch per run of consecutive sequences
        (`split_equal(sequential)`), and each ubatch reads all the weights again. On an H200, 8
        clients ran 902 tok/s on a fresh server (slots 0-7) and 278 once every slot held a cache
        (scattered LRU picks); bench/slot_placement.py: 7 runs took 1.6x as long a step as 1 on the
        CPU. A slot beside a run adds no ubatch; one between two runs saves one."""
        if not self.per_slot:
            return 0
        return sum(1 for i in (slot.index - 1, slot.index + 1)
                   if 0 <= i < len(self.slots) and self.slots[i].request is not None)

    def best_source(self, tokens: list[int], in_place: Slot, own: int, usable: list[int]) -> Prefix:
        """The longest prefix for `tokens`: `in_place`'s own `own` tokens, another slot's (`usable`
        of each slot; shared in one pool, copied across streams only when it is min_copy_tokens
        longer), or a saved state's (restored when it is the host tier's min_tokens longer)."""
        best = Prefix(own)
        n = max(usable)
        src = self.slots[usable.index(n)] if n > 0 else None  # the first longest, as best_prefix
        if src is not None and src is not in_place:
            copied = src.pool is not in_place.pool  # across streams: a copy of the whole stream
            if n - own >= max(self.min_copy_tokens if copied else 0, 1):
                best = Prefix(n, slot=src)
        if self.host is not None:
            saved, n = self.host.best(tokens)
            if saved is not None and n - best.n >= max(self.host.min_tokens, 1):
                best = Prefix(n, saved=saved)
        return best
