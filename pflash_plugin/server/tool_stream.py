"""Tool calls streamed as OpenAI streams them: a call's index, id, type and name as soon as its
name is written, then its arguments' JSON text as it arrives.

The scanner reads the calls' text (tools.py captures it from the first marker on) character by
character: every JSON object at the top level is a call, whatever surrounds it (`<tool_call>` tags,
`[TOOL_CALLS]`, an array's brackets, `;`); in it, the strings followed by `:` are its keys. Arguments
written as a JSON string (some models do) are sent once the string ends, decoded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable


@dataclass
class _Call:
    index: int = -1  # set once the header is sent
    key: str | None = None  # the key whose value comes next
    name: str | None = None
    args_start: int = -1  # where the arguments' text starts in the capture
    args_end: int = -1  # where it ends, once it has
    args_string: bool = False  # written as a JSON string
    sent: int = 0  # characters of the arguments sent


class CallScanner:
    """Turns the growing text of the calls into OpenAI tool-call deltas."""

    def __init__(self, args_keys: tuple[str, ...], call_id: Callable[[], str], parallel: bool) -> None:
        self.args_keys, self.call_id, self.parallel = args_keys, call_id, parallel
        self.text = ""
        self.pos = 0
        self.depth = 0  # of braces
        self.in_string = self.escape = False
        self.string_start = 0
        self.last_string: tuple[int, int] | None = None  # a string just closed at depth 1: maybe a key
        self.call: _Call | None = None  # the call object being read
        self.started = 0  # calls whose header was sent

    def feed(self, text: str) -> list[dict]:
        """The deltas that `text`, the whole capture so far, adds."""
        self.text = text
        deltas: list[dict] = []
        while self.pos < len(text):
            self._step(text[self.pos], self.pos, deltas)
            self.pos += 1
        if self.call is not None:
            deltas += self._arguments(self.call)
        return deltas

    def _step(self, c: str, i: int, deltas: list[dict]) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                self._string_closed(self.string_start, i + 1, deltas)
            return
        call = self.call
        if c == '"':
            self.in_string, self.string_start = True, i
            if call is not None and self.depth == 1 and call.key in self.args_keys and call.args_start < 0:
                call.args_start, call.args_string = i, True
        elif c == "{":
            self.depth += 1
            if self.depth == 1:
                self.call = _Call()
            elif self.depth == 2 and call is not None and call.key in self.args_keys and call.args_start < 0:
                call.args_start = i
        elif c == "}" and self.depth > 0:
            self.depth -= 1
            if call is not None and self.depth == 1 and call.args_start >= 0 and call.args_end < 0:
                call.args_end = i + 1
            if self.depth == 0 and call is not None:
                deltas += self._arguments(call)
                self.call = None
        elif c == ":" and self.depth == 1 and call is not None and self.last_string is not None:
            call.key = self._decoded(*self.last_string)
        elif c == "," and self.depth == 1 and call is not None:
            call.key = None
        if not c.isspace() and c != '"':
            self.last_string = None

    def _string_closed(self, start: int, end: int, deltas: list[dict]) -> None:
        call = self.call
        if call is None or self.depth != 1:
            return
        self.last_string = (start, end)
        if call.key == "name" and call.name is None:
            call.name = self._decoded(start, end)
            call.key = None
            deltas += self._header(call)
        elif call.key in self.args_keys and call.args_string and call.args_end < 0:
            call.args_end = end

    def _decoded(self, start: int, end: int) -> str | None:
        try:
            value = json.loads(self.text[start:end])
        except ValueError:
            return None
        return value if isinstance(value, str) else None

    def _header(self, call: _Call) -> list[dict]:
        if call.name is None or (self.started and not self.parallel):
            return []
        call.index, self.started = self.started, self.started + 1
        return [{"index": call.index, "id": self.call_id(), "type": "function",
                 "function": {"name": call.name, "arguments": ""}}]

    def _arguments(self, call: _Call) -> list[dict]:
        """The arguments' text not sent yet: an object's as it comes, a string's once it ends."""
        if call.index < 0 or call.args_start < 0:
            return []
        if call.args_string:
            if call.args_end < 0 or call.sent:
                return []
            fragment = self._decoded(call.args_start, call.args_end) or ""
            call.sent = call.args_end - call.args_start
        else:
            end = call.args_end if call.args_end >= 0 else len(self.text)
            fragment = self.text[call.args_start + call.sent:end]
            call.sent = end - call.args_start
        return [{"index": call.index, "function": {"arguments": fragment}}] if fragment else []
