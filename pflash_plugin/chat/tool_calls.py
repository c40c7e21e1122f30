"""Tool calls as models write them: the syntax a model family uses (chosen from its chat template),
and the reader that turns a choice's text into content and OpenAI `tool_calls`, streamed or whole.
What a request asks for (tool_choice, the forcing grammar) is server/preparation/tool_requests.py.

Syntaxes (llama-server's names): `hermes` (Hermes, Qwen 2/2.5/3: `<tool_call>{json}</tool_call>`),
`llama3` (Llama 3.x: `{"name": ..., "parameters": ...}`, maybe after `<|python_tag|>`), `mistral`
(`[TOOL_CALLS][{...}]`), `granite` (Granite 3.x: `<|tool_call|>[{...}]`), `command_r7b`
(`<|START_ACTION|>[{"tool_name": ..., "parameters": ...}]<|END_ACTION|>`), and `generic` for a
template that renders no tools: the server describes
the tools in the system prompt and asks for the hermes syntax. Control tokens such as
`<|python_tag|>` and `[TOOL_CALLS]` are not in the text the server detokenizes, so the readers also
take a call without them where the syntax puts the call first.

The families that write calls in tags (Qwen3-Coder/Qwen3.5 XML, GLM 4.5, DeepSeek V3.1, Kimi K2,
gpt-oss, Functionary v3.1)
are tool_syntaxes.py: the reader takes either kind (`Syntax`), by the scanner
each makes. `--tool_syntax` names one, over the template's markers (SYNTAXES).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Union

from .json_calls import CallScanner
from .tagged_calls import TaggedScanner
from .tool_syntaxes import TAGGED_SYNTAXES, TaggedSyntax, tagged_syntax_for

CALL_RULE = "tool-call"  # the call object's rule in the forced grammar (the schema's root, renamed)


@dataclass(frozen=True)
class ToolSyntax:
    """How one model family writes tool calls."""

    name: str
    args_key: str  # "arguments", or Llama's "parameters"
    anywhere: tuple[str, ...]  # markers that start the calls wherever they appear
    leading: tuple[str, ...]  # markers that start the calls only as the message's first text
    renders_tools: bool  # the chat template describes the tools itself
    between: tuple[str, ...]  # what may stand between the call objects, besides whitespace
    blocks: bool = False  # each call object stands between <tool_call> and </tool_call>
    array: str = ""  # the calls are one JSON array after this marker (Mistral's, Granite's)
    name_key: str = "name"  # the key of the function's name

    def root_rule(self, parallel: bool) -> str:
        """The forced grammar's root around the call rule."""
        if self.array:  # the calls are one JSON array (its schema bounds the count)
            return f"root ::= {json.dumps(self.array)} {CALL_RULE}"
        if self.name == "llama3":
            more = f' (";" " "? {CALL_RULE})*' if parallel else ""
            return f"root ::= {CALL_RULE}{more}"
        one = f'"<tool_call>\\n" {CALL_RULE} "\\n</tool_call>"'
        return f'root ::= {one} ("\\n" {one})*' if parallel else f"root ::= {one}"

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts the model must be able to write (control tokens in some vocabularies)."""
        return tuple(m for m in (*self.anywhere, *self.leading) if len(m) > 1)

    def scanner(self, parallel: bool, names: frozenset[str] | None,
                parameters: Mapping[str, Any] | None = None) -> CallScanner:
        """The reader of the calls' text, from the first marker on (the JSON arguments need no schema)."""
        return CallScanner(self.between, self.blocks, self.call_id, parallel, names, self.name_key)

    def call_id(self) -> str:
        # Mistral's templates refuse ids that are not 9 letters or digits
        return uuid.uuid4().hex[:9] if self.name == "mistral" else f"call_{uuid.uuid4().hex[:24]}"



BLOCK_TOKENS = ("<tool_call>", "</tool_call>")
HERMES = ToolSyntax("hermes", "arguments", ("<tool_call>",), (), renders_tools=True, between=BLOCK_TOKENS,
                    blocks=True)
LLAMA3 = ToolSyntax("llama3", "parameters", (), ("<|python_tag|>", "{"), renders_tools=True,
                    between=("<|python_tag|>", ";"))
MISTRAL = ToolSyntax("mistral", "arguments", ("[TOOL_CALLS]",), ("[",), renders_tools=True,
                     between=("[TOOL_CALLS]", "[", "]", ",", ";"), array="[TOOL_CALLS]")
# Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`
GRANITE = ToolSyntax("granite", "arguments", ("<|tool_call|>",), (), renders_tools=True,
                     between=("<|tool_call|>", "[", "]", ","), array="<|tool_call|>")
# Command R7B: `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]<|END_ACTION|>`
COMMAND_R7B = ToolSyntax("command_r7b", "parameters", ("<|START_ACTION|>",), (), renders_tools=True,
                         between=("<|START_ACTION|>", "[", "]", ",", "<|END_ACTION|>"), array="<|START_ACTION|>",
                         name_key="tool_name")
GENERIC = ToolSyntax("generic", "arguments", ("<tool_call>",), (), renders_tools=False, between=BLOCK_TOKENS,
                     blocks=True)

Syntax = Union[ToolSyntax, TaggedSyntax]
SYNTAXES: dict[str, Syntax] = {s.name: s for s in (HERMES, LLAMA3, MISTRAL, GRANITE, COMMAND_R7B, GENERIC,
                                                      *TAGGED_SYNTAXES)}
TOOL_SYNTAXES = ("auto", *SYNTAXES)  # --tool_syntax's values

# stock's tool-calling chat formats: their own prompt and response code, which this server does not run
REFUSED_CHAT_FORMATS = ("chatml-function-calling", "functionary", "functionary-v1", "functionary-v2")


def syntax_for(template: str | None, override: str = "auto") -> Syntax:
    """The syntax a chat template teaches its model, by the markers it writes (`override`, the
    --tool_syntax setting, names one instead); generic for one that renders no tools, or renders
    them in a format not known here."""
    if override != "auto":
        return SYNTAXES[override]
    tagged = tagged_syntax_for(template or "")  # DeepSeek's renders calls, not the tools: they go first
    if tagged is not None:
        return tagged
    if not template or "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "<|START_ACTION|>" in template:
        return COMMAND_R7B
    if "<|tool_call|>" in template:
        return GRANITE
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return LLAMA3
    return GENERIC


class ToolCallReader:
    """Splits one choice's text into content, released as it streams, and the tool calls that
    follow it. From a marker on, the text is read by a CallScanner (json_calls.py), the same way
    streamed or whole: once it cannot be calls before a call was found, what was held is content
    after all and the text goes on as content; after the calls, the rest is ignored."""

    def __init__(self, syntax: Syntax, parallel: bool, names: Iterable[str] | None = None,
                 parameters: Mapping[str, Any] | None = None) -> None:
        """`parallel` False: only the first call is kept (the request's parallel_tool_calls).
        `names`: the tools' names; a call of another function is content (None: any name).
        `parameters`: each tool's parameters schema (the tagged syntaxes type their values by it)."""
        self.syntax, self.parallel, self.parameters = syntax, parallel, parameters
        self.names = frozenset(names) if names is not None else None
        self.pending = ""  # text not yet released: it may start calls, or is them
        self.scanner: CallScanner | TaggedScanner | None = None  # set while capturing: a marker was seen
        self.started = False  # content other than whitespace was released
        self.deltas: list[dict] = []  # the streamed calls' deltas not yet returned
        self.fed = 0  # how much of `pending` the scanner has read

    def read(self, text: str, finish: str | None, stream: bool) -> tuple[str, list[dict], str | None]:
        """The content of `text` to release now; the tool calls: streamed, the deltas the calls
        written so far add, else the whole calls once finished; the finish reason: "tool_calls"
        when there are complete calls, even at max_tokens (an agent loop looks for it, and the
        text after the calls is ignored), "length" when the last call streamed was cut short."""
        content = self.feed(text, keep=not stream)
        if finish is not None and self.scanner is not None:
            self.deltas += self.scanner.finish(finish)
        deltas, self.deltas = (self.deltas if stream else []), []
        if finish is None:
            return content, deltas, None
        written = self.scanner.calls if self.scanner else []
        cut = finish == "length" and bool(written) and written[-1].end < 0
        rest, calls = self.finish(finish)
        if stream:  # the calls went out as deltas; a call cut short by max_tokens cannot be taken back
            return (content, deltas, "length" if cut else "tool_calls") if written else \
                (content + rest, deltas, finish)
        return content + rest, calls, "tool_calls" if calls else finish

    def feed(self, text: str, keep: bool = True) -> str:
        """The content of `text` that is safe to release now. `keep` False: once a call was
        found, its text is the scanner's alone (streamed, the calls went out already; whole, the
        text is kept: with its only call cut short, it is content)."""
        if self.scanner is not None and self.scanner.calls:
            self.pending += text if keep else ""
            self.deltas += self.scanner.feed(text)
            return ""
        self.pending += text  # held until the first call: short, unless the text is content
        out = []
        while True:
            if self.scanner is not None:
                self.deltas += self.scanner.feed(self.pending[self.fed:])
                self.fed = len(self.pending)
                if self.scanner.calls:
                    self.pending = self.pending if keep else ""
                    break
                if self.scanner.failed_at < 0:
                    break
                # not calls: what was held is content, and the text goes on from where it failed
                at, self.scanner = max(self.scanner.failed_at, 1), None
                out.append(self.pending[:at])
                self.started, self.pending = True, self.pending[at:]
            else:
                out.append(self._release())
                if self.scanner is None:
                    break
        return "".join(out)

    def _release(self) -> str:
        """The content before any marker in `pending`; starts the scanner at a marker."""
        if not self.started:
            head = self.pending.lstrip()
            if any(head.startswith(m) for m in self.syntax.leading):
                self._capture()
                return ""
            if any(m.startswith(head) for m in self.syntax.leading + self.syntax.anywhere):
                return ""  # maybe a marker still (or only whitespace so far)
        cut = min((i for i in (self.pending.find(m) for m in self.syntax.anywhere) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], self.pending[cut:]
            self._capture()
        else:
            keep = max((k for m in self.syntax.anywhere for k in range(1, len(m))
                        if self.pending.endswith(m[:k])), default=0)
            out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        self.started = self.started or bool(out.strip())
        return out

    def _capture(self) -> None:
        self.scanner, self.fed = self.syntax.scanner(self.parallel, self.names, self.parameters), 0

    def finish(self, finish: str = "stop") -> tuple[str, list[dict]]:
        """The content still held, and the calls (OpenAI's shape, with their index). At
        max_tokens, a last call cut short is dropped and the complete ones are kept."""
        text, self.pending = self.pending, ""
        calls = self.scanner.calls if self.scanner else []
        if finish == "length" and calls and calls[-1].end < 0:
            calls = calls[:-1]
        if not calls:
            return text, []
        assert self.scanner is not None
        return "", [{"index": c.index, "id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments()}} for c in calls]
