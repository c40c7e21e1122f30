"""Incremental detokenization with stop strings.

Token pieces are bytes and a UTF-8 character may span tokens, and a stop string may span tokens
too: text is released only once it is valid UTF-8 and can no longer be the start of a stop string.

Each stop string is matched as the text arrives (Knuth-Morris-Pratt: per stop, the length of the
longest suffix of the text so far that starts it), so a push costs time linear in its new text
times the number of stops, whatever their length; the server caps both (server/wire/protocol.py).
"""
from __future__ import annotations


class StopMatcher:
    """One stop string and how much of it the text seen so far ends with."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        self._fallback = _prefix_function(stop)

    def feed(self, text: str) -> bool:
        """Advance over `text`; True once the stop string has occurred."""
        stop, matched = self.stop, self.matched
        for char in text:
            while matched and stop[matched] != char:
                matched = self._fallback[matched - 1]
            if stop[matched] == char:
                matched += 1
                if matched == len(stop):
                    self.matched = matched
                    return True
        self.matched = matched
        return False


def _prefix_function(s: str) -> list[int]:
    """Per prefix s[:i + 1], the length of its longest proper prefix that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


class TextStream:
    def __init__(self, stop: list[str], kept: frozenset[str] = frozenset()) -> None:
        """`kept`: the stop strings that stay at the end of the text (vLLM's include_stop_str_in_output)."""
        self._stops = [StopMatcher(s) for s in dict.fromkeys(s for s in stop if s)]
        self._kept = kept
        self._bytes = b""
        self._held = ""  # the text that may start a stop string: at most the longest stop's length
        self.stop_hit: str | None = None  # the stop string that ended the text, once one has

    @property
    def stopped(self) -> bool:
        return self.stop_hit is not None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is safe to emit now."""
        self._bytes += piece
        text, self._bytes = _decode_complete(self._bytes)
        held = self._held + text
        if any([stop.feed(text) for stop in self._stops]):  # every matcher sees the text
            self._held = ""
            found = ((held.find(matcher.stop), matcher.stop) for matcher in self._stops)
            cut, self.stop_hit = min((at, stop) for at, stop in found if at >= 0)
            return held[:cut + len(self.stop_hit)] if self.stop_hit in self._kept else held[:cut]
        keep = max((stop.matched for stop in self._stops), default=0)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep]

    def flush(self) -> str:
        """The generation ended without a stop string: release what was held back."""
        out = self._held + self._bytes.decode("utf-8", errors="replace")
        self._held, self._bytes = "", b""
        return out


def _decode_complete(data: bytes) -> tuple[str, bytes]:
    """Decode the longest prefix that does not end inside a UTF-8 sequence."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError as error:
            if error.reason != "unexpected end of data" and cut == len(data):
                # invalid bytes in the middle: replace them rather than hold forever
                return data.decode("utf-8", errors="replace"), b""
    return data.decode("utf-8", errors="replace"), b""
