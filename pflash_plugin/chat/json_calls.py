"""The reading of the calls' text, streamed or whole, as OpenAI streams tool calls: a call's index,
id, type and name once the call is known to be one, then its arguments' JSON text as it arrives.

The scanner reads the calls' text (tool_calls.py captures it from the first marker on, and hands on each
next piece) character by character, and the same scanner decides the calls of a whole reply, so
that both ways agree. Once a call was found, the text nothing refers to any more is dropped (the
arguments are kept as the fragments sent): a token costs O(1) however long the calls. The
text is a run of JSON call objects and the syntax's tokens between them (`<tool_call>` tags,
`[TOOL_CALLS]`, an array's brackets, `;`). An object is a call once its `name` is one of the tools
(any string when the tools are not known) and its arguments (`arguments` or `parameters`) have
started as an object, or ended as a string of a JSON object (some models write them so), or as
`null` (sent as `{}`); any other arguments, or none, and it is not a call. The first text that
cannot be a call ends the calls: before the first call, the capture is content after all; after
it, the rest is ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

ARGS_KEYS = ("arguments", "parameters")
TRIM = 4096  # read text past this is dropped from the buffer, once a call was found


def normalized_arguments(parts: list[str]) -> str:
    """A call's arguments from the JSON text sent of them, normalized where it parses (every syntax's
    calls come back alike), else as written (a call cut short)."""
    raw = "".join(parts)
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        return raw


@dataclass
class Call:
    """One call object in the capture."""

    start: int
    end: int = -1  # past its closing brace, once it has closed
    key: str | None = None  # the key whose value comes next
    value_of: str | None = None  # the key whose value is being read
    name: str | None = None
    args_kind: str | None = None  # "object", "string" or "null"
    args_start: int = -1  # where the arguments' text starts in the capture
    args_end: int = -1  # where it ends, once it has
    args_text: str | None = None  # a string's or null's arguments, as JSON, once known
    index: int = -1  # set once the header is sent
    id: str = ""
    sent: int = 0  # characters of the arguments sent
    parts: list[str] = field(default_factory=list)  # the arguments' text, as sent

    def arguments(self) -> str:
        """The arguments' JSON text as far as written (normalized when it parses)."""
        return normalized_arguments(self.parts)


class CallScanner:
    """Turns the growing text of the calls into the calls and their OpenAI tool-call deltas."""

    def __init__(self, tokens: tuple[str, ...], blocks: bool, call_id: Callable[[], str], parallel: bool,
                 names: frozenset[str] | None, name_key: str = "name") -> None:
        """`tokens`: what may stand between the objects (besides whitespace); `blocks`: objects only
        between `<tool_call>` and `</tool_call>`; `names`: the tools' (None: any name); `name_key`:
        the key of the function's name (Command R7B's `tool_name`)."""
        self.tokens, self.blocks, self.call_id, self.parallel, self.names = tokens, blocks, call_id, parallel, names
        self.name_key = name_key
        self.text = ""  # the capture from `base` on (positions count from the capture's start)
        self.base = 0
        self.pos = 0
        self.stack: list[str] = []  # the open braces and brackets of the current object
        self.in_string = self.escape = False
        self.string_start = 0
        self.last_string: tuple[int, int] | None = None  # a string just closed at depth 1: maybe a key
        self.in_block = False
        self.call: Call | None = None  # the call object being read
        self.calls: list[Call] = []  # those whose header was sent
        self.stopped = False  # the calls have ended (see failed_at)
        self.failed_at = -1  # where the text stopped being calls, when it did

    def feed(self, text: str) -> list[dict]:
        """The deltas that `text`, the capture's next text, adds."""
        self.text += text
        deltas: list[dict] = []
        while self.pos < self._end and not self.stopped:
            if self.stack or self.in_string:
                self._step(self.text[self.pos - self.base], self.pos, deltas)
                self.pos += 1
                continue
            taken = self._top()
            if taken == 0:
                break  # maybe a token still
            self.pos += taken
        if self.call is not None and not self.stopped:
            deltas += self._arguments(self.call)
        self._trim()
        return deltas

    @property
    def _end(self) -> int:
        return self.base + len(self.text)

    def _slice(self, start: int, end: int) -> str:
        return self.text[start - self.base:end - self.base]

    def _trim(self) -> None:
        """Drops the text read that nothing refers to, once a call was found (before, `failed_at`
        indexes the capture): a token costs O(1) however long the calls."""
        call = self.call
        keep = [self.pos, *([self.string_start] if self.in_string and len(self.stack) == 1 else []),
                *([self.last_string[0]] if self.last_string else []),
                *([call.args_start + (call.sent if call.args_kind == "object" else 0)]
                  if call is not None and call.args_start >= 0 and call.args_end < 0 else [])]
        cut = min(keep) - self.base
        if self.calls and cut > TRIM:
            self.text, self.base = self.text[cut:], self.base + cut

    def finish(self, reason: str) -> list[dict]:
        """At the text's end: nothing is held back (a call ends at its closing brace)."""
        return []

    def _fail(self, at: int) -> None:
        self.stopped, self.failed_at, self.call = True, at, None

    def _top(self) -> int:
        """Reads the text between objects at `pos`: how much it takes (0: wait for more)."""
        text, pos = self.text, self.pos - self.base
        c = text[pos]
        if c.isspace():
            return 1
        if c == "{":
            if self.blocks and not self.in_block:
                self._fail(self.pos)
            elif self.calls and not self.parallel:
                self.stopped = True  # the first call is all that is kept
            else:
                self.call, self.stack = Call(self.pos), ["{"]
            return 1
        left = len(text) - pos
        if any(left < len(t) and t.startswith(text[pos:]) for t in self.tokens):
            return 0
        token = max((t for t in self.tokens if text.startswith(t, pos)), key=len, default=None)
        if token is None:
            self._fail(self.pos)
            return 1
        self.in_block = {"<tool_call>": True, "</tool_call>": False}.get(token, self.in_block)
        return len(token)

    def _step(self, c: str, i: int, deltas: list[dict]) -> None:
        call = self.call
        assert call is not None
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if len(self.stack) == 1:
                    self._string_closed(call, self.string_start, i + 1, deltas)
            return
        depth = len(self.stack)
        if depth == 1 and call.key is not None and call.value_of is None and not c.isspace():
            self._value_starts(call, c, i)
            if self.stopped:
                return
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            self.stack.append(c)
        elif c in "}]":
            if depth == 1:
                self._value_ends(call, i)
            self.stack.pop()
            if depth == 2 and call.args_kind == "object" and call.args_end < 0 and call.args_start >= 0:
                call.args_end = i + 1
            if depth == 1 and not self.stopped:
                self._closed(call, i, deltas)
                return
        elif c == ":" and depth == 1 and self.last_string is not None:
            call.key, call.value_of = self._decoded(*self.last_string), None
        elif c == "," and depth == 1:
            self._value_ends(call, i)
            call.key = call.value_of = None
        if not self.stopped:
            self._maybe_header(call, deltas)
        if not c.isspace():
            self.last_string = None

    def _value_starts(self, call: Call, c: str, i: int) -> None:
        key, call.value_of = call.key, call.key
        if key == self.name_key and call.name is None:
            if c != '"':
                self._fail(i)  # a name that is not a string
        elif key in ARGS_KEYS and call.args_kind is None:
            kind = {"{": "object", '"': "string", "n": "null"}.get(c)
            if kind is None:
                self._fail(i)  # arguments that are not an object
            call.args_kind, call.args_start = kind, i

    def _value_ends(self, call: Call, i: int) -> None:
        """At a `,` or the closing brace of the call object: a `null` arguments value ends."""
        if call.args_kind == "null" and call.args_text is None and call.value_of in ARGS_KEYS:
            if self._slice(call.args_start, i).strip() == "null":
                call.args_text = "{}"
            else:
                self._fail(i)

    def _string_closed(self, call: Call, start: int, end: int, deltas: list[dict]) -> None:
        if call.value_of == self.name_key and call.name is None:
            name = self._decoded(start, end)
            if name is None or (self.names is not None and name not in self.names):
                self._fail(end - 1)  # not one of the tools
                return
            call.name = name
        elif call.value_of in ARGS_KEYS and call.args_kind == "string" and call.args_start == start:
            call.args_end = end
            written = self._decoded(start, end)
            try:
                value = json.loads(written) if written is not None else None
            except ValueError:
                value = None
            if not isinstance(value, dict):
                self._fail(end - 1)  # a string that is not a JSON object
                return
            call.args_text = written
        elif call.value_of is None:
            self.last_string = (start, end)
            return
        self._maybe_header(call, deltas)

    def _closed(self, call: Call, i: int, deltas: list[dict]) -> None:
        """The call object's closing brace: it is a call, or the calls end here."""
        call.end = i + 1
        self._maybe_header(call, deltas)
        if call.index < 0:
            self._fail(i)  # no name, or no arguments: not a call
            return
        deltas += self._arguments(call)
        self.call = None

    def _maybe_header(self, call: Call, deltas: list[dict]) -> None:
        ready = call.args_kind == "object" or call.args_text is not None
        if call.index >= 0 or call.name is None or not ready:
            return
        call.index, call.id = len(self.calls), self.call_id()
        self.calls.append(call)
        deltas.append({"index": call.index, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}})

    def _decoded(self, start: int, end: int) -> str | None:
        try:
            value = json.loads(self._slice(start, end))
        except ValueError:
            return None
        return value if isinstance(value, str) else None

    def _arguments(self, call: Call) -> list[dict]:
        """The arguments' text not sent yet: an object's as it comes, a string's or null's once known."""
        if call.index < 0:
            return []
        if call.args_text is not None:
            fragment = "" if call.sent else call.args_text
            call.sent = 1
        else:
            end = call.args_end if call.args_end >= 0 else self._end
            fragment = self._slice(call.args_start + call.sent, end)
            call.sent = end - call.args_start
        if not fragment:
            return []
        call.parts.append(fragment)
        return [{"index": call.index, "function": {"arguments": fragment}}]
