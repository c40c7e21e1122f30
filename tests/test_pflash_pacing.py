"""The drafting rule (pflash/pacing.py) with an injected clock: polite beside the slots until the
prompt has waited its bound, then as if alone, so a handed-off prompt's wait is bounded however long
its neighbours decode."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pflash_plugin.pflash.pacing import ALONE, SHARED_CHUNK, Pacing, Turn


def neighbours(waiting: bool, decoding: bool) -> SimpleNamespace:
    return SimpleNamespace(interactive_waiting=lambda: waiting, slots_decoding=lambda: decoding)


def test_polite_within_the_bound_then_alone():
    now = [0.0]
    pacing = Pacing(neighbours(True, True), started=0.0, bound_s=2.0, duty=0.5, clock=lambda: now[0])
    assert pacing.turn() == Turn(SHARED_CHUNK, 0.5) and pacing.stepping_aside()
    now[0] = 1.99
    assert pacing.turn() == Turn(SHARED_CHUNK, 0.5) and pacing.polite() and pacing.stepping_aside()
    now[0] = 2.0
    assert pacing.turn() == ALONE and not pacing.polite() and not pacing.stepping_aside()
    quiet = Pacing(neighbours(False, False), started=0.0, clock=lambda: 0.0)
    assert quiet.turn() == ALONE and quiet.polite() and not quiet.stepping_aside()
    assert pacing.lane(0.125).duty == 0.125 and pacing.lane(0.125).started == pacing.started


@pytest.mark.parametrize("decoding_s", [5.0, 60.0])
def test_a_draft_beside_long_decodes_finishes_within_the_bound(decoding_s):
    """Two slots decode for `decoding_s` (a decode step every 20 ms, during which requests count as
    waiting half the time); the draft needs 160 chunks of 2 ms alone. Its end comes by the bound
    plus its own time, whatever `decoding_s` is."""
    now = [0.0]
    state = SimpleNamespace(
        interactive_waiting=lambda: now[0] < decoding_s and (now[0] * 50) % 1 < 0.5,
        slots_decoding=lambda: now[0] < decoding_s)
    pacing = Pacing(state, started=0.0, bound_s=2.0, duty=0.5, clock=lambda: now[0])
    tokens, chunk_cost = 160 * 512, 0.002
    while tokens > 0:
        while pacing.stepping_aside():
            now[0] += 0.005
        turn = pacing.turn()
        size = min(turn.chunk or 2048, tokens)
        cost = chunk_cost * size / 512
        now[0] += cost + cost * (1.0 / turn.duty - 1.0)
        tokens -= size
    assert now[0] <= 2.0 + 160 * chunk_cost + 0.05
