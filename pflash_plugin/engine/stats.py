"""What an engine says of itself: one frozen record per round (the scheduler's and the KV's part),
built on the engine thread and read as it is by /status, /metrics and the start-up summary (vLLM's
SchedulerStats). `as_dict` is the /status JSON shape, which docs/api.md and the tests read."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping


def rounded(record: Any) -> dict[str, Any]:
    """A dataclass of counters as /status shows it: its fields, seconds to the microsecond."""
    return {key: round(value, 6) if isinstance(value, float) else value for key, value in asdict(record).items()}


@dataclass(frozen=True)
class SlotStats:
    id: int
    state: str  # idle | prefill | decode
    request_id: int | None
    kv_tokens: int
    kv_pages: int


@dataclass(frozen=True)
class CompressingStats:
    request_id: int
    prompt_tokens: int
    drafted_tokens: int


@dataclass(frozen=True)
class HostCacheStats:
    """The host-RAM tier of saved sequences (--cache)."""

    entries: int
    bytes: int
    capacity_bytes: int
    saved: int


@dataclass(frozen=True)
class CacheStats:
    """The KV's part: the pool's pages, the idle slots' prefix caches, the host tier."""

    kv_layout: str  # per_slot | unified
    kv_pages_used: int
    kv_pages_active: int  # held by requests in slots; the rest of the used are idle caches
    kv_pages_total: int
    kv_page_size: int
    prefix_cache_tokens: int
    prefix_reused_tokens: Mapping[str, int]  # since start: in_place, copied, restored
    host: HostCacheStats | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kv_layout": self.kv_layout, "kv_pages_used": self.kv_pages_used, "kv_pages_active": self.kv_pages_active,
            "kv_pages_total": self.kv_pages_total, "kv_page_size": self.kv_page_size,
            "prefix_cache_tokens": self.prefix_cache_tokens, "prefix_reused_tokens": dict(self.prefix_reused_tokens)}
        if self.host is not None:
            out.update(host_cache_entries=self.host.entries, host_cache_bytes=self.host.bytes,
                       host_cache_capacity_bytes=self.host.capacity_bytes, host_cache_saved=self.host.saved)
        return out


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding since start (engine/speculation): draft tokens verified and accepted;
    decode rows and the tokens they took (tokens / rows: tokens per row per step)."""

    drafted: int
    accepted: int
    rows: int
    tokens: int
    speculating_rows: int  # rows that carried drafts
    # where the time went (speculation/budget.py): steps with drafts, the plain steps right after them
    # (their shape change paid back), other steps; episodes of drafting begun (probes); the drafted and
    # settle steps' measured excess over plain steps of as many rows, and what accepted tokens left unpaid
    draft_steps: int = 0
    draft_step_seconds: float = 0.0
    settle_steps: int = 0
    settle_step_seconds: float = 0.0
    plain_steps: int = 0
    plain_step_seconds: float = 0.0
    probes: int = 0
    excess_seconds: float = 0.0
    unpaid_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**rounded(self), "tokens_per_row_step": round(self.tokens / self.rows, 4) if self.rows else 0.0}


@dataclass(frozen=True)
class SchedulerStats:
    slots: tuple[SlotStats, ...]
    running: int
    waiting: int  # queued for a slot, prepared ones included
    compressing: tuple[CompressingStats, ...]
    waiting_prepared: int
    cache: CacheStats
    steps: int = field(default=0)  # decode steps the engine ran (0 from a scheduler alone)
    speculation: SpeculationStats | None = None  # None: the engine does not speculate

    @property
    def kv_pages_held_by_caches(self) -> int:
        """Pages only idle slots' prefix caches hold (evicted when needed)."""
        return self.cache.kv_pages_used - self.cache.kv_pages_active

    def as_dict(self) -> dict[str, Any]:
        """The /status shape of one model's engine part."""
        return {
            "slots": [asdict(slot) for slot in self.slots],
            "running": self.running,
            "waiting": self.waiting,
            "compressing": [asdict(job) for job in self.compressing],
            "waiting_prepared": self.waiting_prepared,
            **self.cache.as_dict(),
            "steps": self.steps,
            **({"speculation": self.speculation.as_dict()} if self.speculation else {}),
        }
