"""A chat request's tools as the server serves them: its tool_choice checked, the grammar that forces
a call whose arguments follow the function's JSON schema, and the tools described in the prompt
for a template that renders none."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...chat.tool_calls import CALL_RULE, Syntax, TaggedSyntax, ToolCallReader, ToolSyntax
from ..wire.protocol import ChatCompletionRequest, RequestError
from .schema_bounds import schema_grammar
from .tagged_grammar import tagged_grammar

CALLS_RULE = "tool-calls"  # the calls' rule, where text goes before them


def _system_prompt(tools: list[dict]) -> str:
    """The tools described as Hermes and Qwen are taught them, for templates that render none."""
    listed = "\n".join(json.dumps(tool) for tool in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


@dataclass
class ToolRequest:
    """A chat request's tools as the server serves them: `forced` names the functions one of
    which must be called (None: the model chooses). `parallel` is the request's
    parallel_tool_calls: False keeps the first call the model writes; a forced grammar allows
    several calls only when it is True (small models, forced, repeat calls until max_tokens)."""

    syntax: Syntax
    tools: list[dict]
    forced: list[str] | None
    parallel: bool | None

    @classmethod
    def of(cls, body: ChatCompletionRequest, syntax: Syntax) -> ToolRequest | None:
        """None when the request has no tools or tool_choice is none."""
        tools: list[dict[str, Any]] = [dict(tool) for tool in body.tools or []]
        choice = body.tool_choice or ("auto" if tools else "none")
        if choice == "none":
            return None
        names = [tool["function"]["name"] for tool in tools]  # their shape is validated with the body
        if not tools:
            raise RequestError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        parallel = body.parallel_tool_calls
        if choice == "auto":
            return cls(syntax, tools, None, parallel)
        if choice == "required":
            return cls(syntax, tools, names, parallel)
        name = _named_choice(choice)
        if name not in names:
            raise RequestError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                               param="tool_choice")
        return cls(syntax, tools, [name], parallel=False)  # a named choice: that one call, as OpenAI

    def reader(self) -> ToolCallReader:
        """A choice's reader of the calls the model writes: calls of these tools only."""
        parameters = {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}
        return ToolCallReader(self.syntax, self.parallel is not False, parameters, parameters)

    def messages(self, messages: list[dict]) -> list[dict]:
        """For a template that renders no tools: the conversation with the tools described in its
        system message (as the syntax's family describes them, whose template renders the earlier
        calls and results; else as Hermes, and those as text)."""
        describe = self.syntax.describe if isinstance(self.syntax, TaggedSyntax) else None
        messages = messages if describe else plain_history(messages)
        prompt = describe(self.tools) if describe else _system_prompt(self.tools)
        if messages and messages[0].get("role") == "system":
            first = messages[0]
            return [{**first, "content": f"{first.get('content') or ''}\n\n{prompt}".lstrip()}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def grammar(self, first: str = "") -> str | None:
        """A forced call's grammar: the syntax around calls whose arguments follow their schemas.
        `first`: text written before the calls (what closes a thinking block the prompt opened)."""
        gbnf = self._calls_grammar()
        if not gbnf or not first:
            return gbnf
        return f"root ::= {json.dumps(first)} {CALLS_RULE}\n" + re.sub(r"^root ::=", f"{CALLS_RULE} ::=", gbnf, count=1)

    def _calls_grammar(self) -> str | None:
        if self.forced is None:
            return None
        functions = self._forced_functions(self.forced)
        if isinstance(self.syntax, TaggedSyntax):
            return tagged_grammar(self.syntax, functions, self.parallel is True)
        return _json_grammar(self.syntax, functions, self.parallel is True)

    def _forced_functions(self, forced: list[str]) -> list[tuple[str, dict[str, Any]]]:
        """The forced functions' names and parameters, each tool's `$defs` (or `definitions`) under
        `$defs`, their names prefixed so that two tools' do not clash, and the refs to them following."""
        functions = []
        for i, tool in enumerate(self.tools):
            function = tool["function"]
            if function["name"] not in forced:
                continue
            parameters = function.get("parameters") or {"type": "object"}
            defs: dict[str, Any] = {}
            if isinstance(parameters, dict) and any(isinstance(parameters.get(k), dict) for k in _DEFS_KEYS):
                parameters = {**_hoisted(parameters, f"t{i}_", defs), "$defs": defs}
            functions.append((function["name"], parameters))
        return functions


def _json_grammar(syntax: ToolSyntax, functions: list[tuple[str, dict[str, Any]]], several: bool) -> str:
    """The JSON families' forced calls: call objects whose arguments follow their schemas, every
    tool's `$defs` hoisted to the root, where their refs point."""
    defs: dict[str, Any] = {}
    schemas = []
    for name, parameters in functions:
        found = parameters.get("$defs")
        if isinstance(found, dict):
            defs.update(found)
            parameters = {k: v for k, v in parameters.items() if k != "$defs"}
        schemas.append({"type": "object", "properties": {syntax.name_key: {"const": name}, syntax.args_key: parameters},
                        "required": [syntax.name_key, syntax.args_key]})
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if syntax.array:
        schema = {"type": "array", "items": schema, "minItems": 1, **({} if several else {"maxItems": 1})}
    if defs:
        schema = {**schema, "$defs": defs}
    gbnf = schema_grammar(schema, "tools")  # the functions' parameters, bounded first
    renamed = re.sub(r"^root ::=", f"{CALL_RULE} ::=", gbnf, count=1, flags=re.MULTILINE)
    return f"{syntax.root_rule(several)}\n{renamed}"


_DEFS_KEYS = ("$defs", "definitions")


def _hoisted(parameters: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """`parameters` without its `$defs`/`definitions`, which go into `defs` as `prefix` + name,
    with every `#/$defs/...` or `#/definitions/...` ref (its own and theirs) rewritten to match."""
    def rewritten(node: Any) -> Any:
        if isinstance(node, list):
            return [rewritten(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewritten(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            for key in _DEFS_KEYS:
                if ref.startswith(f"#/{key}/"):
                    out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3:]}"
        return out

    for key in _DEFS_KEYS:
        found = parameters.get(key)
        for name, sub in (found.items() if isinstance(found, dict) else ()):
            defs[f"{prefix}{name}"] = rewritten(sub)
    return rewritten({k: v for k, v in parameters.items() if k not in _DEFS_KEYS})


def plain_history(messages: list[dict]) -> list[dict]:
    """Earlier calls and their results as text, for a template that renders neither: a call in
    `<tool_call>` tags in its assistant message, results in `<tool_response>` tags in one user
    message (as Qwen's template writes them), so that roles still alternate. A run of results is
    joined once, at its end: linear in the history, whatever its length (issue 49)."""
    plain: list[dict] = []
    results: list[str] = []
    for message in messages:
        if message.get("role") == "tool":
            results.append(f"<tool_response>\n{message.get('content') or ''}\n</tool_response>")
            continue
        if results:
            plain.append({"role": "user", "content": "\n".join(results)})
            results = []
        calls = message.get("tool_calls")
        if calls:
            written = [f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                       f'{c["function"]["arguments"]}}}\n</tool_call>' for c in calls]
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join(filter(None, [message.get("content"), *written]))
        plain.append(message)
    if results:
        plain.append({"role": "user", "content": "\n".join(results)})
    return plain


def _named_choice(choice: Any) -> str:
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if isinstance(name, str):
            return name
    raise RequestError(400, "tool_choice is none, auto, required, or {'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice")
