"""Incremental detokenization with stop strings.

Token pieces are bytes and a UTF-8 character may span tokens, and a stop string may span tokens
too: text is released only once it is valid UTF-8 and can no longer be the start of a stop string.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, stop: list[str]) -> None:
        self._stop = [s for s in stop if s]
        self._bytes = b""
        self._held = ""
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is safe to emit now."""
        self._bytes += piece
        text, self._bytes = _decode_complete(self._bytes)
        self._held += text
        cut = min((i for i in (self._held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._held = self._held[:cut], ""
            return out
        keep = _longest_stop_prefix_suffix(self._held, self._stop)
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return out

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


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
