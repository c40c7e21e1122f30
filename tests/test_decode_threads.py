"""The decode-step thread count: both candidates measured, the faster taken, the other probed."""
from __future__ import annotations

from pflash_plugin.engine.threads import DecodeThreads


def run(chooser: DecodeThreads, tokens: int, seconds: dict[int, float], steps: int) -> list[int]:
    """`steps` decode steps whose time depends on their thread count; the counts chosen."""
    chosen = []
    for _ in range(steps):
        threads = chooser.threads(tokens)
        chooser.record(threads, tokens, seconds[threads])
        chosen.append(threads)
    return chosen


def test_both_counts_are_measured_then_the_faster_is_taken_and_the_other_probed():
    chooser = DecodeThreads(narrow=1, wide=2, probe_every=8)
    chosen = run(chooser, 4, {1: 0.064, 2: 0.036}, 24)  # idle: the wide count wins
    assert chosen[:2] == [2, 1]
    assert chosen.count(1) == 1 + 3  # the first measurement, then a probe every 8th step
    assert all(c == 1 for i, c in enumerate(chosen, 1) if i % 8 == 0)


def test_a_load_that_slows_the_wide_count_moves_steps_to_the_narrow_one_and_back():
    chooser = DecodeThreads(narrow=1, wide=2, probe_every=8, window=3)
    run(chooser, 4, {1: 0.064, 2: 0.036}, 16)
    busy = run(chooser, 4, {1: 0.067, 2: 0.149}, 32)  # a neighbour takes a core
    assert busy[-8:].count(1) == 7, busy  # narrow, but for the probe of the wide count
    idle = run(chooser, 4, {1: 0.064, 2: 0.036}, 64)
    assert idle[-8:].count(2) == 7, idle  # wide again once its probes show it faster


def test_token_counts_are_measured_apart():
    chooser = DecodeThreads(narrow=1, wide=2, probe_every=100)
    run(chooser, 8, {1: 0.120, 2: 0.060}, 4)
    assert chooser.threads(8) == 2
    assert chooser.threads(2) == 2 and chooser.threads(2) == 2  # nothing measured for 2 tokens yet: wide first


def test_equal_counts_leave_nothing_to_choose():
    chooser = DecodeThreads(narrow=2, wide=2, probe_every=2)
    assert run(chooser, 4, {2: 0.05}, 6) == [2] * 6
