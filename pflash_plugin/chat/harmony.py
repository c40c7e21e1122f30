"""gpt-oss's harmony format read as it streams: the answer is a run of messages, each a header
(`<|channel|>NAME ...<|message|>`, after `<|start|>assistant` from the second on) and a body ended by
`<|end|>` (or the next `<|start|>`); the `analysis` channel is reasoning, the others content.

llama.cpp loads `<|channel|>`, `<|message|>`, `<|start|>` and, where `<|return|>` and `<|call|>` end
the text, `<|end|>` as user-defined tokens (llama-vocab.cpp's gpt-oss case), so their text reaches the
reader. A call on the commentary channel (` to=functions.NAME`) is content here, header included,
for a tool-call reader to read. Cost: O(1) per character (at most a marker's length or a header is
held back).
"""
from __future__ import annotations

from typing import Literal

from .deltas import Delta, ReasoningDelta, TextDelta

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
HEADER_MAX = 256  # a header longer than this is no header: the text is content
_BREAKS = (END, START, CHANNEL)  # what ends a message's body


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that starts one of `markers`."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[len(text) - k:]) for m in markers):
            return k
    return 0


class HarmonyReader:
    """One choice's harmony text in, reasoning and content deltas out (ReasoningReader's interface)."""

    def __init__(self) -> None:
        self.state: Literal["header", "body"] = "header"
        self.kind: Literal["reasoning", "content", "unknown"] = "unknown"  # the channel of the body
        self.held = ""  # a header so far, or the end of a body that may start a marker
        self.tokens = 0  # the reasoning's tokens: of texts read in an analysis header or body
        self._undecided = 0  # tokens of a header not yet known to open analysis

    @property
    def thinking(self) -> bool:
        return self.kind == "reasoning"

    def feed(self, text: str, tokens: int = 0) -> list[Delta]:
        """The deltas of `text`, the next text of the choice; `tokens`: how many tokens it came from."""
        thinking = self.kind == "reasoning" and self.state == "body"
        out: list[Delta] = []
        while text:
            text = self._header(text, out) if self.state == "header" else self._body(text, out)
        if thinking or any(isinstance(d, ReasoningDelta) for d in out):
            self.tokens += self._undecided + tokens
            self._undecided = 0
        elif self.state == "header":
            self._undecided += tokens
        else:
            self._undecided = 0
        return out

    def finish(self) -> list[Delta]:
        """The end of the text: a header never finished, or a marker's start, is what it was read as."""
        held, self.held = self.held, ""
        if not held or self.state == "header" and held.startswith((START, CHANNEL, "assistant")):
            return []  # the start of a message that never came
        return [ReasoningDelta(held) if self.kind == "reasoning" else TextDelta(held)]

    def _header(self, text: str, out: list[Delta]) -> str:
        """A message's header: the text after it, once it is whole (a call's header is content)."""
        held = self.held + text
        at = held.find(MESSAGE)
        if at >= 0:
            header, self.held, self.state = held[:at], "", "body"
            channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
            call = " to=" in header
            self.kind = "reasoning" if channel.split(" ")[0] == "analysis" and not call else "content"
            if call:
                out.append(TextDelta(held[:at + len(MESSAGE)]))
            return held[at + len(MESSAGE):]
        head = held.lstrip()
        if len(held) <= HEADER_MAX and (head.startswith((START, CHANNEL, "assistant")) or
                                        any(m.startswith(head) for m in (START, CHANNEL, "assistant"))):
            self.held = held
            return ""
        self.held, self.state, self.kind = "", "body", "content"  # no header: plain text
        return held

    def _body(self, text: str, out: list[Delta]) -> str:
        pending = self.held + text
        found = [(at, m) for m in _BREAKS if (at := pending.find(m)) >= 0]
        if found:
            at, marker = min(found)
            self.held = ""
            self._emit(pending[:at], out)
            self.state = "header"
            return pending[at + len(END):] if marker == END else pending[at:]
        keep = _partial(pending, _BREAKS)
        self.held = pending[len(pending) - keep:]
        self._emit(pending[:len(pending) - keep], out)
        return ""

    def _emit(self, text: str, out: list[Delta]) -> None:
        if text:
            out.append(ReasoningDelta(text) if self.kind == "reasoning" else TextDelta(text))
