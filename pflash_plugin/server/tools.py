"""Tool calls as models write them: the syntax a model family uses (chosen from its chat template),
and the reader that turns a choice's text into content and OpenAI `tool_calls`, streamed or whole.
What a request asks for (tool_choice, the forcing grammar) is tool_requests.py.

Syntaxes (llama-server's names): `hermes` (Hermes, Qwen 2/2.5/3: `<tool_call>{json}</tool_call>`),
`llama3` (Llama 3.x: `{"name": ..., "parameters": ...}`, maybe after `<|python_tag|>`), `mistral`
(`[TOOL_CALLS][{...}]`), and `generic` for a template that renders no tools: the server describes
the tools in the system prompt and asks for the hermes syntax. Control tokens such as
`<|python_tag|>` and `[TOOL_CALLS]` are not in the text the server detokenizes, so the readers also
take a call without them where the syntax puts the call first.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .tool_stream import CallScanner

CALL_RULE = "tool-call"  # the call object's rule in the forced grammar (the schema's root, renamed)


@dataclass(frozen=True)
class ToolSyntax:
    """How one model family writes tool calls."""

    name: str
    args_key: str  # "arguments", or Llama's "parameters"
    anywhere: tuple[str, ...]  # markers that start the calls wherever they appear
    leading: tuple[str, ...]  # markers that start the calls only as the message's first text
    renders_tools: bool  # the chat template describes the tools itself

    def root_rule(self, parallel: bool) -> str:
        """The forced grammar's root around the call rule."""
        if self.name == "mistral":  # the calls are one JSON array (its schema bounds the count)
            return f'root ::= "[TOOL_CALLS]" {CALL_RULE}'
        if self.name == "llama3":
            more = f' (";" " "? {CALL_RULE})*' if parallel else ""
            return f"root ::= {CALL_RULE}{more}"
        one = f'"<tool_call>\\n" {CALL_RULE} "\\n</tool_call>"'
        return f'root ::= {one} ("\\n" {one})*' if parallel else f"root ::= {one}"

    def call_id(self) -> str:
        # Mistral's templates refuse ids that are not 9 letters or digits
        return uuid.uuid4().hex[:9] if self.name == "mistral" else f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> list[tuple[str, Any]] | None:
        """The (name, arguments) calls of `text`, which starts at a marker; None if it is not calls."""
        if self.name == "mistral":
            return _json_calls(_after(text, "[TOOL_CALLS]"), self.args_key, array=True)
        if self.name == "llama3":
            return _json_calls(_after(text, "<|python_tag|>"), self.args_key, array=False)
        return _hermes_calls(text)


HERMES = ToolSyntax("hermes", "arguments", ("<tool_call>",), (), renders_tools=True)
LLAMA3 = ToolSyntax("llama3", "parameters", (), ("<|python_tag|>", "{"), renders_tools=True)
MISTRAL = ToolSyntax("mistral", "arguments", ("[TOOL_CALLS]",), ("[",), renders_tools=True)
GENERIC = ToolSyntax("generic", "arguments", ("<tool_call>",), (), renders_tools=False)

# stock's tool-calling chat formats: their own prompt and response code, which this server does not run
REFUSED_CHAT_FORMATS = ("chatml-function-calling", "functionary", "functionary-v1", "functionary-v2")


def syntax_for(template: str | None) -> ToolSyntax:
    """The syntax a chat template teaches its model, by the markers it writes; generic for one
    that renders no tools, or renders them in a format not known here."""
    if not template or "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return LLAMA3
    return GENERIC


def _after(text: str, marker: str) -> str:
    text = text.strip()
    return text[len(marker):] if text.startswith(marker) else text


def _call(obj: Any, args_key: str) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _json_calls(text: str, args_key: str, array: bool) -> list[tuple[str, Any]] | None:
    """JSON call objects that make up all of `text`: one array of them, or objects separated by
    whitespace or `;`."""
    decoder, objects, pos, text = json.JSONDecoder(), [], 0, text.strip()
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        objects.extend(value if array and isinstance(value, list) else [value])
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    calls = [_call(obj, args_key) for obj in objects]
    return [c for c in calls if c is not None] if calls and None not in calls else None


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes_calls(text: str) -> list[tuple[str, Any]] | None:
    calls = []
    for body in _HERMES_CALL.findall(text):
        found = _json_calls(body, "arguments", array=False)
        if not found:
            return None
        calls.extend(found)
    return calls or None


class ToolCallReader:
    """Splits one choice's text into content, released as it streams, and the tool calls that
    follow it: from a marker on, text is held until the end and parsed; text that does not parse
    is content after all."""

    def __init__(self, syntax: ToolSyntax, parallel: bool) -> None:
        """`parallel` False: only the first call is kept (the request's parallel_tool_calls)."""
        self.syntax, self.parallel = syntax, parallel
        self.pending = ""  # text not yet released: it may start a call
        self.capturing = False  # a marker was seen: the rest is calls
        self.started = False  # content other than whitespace was released
        self.scanner = CallScanner(("arguments", "parameters"), syntax.call_id, parallel)

    def read(self, text: str, finish: str | None, stream: bool) -> tuple[str, list[dict], str | None]:
        """The content of `text` to release now; the tool calls: streamed, the deltas the calls
        written so far add, else the whole calls once finished; the finish reason."""
        content = self.feed(text)
        deltas = self.scanner.feed(self.pending) if stream and self.capturing else []
        if finish is None:
            return content, deltas, None
        rest, calls = self.finish()
        if stream and self.scanner.started:  # the started calls went out as deltas: send the others whole
            return content, deltas + calls[self.scanner.started:], "tool_calls" if calls else finish
        return content + rest, calls, "tool_calls" if calls else finish

    def feed(self, text: str) -> str:
        """The content of `text` that is safe to release now."""
        self.pending += text
        if self.capturing:
            return ""
        if not self.started:
            head = self.pending.lstrip()
            if any(head.startswith(m) for m in self.syntax.leading):
                self.capturing = True
                return ""
            if any(m.startswith(head) for m in self.syntax.leading + self.syntax.anywhere):
                return ""  # maybe a marker still (or only whitespace so far)
        cut = min((i for i in (self.pending.find(m) for m in self.syntax.anywhere) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.capturing = self.pending[:cut], self.pending[cut:], True
        else:
            keep = max((k for m in self.syntax.anywhere for k in range(1, len(m))
                        if self.pending.endswith(m[:k])), default=0)
            out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        self.started = self.started or bool(out.strip())
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content still held, and the calls (OpenAI's shape, with their index)."""
        text, self.pending = self.pending, ""
        calls = self.syntax.parse(text) if self.capturing else None
        if not calls:
            return text, []
        if not self.parallel:
            calls = calls[:1]
        return "", [{"index": i, "id": self.syntax.call_id(), "type": "function",
                     "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                    for i, (name, args) in enumerate(calls)]
