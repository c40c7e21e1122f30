"""Finding the question and the system prompt in a tokenized prompt."""
from __future__ import annotations

import random

import pytest

from pflash_plugin.pflash.query import PromptBytes


def scan_locate(pieces: list[bytes], text: str) -> tuple[int, int] | None:
    """The per-token scan that PromptBytes replaced: the tokens overlapping the last match."""
    joined, needle = b"".join(pieces), text.encode()
    at = joined.rfind(needle) if needle else -1
    if at < 0:
        return None
    start = end = None
    offset = 0
    for i, piece in enumerate(pieces):
        if start is None and offset + len(piece) > at:
            start = i
        offset += len(piece)
        if offset >= at + len(needle):
            end = i + 1
            break
    return start, end


@pytest.mark.parametrize("block", [1, 3, 256])
@pytest.mark.parametrize("seed", range(100))
def test_locate_matches_a_token_scan(seed: int, block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PromptBytes, "BLOCK", block)
    rng = random.Random(seed)
    vocabulary = [b"", b"a", b"b", b" ab", b"ba", b"\n", b"\xc3", b"\xa9", b"\xc3\xa9", b"abba"]
    pieces = [rng.choice(vocabulary) for _ in range(rng.randint(0, 600))]
    text = b"".join(pieces).decode("utf-8", errors="replace")
    i = rng.randint(0, len(text))
    needle = text[i : i + rng.randint(0, 40)] if rng.random() < 0.8 else "zz"
    assert PromptBytes(pieces).locate(needle) == scan_locate(pieces, needle)


def test_locate_covers_partial_tokens_of_the_last_match() -> None:
    pieces = [b"<s>", b"Who", b" wrote", b" it?", b" Who", b" wrote", b" it", b"?</s>"]
    assert PromptBytes(pieces).locate("rote it?") == (5, 8)
    assert PromptBytes(pieces).locate("") is None
    assert PromptBytes(pieces).locate("whom") is None
