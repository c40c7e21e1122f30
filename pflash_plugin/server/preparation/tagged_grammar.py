"""The grammar that forces a call in a tagged syntax (chat/tool_syntaxes.py): the family's own frame
around each forced function, its arguments a JSON object that follows the parameters' schema
(DeepSeek V3.1, Kimi K2), or its pairs (Qwen3-Coder/Qwen3.5, GLM 4.5): the required parameters in
the schema's order, then the optional ones, each value raw text for a string parameter (an enum's
or const's values; maxLength bounds it) and JSON that follows its schema otherwise, as llama.cpp's
Qwen3-Coder grammar writes them. Every JSON schema goes through one converter run (schema_grammar,
bounded first), as alternatives of one anyOf whose root names each one's rule."""
from __future__ import annotations

import re
from typing import Any

from ...chat.tool_syntaxes import TaggedSyntax, literal
from ..wire.protocol import RequestError
from .schema_bounds import MAX_SCHEMA_REPETITION, check_schema_bounds, schema_grammar

CALL = "tool-call"
TEXT = "tool-text"  # a string parameter's raw text: anything but the start of a close tag
TEXT_RULE = f'{TEXT} ::= ([^<] | "<" [^/])*'
_RULE_NAME = re.compile(r"^[a-zA-Z0-9-]+$")


def tagged_grammar(syntax: TaggedSyntax, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """The forced grammar over `functions` (name, parameters; `$defs` already prefixed per tool)."""
    defs: dict[str, Any] = {}
    schemas: list[Any] = []  # the JSON values' schemas, in the order their rules are referred to
    rules: list[str] = []
    for i, (name, parameters) in enumerate(functions):
        check_schema_bounds(parameters, "tools")
        found = parameters.get("$defs")
        defs.update(found if isinstance(found, dict) else {})
        parameters = {k: v for k, v in parameters.items() if k != "$defs"}
        if syntax.read.pairs is None:
            arguments = _json_ref(schemas, parameters)
        else:
            arguments = _pairs(syntax, f"tool-f{i}", parameters, schemas, rules)
        rules.append(syntax.function_rule(f"tool-f{i}", name, arguments))
    rules.insert(0, f"{CALL} ::= " + " | ".join(f"tool-f{i}" for i in range(len(functions))))
    gbnf = "\n".join([syntax.root_rule(CALL, parallel), *rules, TEXT_RULE])
    return _with_json_rules(gbnf, schemas, defs)


def _json_ref(schemas: list[Any], schema: Any) -> str:
    """A placeholder for the rule of `schema`'s JSON, filled in once all are converted."""
    schemas.append(schema)
    return f"<json-{len(schemas) - 1}>"


def _pairs(syntax: TaggedSyntax, rule: str, parameters: dict[str, Any], schemas: list[Any],
           rules: list[str]) -> str:
    """The GBNF of a function's pairs (each pair its own rule): required ones in order, then
    each optional one, maybe."""
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = parameters.get("required")
    required = set(required) if isinstance(required, list) else set()
    order = [k for k in properties if k in required] + [k for k in properties if k not in required]
    parts = []
    for j, key in enumerate(order):
        value = _raw_value(properties[key]) or _json_ref(schemas, properties[key])
        rules.append(f"{rule}-p{j} ::= {syntax.pair_rule(key, value)}")
        parts.append(f"{rule}-p{j}" + ("" if key in required else "?"))
    return " ".join(parts)


def _raw_value(schema: Any) -> str | None:
    """A string parameter's value as raw text (None: not a string parameter, its value is JSON)."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    enum = schema.get("enum")
    strings = isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)
    if "string" not in kinds and not (not kinds and (strings or isinstance(schema.get("const"), str))):
        return None
    if isinstance(schema.get("const"), str):
        return literal(schema["const"])
    if strings and isinstance(enum, list) and kinds <= {"string"}:
        return "(" + " | ".join(literal(v) for v in enum) + ")"
    bound = schema.get("maxLength")
    if kinds == {"string"} and isinstance(bound, int) and 0 <= bound <= MAX_SCHEMA_REPETITION:
        return f"[^<]{{0,{bound}}}"
    return TEXT


def _with_json_rules(gbnf: str, schemas: list[Any], defs: dict[str, Any]) -> str:
    """`gbnf` with its JSON placeholders replaced by the converter's rules for their schemas."""
    if not schemas:
        return gbnf
    converted = schema_grammar({"anyOf": schemas, **({"$defs": defs} if defs else {})}, "tools")
    lines = converted.splitlines()
    root = next(line for line in lines if line.startswith("root ::= "))
    names = root[len("root ::= "):].split(" | ")
    if len(names) != len(schemas) or not all(_RULE_NAME.match(n) for n in names):
        raise RequestError(400, "tools: a parameter's JSON schema could not be made into a grammar", param="tools")
    for i, name in enumerate(names):
        gbnf = gbnf.replace(f"<json-{i}>", name)
    return "\n".join([gbnf, *(line for line in lines if line is not root)])
