"""SlotPlacement's choice of slot and prefix, driven with plain slots and pools (no model, no KV)."""
from __future__ import annotations

from pflash_plugin.engine.kv_pool import PagePool
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.engine.slot_placement import Slot, SlotPlacement

PROMPT = list(range(100, 140))


def slots(n: int, per_slot: bool) -> list[Slot]:
    shared = PagePool(64, 16)
    return [Slot(i, PagePool(16, 16) if per_slot else shared) for i in range(n)]


def running(slot: Slot) -> None:
    slot.request = Request([1, 2], SamplingParams(max_tokens=1))


def test_the_idle_slot_holding_the_longest_prefix_reuses_it_in_place() -> None:
    s = slots(4, per_slot=False)
    s[1].tokens, s[2].tokens = PROMPT[:10], PROMPT[:30]
    choice = SlotPlacement(s, per_slot=False, min_copy_tokens=0, host=None).choose(PROMPT, s, set())
    assert choice.dst is s[2] and choice.prefix.in_place and choice.prefix.n == 30
    assert choice.fallback is None and choice.moved is None


def test_a_prefix_in_another_stream_is_copied_only_when_it_is_min_copy_tokens_longer() -> None:
    s = slots(4, per_slot=True)
    running(s[0])
    s[0].tokens = PROMPT[:30]  # the prefix is held by a running slot's stream
    idle = s[1:]
    short = SlotPlacement(s, per_slot=True, min_copy_tokens=31, host=None).choose(PROMPT, idle, set())
    assert short.prefix.in_place and short.prefix.n == 0
    long = SlotPlacement(s, per_slot=True, min_copy_tokens=20, host=None).choose(PROMPT, idle, set())
    assert long.prefix.slot is s[0] and long.prefix.n == 30
    assert long.dst is s[1], "a copied prefix goes beside the running slot"


def test_a_chat_cached_in_a_lone_slot_moves_beside_the_running_ones() -> None:
    s = slots(6, per_slot=True)
    running(s[0])
    s[4].tokens = PROMPT[:30]  # the conversation's last turn, two slots away from anything running
    choice = SlotPlacement(s, per_slot=True, min_copy_tokens=20, host=None).choose(PROMPT, s[1:], set())
    assert choice.dst is s[1] and choice.prefix.slot is s[4] and choice.moved is s[4]
    assert choice.fallback is not None and choice.fallback[0] is s[4] and choice.fallback[1].n == 30
    # a stream copy not made yet on the cached slot: it stays where it is
    pending = SlotPlacement(s, per_slot=True, min_copy_tokens=20, host=None).choose(PROMPT, s[1:], {4})
    assert pending.dst is s[4] and pending.prefix.in_place and pending.moved is None
