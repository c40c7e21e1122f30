"""The reading of tool calls written in tags, streamed or whole: the families whose calls are not
bare JSON objects (Qwen3.5/3.6 and Qwen3-Coder's `<function=...>` XML, GLM 4.5's `<arg_key>` pairs,
DeepSeek V3.1's and Kimi K2's marker-delimited JSON). The families' markers are tool_syntaxes.py.

The scanner reads the captured text once, from where it stopped: each state waits for one marker,
and a search that finds none resumes a marker's length before the end; once a call was found, the
text read is dropped (a value's text kept as parts), so a token costs O(1) (its characters, times
the markers). Its interface is the JSON scanner's (json_calls.py): `feed` with the
capture's next text returns OpenAI tool-call deltas; `calls` and `failed_at` tell the reader what
was found, `finish` ends the text. A call's header (index, id, name) goes out once its name is one of
the tools; pair arguments go out as JSON, a pair at a time (`{"city": "Paris"`, then `, "days": 2`,
then `}`), as vLLM's Qwen3-Coder parser streams them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .json_calls import normalized_arguments

MAX_NAME = 256  # a function name longer than this is not one (the capture is content after all)
TRIM = 4096  # read text past this is dropped from the buffer, once a call was found


@dataclass(frozen=True)
class Pairs:
    """Arguments as key/value pairs: each value raw text for a string parameter, JSON otherwise.
    `newlines`: one newline on each side of a value belongs to the markup (Qwen's)."""

    key_open: str
    key_close: str
    value_open: str
    value_close: str
    newlines: bool


@dataclass(frozen=True)
class Markers:
    """How a family writes its calls, as read: `skip` may stand between calls (section and block
    markers), a call is `call_open` NAME (up to one of `name_ends`: the first is taken with the
    name, the others are left for what follows), then up to `args_open` (when set), the arguments
    (a JSON object, or `pairs`), and `call_close`."""

    skip: tuple[str, ...]
    call_open: str
    name_ends: tuple[str, ...]
    call_close: str
    pairs: Pairs | None = None
    args_open: str = ""
    name_prefix: str = ""  # written before the name (Kimi's "functions.")
    open_ended: bool = False  # the close marker ends generation and is not in the text (gpt-oss's <|call|>)


@dataclass
class TaggedCall:
    """One call read from the capture."""

    name: str
    index: int = -1
    id: str = ""
    end: int = -1  # past its close marker, once it has closed
    parts: list[str] = field(default_factory=list)  # the arguments' JSON text, as sent

    def arguments(self) -> str:
        """The arguments' JSON text (normalized when it parses)."""
        return normalized_arguments(self.parts)


def pair_value(raw: str, schema: Any) -> Any:
    """A pair's value as the parameter's schema types it: a string parameter's text as it is,
    others parsed as JSON (their text, when it does not parse), as llama.cpp and vLLM read them."""
    types = schema.get("type") if isinstance(schema, dict) else None
    kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if not kinds and isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        kinds = {"string"} if all(isinstance(v, str) for v in schema["enum"]) else set()
    if kinds == {"string"}:
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, str) and "string" not in kinds and kinds:
        return raw
    return value


class TaggedScanner:
    """Turns the growing text of tagged calls into the calls and their OpenAI tool-call deltas."""

    def __init__(self, markers: Markers, call_id: Callable[[], str], parallel: bool,
                 names: frozenset[str] | None, parameters: Mapping[str, Any] | None = None) -> None:
        """`names`: the tools' (None: any name); `parameters`: each tool's parameters schema,
        which types pair values (a name missing: values typed by their text)."""
        self.m, self.call_id, self.parallel, self.names = markers, call_id, parallel, names
        self.parameters = parameters or {}
        self.text = ""
        self.pos = 0  # what is read
        self.seek = 0  # where the search for the awaited marker resumes
        self.state = "top"
        self.key = ""  # the pair whose value is being read
        self.call: TaggedCall | None = None
        self.calls: list[TaggedCall] = []
        self.stopped = False
        self.failed_at = -1
        self.value: list[str] = []  # a pair value's text read so far (all but a possible close marker)
        self.states: dict[str, Callable[[list[dict]], bool]] = {
            "top": self._top, "name": self._name, "args_open": self._args_open, "args": self._args, "json": self._json,
            "pair": self._pair, "key": self._key, "value_open": self._value_open, "value": self._value}

    def feed(self, text: str) -> list[dict]:
        """The deltas that `text`, the capture's next text, adds."""
        self.text += text
        deltas: list[dict] = []
        while not self.stopped and self.pos < len(self.text):
            if not self.states[self.state](deltas):
                break  # wait for more text
        if self.calls and self.pos > TRIM:  # drop what is read (before a call, failed_at indexes the capture)
            self.text, self.seek, self.pos = self.text[self.pos:], max(self.seek - self.pos, 0), 0
        return deltas

    def finish(self, reason: str) -> list[dict]:
        """At the text's end: a call whose close marker ends generation (open_ended) is closed by
        a stop, its arguments' last text (held back as a maybe-marker) sent."""
        call = self.call
        if call is None or self.state != "json" or not self.m.open_ended or reason != "stop" or self.stopped:
            return []
        deltas: list[dict] = []
        if len(self.text) > self.pos:
            self._send(call, self.text[self.pos:], deltas)
        self._closed(call, len(self.text))
        return deltas

    # ---- helpers ------------------------------------------------------------------------------
    def _fail(self, at: int) -> None:
        self.stopped, self.failed_at, self.call = True, at, None

    def _space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _starts(self, marker: str) -> bool | None:
        """Whether the text at `pos` starts with `marker`; None: it may still (the text is short)."""
        rest = self.text[self.pos:self.pos + len(marker)]
        if rest == marker:
            return True
        return None if marker.startswith(rest) else False

    def _find(self, markers: tuple[str, ...]) -> tuple[int, str] | None:
        """The first of `markers` after `pos` (searching on from `seek`), or None for now."""
        start = max(self.pos, self.seek)
        found = [(at, m) for m in markers if (at := self.text.find(m, start)) >= 0]
        if found:
            self.seek = 0
            return min(found)
        self.seek = max(self.pos, len(self.text) - max(len(m) for m in markers) + 1)
        return None

    def _to(self, state: str, pos: int) -> bool:
        self.state, self.pos, self.seek = state, pos, 0
        return True

    # ---- states: each reads at `pos`; False waits for more text --------------------------------
    def _top(self, deltas: list[dict]) -> bool:
        """Between calls: whitespace, the skipped markers, or a call's opening."""
        self._space()
        if self.pos >= len(self.text):
            return False
        waiting = False
        for marker in (self.m.call_open, *self.m.skip):
            starts = self._starts(marker)
            if starts and marker == self.m.call_open:
                if self.calls and not self.parallel:
                    self.stopped = True  # the first call is all that is kept
                    return False
                return self._to("name", self.pos + len(marker))
            if starts:
                self.pos += len(marker)
                return True
            waiting = waiting or starts is None
        if not waiting:
            self._fail(self.pos)
        return False

    def _name(self, deltas: list[dict]) -> bool:
        found = self._find(self.m.name_ends)
        if found is None:
            if len(self.text) - self.pos > MAX_NAME:
                self._fail(self.pos)
            return False
        at, end = found
        name = self.text[self.pos:at].strip()
        if name.startswith(self.m.name_prefix):
            name = name[len(self.m.name_prefix):]
        if not name or len(name) > MAX_NAME or (self.names is not None and name not in self.names):
            self._fail(self.pos)  # not one of the tools
            return False
        self.call = TaggedCall(name)
        taken = at + len(end) if end == self.m.name_ends[0] else at
        return self._to("args_open" if self.m.args_open else "args", taken)

    def _args_open(self, deltas: list[dict]) -> bool:
        """Kimi's `:0` after the name, up to the arguments' marker."""
        found = self._find((self.m.args_open,))
        if found is None:
            if len(self.text) - self.pos > 64 + len(self.m.args_open):  # more than a short header before it
                self._fail(self.pos)
            return False
        return self._to("args", found[0] + len(self.m.args_open))

    def _args(self, deltas: list[dict]) -> bool:
        """The arguments begin: a JSON object, or the pairs (or none: the close marker)."""
        self._space()
        if self.pos >= len(self.text):
            return False
        if self.m.pairs is not None:
            self._header(deltas)
            return self._to("pair", self.pos)
        if self.text[self.pos] != "{":
            self._fail(self.pos)  # arguments that are not an object
            return False
        self._header(deltas)
        return self._to("json", self.pos)

    def _json(self, deltas: list[dict]) -> bool:
        """A JSON object's text, sent as it comes, up to the close marker."""
        call = self.call
        assert call is not None
        close = self.m.call_close
        found = self._find((close,))
        end = found[0] if found else self.seek
        if end > self.pos:
            self._send(call, self.text[self.pos:end], deltas)
            self.pos = end
        if found is None:
            return False
        return self._closed(call, found[0] + len(close))

    def _pair(self, deltas: list[dict]) -> bool:
        """Between pairs: the next key, or the call's close marker."""
        pairs, call = self.m.pairs, self.call
        assert pairs is not None and call is not None
        self._space()
        if self.pos >= len(self.text):
            return False
        for marker, state in ((pairs.key_open, "key"), (self.m.call_close, "")):
            starts = self._starts(marker)
            if starts and state:
                return self._to(state, self.pos + len(marker))
            if starts:
                self._send(call, "}" if call.parts else "{}", deltas)
                return self._closed(call, self.pos + len(marker))
            if starts is None:
                return False
        self._fail(self.pos)
        return False

    def _key(self, deltas: list[dict]) -> bool:
        pairs = self.m.pairs
        assert pairs is not None
        found = self._find((pairs.key_close,))
        if found is None:
            if len(self.text) - self.pos > MAX_NAME:
                self._fail(self.pos)
            return False
        self.key = self.text[self.pos:found[0]].strip()
        return self._to("value_open" if pairs.value_open else "value", found[0] + len(pairs.key_close))

    def _value_open(self, deltas: list[dict]) -> bool:
        pairs = self.m.pairs
        assert pairs is not None
        self._space()
        starts = self._starts(pairs.value_open) if self.pos < len(self.text) else None
        if starts is None:
            return False
        if not starts:
            self._fail(self.pos)
            return False
        return self._to("value", self.pos + len(pairs.value_open))

    def _value(self, deltas: list[dict]) -> bool:
        """A value's text up to its close marker, then the pair as JSON text."""
        pairs, call = self.m.pairs, self.call
        assert pairs is not None and call is not None
        found = self._find((pairs.value_close,))
        if found is None:  # what cannot start the close marker is the value's
            self.value.append(self.text[self.pos:self.seek])
            self.pos = self.seek
            return False
        raw, self.value = "".join(self.value) + self.text[self.pos:found[0]], []
        if pairs.newlines:
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
        schema = self.parameters.get(call.name, {})
        properties = schema.get("properties") if isinstance(schema, dict) else None
        value = pair_value(raw, properties.get(self.key) if isinstance(properties, dict) else None)
        pair = f"{json.dumps(self.key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._send(call, (", " if call.parts else "{") + pair, deltas)
        return self._to("pair", found[0] + len(pairs.value_close))

    def _header(self, deltas: list[dict]) -> None:
        call = self.call
        assert call is not None
        call.index, call.id = len(self.calls), self.call_id()
        self.calls.append(call)
        deltas.append({"index": call.index, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}})

    def _send(self, call: TaggedCall, fragment: str, deltas: list[dict]) -> None:
        call.parts.append(fragment)
        deltas.append({"index": call.index, "function": {"arguments": fragment}})

    def _closed(self, call: TaggedCall, end: int) -> bool:
        call.end, self.call = end, None
        return self._to("top", end)
