"""How much of a prompt the tokens some holder keeps can serve: shared by the slots' prefix cache
and its host-RAM tier."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence, TypeVar

from .positions import whole_media


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` share. Blocks compare as slices (in C), doubling from 16
    tokens, and tokens one by one only in the block where they differ: requests waiting for a
    shared prefill compare their prompts with the running ones at every admission (4K shared
    tokens: ~20 us, not ~130)."""
    n = min(len(a), len(b))
    i, block = 0, 16
    while i < n:
        j = min(i + block, n)
        if a[i:j] != b[i:j]:  # or only their types differ (a tuple and a list)
            while i < j and a[i] == b[i]:
                i += 1
            if i < j:
                return i
        i, block = j, min(2 * block, 1024)
    return n


def reusable(held: Sequence[int], tokens: Sequence[int]) -> int:
    """Tokens of `tokens` whose KV cells holding `held` can serve: their common prefix, short of
    the last token (one token must run to give the next one's logits), and never part of an
    M-RoPE image (positions.whole_media)."""
    return whole_media(tokens, min(common_prefix(held, tokens), len(tokens) - 1))


Holder = TypeVar("Holder")


def longest_prefix(holders: Iterable[Holder], held: Callable[[Holder], Sequence[int]],
                   tokens: Sequence[int]) -> tuple[Holder | None, int]:
    """The first of `holders` whose `held` tokens serve the most of `tokens` (`reusable`), and how
    many; None and 0 when none serves any."""
    best, best_len = None, 0
    for holder in holders:
        n = reusable(held(holder), tokens)
        if n > best_len:
            best, best_len = holder, n
    return best, best_len
