"""The tool-call syntaxes written in tags, one object per family: the markers its reader reads
(tagged_calls.py) and the forced grammar's frame around the calls, in the family's own syntax.
llama.cpp's tests/test-chat.cpp and the families' templates (models/templates/) are the reference:

- `qwen3_coder` (Qwen3-Coder, Qwen3.5/3.6, Nemotron Nano 3): `<tool_call>\\n<function=NAME>\\n
  <parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, a string parameter's value as
  it is, others as JSON;
- `glm45` (GLM 4.5/4.6/4.7): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>
  \\n</tool_call>`, values as Qwen's;
- `deepseek_v3_1` (DeepSeek V3.1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- `kimi_k2` (Kimi K2): `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`.

Their markers are control tokens in some vocabularies: the server has the model write them
(`markers`, Model.render_tokens), as llama-server's preserved_tokens.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .tagged_calls import Markers, Pairs, TaggedScanner


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class TaggedSyntax:
    """One family's tagged tool calls: how they are read (`read`) and forced (the rest: the
    grammar's pieces as literals around a function's name, its arguments and each pair)."""

    name: str
    anywhere: tuple[str, ...]  # markers that start the calls wherever they appear
    read: Markers
    section: tuple[str, str]  # around all the calls (DeepSeek's and Kimi's), or ("", "")
    separator: str  # between two calls
    call: tuple[str, str, str]  # GBNF before the name, between it and the arguments, after them
    pair: tuple[str, str, str] = ("", "", "")  # literals before a key, between it and its value, after it
    leading: tuple[str, ...] = ()
    renders_tools: bool = True
    describe: Callable[[list[dict]], str] | None = None  # the tools' system prompt, where the template has none
    one_call: bool = False  # a turn holds one call (gpt-oss: the call's end ends generation)

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def scanner(self, parallel: bool, names: frozenset[str] | None,
                parameters: Mapping[str, Any] | None = None) -> TaggedScanner:
        return TaggedScanner(self.read, self.call_id, parallel, names, parameters)

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts the model must be able to write (control tokens in some vocabularies)."""
        m = self.read
        pairs = (m.pairs.key_open, m.pairs.key_close, m.pairs.value_open, m.pairs.value_close) if m.pairs else ()
        texts = (*m.skip, m.call_open, *m.name_ends, m.call_close, m.args_open, *pairs, *self.section)
        return tuple(dict.fromkeys(t for t in texts if t.strip()))

    def root_rule(self, call_rule: str, parallel: bool) -> str:
        """The forced grammar's root: the calls (one, or several when parallel) in their section."""
        separator = f"{literal(self.separator)} " if self.separator else ""
        parts = [call_rule, f"({separator}{call_rule})*" if parallel and not self.one_call else ""]
        head, tail = (literal(s) if s else "" for s in self.section)
        return "root ::= " + " ".join(p for p in (head, *parts, tail) if p)

    def function_rule(self, rule: str, function: str, arguments: str) -> str:
        """One function's call, `arguments` the GBNF of its arguments (a JSON object, or its pairs)."""
        before, between, after = self.call
        return f"{rule} ::= " + " ".join(p for p in (before, literal(function), between, arguments, after) if p)

    def pair_rule(self, key: str, value: str) -> str:
        """One pair's GBNF, `value` the GBNF of its value."""
        before, between, after = self.pair
        return f"{literal(before + key + between)} {value} {literal(after)}"


def deepseek_tools(tools: list[dict]) -> str:
    """The tools as DeepSeek V3.1's model card describes them in the system prompt (its template
    renders the calls and results, not the tools)."""
    listed = "\n\n".join(f"### {t['function']['name']}\nDescription: {t['function'].get('description') or ''}"
                         f"\n\nParameters: {json.dumps(t['function'].get('parameters') or {}, ensure_ascii=False)}"
                         for t in tools)
    return ("## Tools\nYou have access to the following tools:\n\n" + listed + "\n\nIMPORTANT: ALWAYS adhere to "
            "this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
            "tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n"
            "- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            "- For multiple tool calls, chain them directly without separators or spaces")


QWEN3_CODER = TaggedSyntax(
    "qwen3_coder", ("<tool_call>", "<function="),  # Qwen3-Coder at times leaves out <tool_call> (llama.cpp)
    Markers(("<tool_call>", "</tool_call>"), "<function=", (">",), "</function>",
            Pairs("<parameter=", ">", "", "</parameter>", newlines=True)),
    ("", ""), "\n", (literal("<tool_call>\n<function="), literal(">\n"), literal("</function>\n</tool_call>")),
    ("<parameter=", ">\n", "\n</parameter>\n"))
GLM45 = TaggedSyntax(
    "glm45", ("<tool_call>",),
    Markers((), "<tool_call>", ("\n", "<arg_key>", "</tool_call>"), "</tool_call>",
            Pairs("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", newlines=False)),
    ("", ""), "\n", (literal("<tool_call>"), literal("\n"), literal("</tool_call>")),
    ("<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n"))
DEEPSEEK_V3_1 = TaggedSyntax(
    "deepseek_v3_1", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
    Markers(("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"), "<｜tool▁call▁begin｜>", ("<｜tool▁sep｜>",),
            "<｜tool▁call▁end｜>"),
    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"), "",
    (literal("<｜tool▁call▁begin｜>"), literal("<｜tool▁sep｜>"), literal("<｜tool▁call▁end｜>")),
    renders_tools=False, describe=deepseek_tools)
KIMI_K2 = TaggedSyntax(
    "kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
    Markers(("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), "<|tool_call_begin|>",
            (":", "<|tool_call_argument_begin|>"), "<|tool_call_end|>", args_open="<|tool_call_argument_begin|>",
            name_prefix="functions."),
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), "",
    (literal("<|tool_call_begin|>functions."), f'":" [0-9] {literal("<|tool_call_argument_begin|>")}',
     literal("<|tool_call_end|>")))

# Functionary v3.1 (Llama 3.1): `<function=NAME>{json}</function>`
FUNCTIONARY_V3_1 = TaggedSyntax(
    "functionary_v3_1", ("<function=",),
    Markers((), "<function=", (">",), "</function>"),
    ("", ""), "", (literal("<function="), literal(">"), literal("</function>")))

# the text a call's header leaves after gpt-oss's harmony reader (chat/harmony.py), which passes a
# call's message on whole: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`,
# or ` to=functions.NAME<|channel|>commentary json<|message|>{...}` (the recipient in the role's
# header, as its template writes earlier calls); `<|call|>` ends generation
GPT_OSS = TaggedSyntax(
    "gpt_oss", ("<|start|>assistant", "<|channel|>"),
    Markers(("<|start|>assistant", "<|channel|>commentary", "<|channel|>analysis"), "to=functions.",
            (" ", "<|channel|>", "<|constrain|>", "<|message|>"), "<|call|>", args_open="<|message|>",
            open_ended=True),
    ("", ""), "", (literal("<|channel|>commentary to=functions."), literal(" <|constrain|>json<|message|>"), ""),
    leading=("to=functions.",), one_call=True)

TAGGED_SYNTAXES = (QWEN3_CODER, GLM45, DEEPSEEK_V3_1, KIMI_K2, GPT_OSS, FUNCTIONARY_V3_1)


def tagged_syntax_for(template: str) -> TaggedSyntax | None:
    """The tagged family whose markers the template writes, if any."""
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if "<function=" in template and "</function>" in template:
        return FUNCTIONARY_V3_1
    if "<arg_key>" in template and "<arg_value>" in template:
        return GLM45
    if "<｜tool▁sep｜>" in template and "```json" not in template:  # DeepSeek R1 writes a fenced block
        return DEEPSEEK_V3_1
    if "<|tool_call_argument_begin|>" in template:
        return KIMI_K2
    if "<|channel|>" in template and " to=" in template and "functions." in template:  # harmony's recipients
        return GPT_OSS
    return None

