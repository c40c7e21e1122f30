"""JSON schemas bounded before llama_cpp's converter (`llama_grammar.json_schema_to_gbnf`) turns them
into grammars.

The converter writes repetitions out: `minItems: 10000000` became 160 million characters of grammar
(issue 31: 281 s and a 3 GB peak before its 400, or a 500 when the grammar check then ran out of
memory), and `maxItems`, `minLength`, `maxLength` and a pattern's `{m,n}` do the same. It also
compares each new rule with every earlier rule of the same name (quadratic in rules whose names
differ only in characters a rule name cannot hold) and recurses once per optional property.
`check_schema_bounds` walks the schema as the converter would (the same branch per schema, each
`$ref` followed once) and estimates the grammar's size from the schema alone; over a bound, a 400
names the keyword, where it is, and the limit. What passes is small enough for the grammar checks
after it (llama/grammar_cost.py), which have the last word.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from llama_cpp import llama_grammar

from ...llama.sampler import MAX_GRAMMAR_NESTING, MAX_GRAMMAR_STACKS
from ..wire.protocol import RequestError
from ..wire.schema_shape import shape_error

MAX_SCHEMA_REPETITION = 10_000  # minItems, minLength, a pattern's {m}: each copy is written out
# maxItems - minItems (and the like) optional copies nest a group each, in one rule
MAX_SCHEMA_OPTIONAL = MAX_GRAMMAR_NESTING - 8
MAX_SCHEMA_ALTERNATIVES = MAX_GRAMMAR_STACKS  # enum, anyOf, oneOf, type lists: a parse state each
MAX_SCHEMA_PROPERTIES = 1024  # per object
MAX_SCHEMA_OPTIONAL_PROPERTIES = 128  # per object: the converter recurses through them, once per pair
MAX_SCHEMA_DEPTH = 64  # nested schemas, through $refs too (the converter recurses per level)
MAX_SCHEMA_GRAMMAR_CHARS = 1_000_000  # the grammar's estimated size
MAX_SCHEMA_NAME_CLASHES = 200_000  # comparisons of rules of one name

_RULE_NAME_INVALID = re.compile(r"[^a-zA-Z0-9-]+")  # the converter's INVALID_RULE_CHARS_RE
_RESERVED = {"root", "dot", *llama_grammar.PRIMITIVE_RULES, *llama_grammar.STRING_FORMAT_RULES}
_UUID = re.compile(r"^uuid[1-5]?$")
_NODE_CHARS = 64  # a rule's own text beside its name: `name ::= "[" space ... "]" space`
_ITEM_CHARS = 24  # `("," space ` and `)?` around a repeated item
# the built-in rules a grammar may take (number, string, uuid, date-time, ...), all of them
_PRIMITIVE_CHARS = sum(len(name) + len(rule.content) + 6 for rules in (llama_grammar.PRIMITIVE_RULES,
                       llama_grammar.STRING_FORMAT_RULES) for name, rule in rules.items())
_CHAR_CHARS = 8  # a string length's repeated `char `


@dataclass
class _Node:
    schema: dict
    name: str  # the converter's name for it
    depth: int
    path: tuple[str, ...]  # keys from the root (for messages)


@dataclass
class _Walk:
    """One schema's walk: the estimate so far and the names and refs seen."""

    root: Any
    param: str
    chars: int = 0
    clashes: int = 0
    names: dict[str, int] = field(default_factory=dict)  # rules per escaped name
    refs: set[str] = field(default_factory=set)

    def refuse(self, node: _Node, keyword: str, message: str) -> RequestError:
        where = "/" + "/".join(node.path) if node.path else "the schema's root"
        return RequestError(400, f"{self.param}: {keyword} at {where}: {message}", param=self.param)

    def grow(self, node: _Node, keyword: str, chars: int) -> None:
        self.chars += chars
        if self.chars > MAX_SCHEMA_GRAMMAR_CHARS:
            raise self.refuse(node, keyword, f"the grammar would be over the limit of {MAX_SCHEMA_GRAMMAR_CHARS:,} "
                              "characters (estimated from the schema, without building it)")

    def rule(self, node: _Node, keyword: str, name: str) -> None:
        """A rule the converter adds as `name`, compared with each earlier rule of that name."""
        escaped = _RULE_NAME_INVALID.sub("-", name)
        earlier = self.names.get(escaped, 0)
        self.names[escaped] = earlier + 1
        self.clashes += earlier
        if self.clashes > MAX_SCHEMA_NAME_CLASHES:
            raise self.refuse(node, keyword, f"the grammar's rule names clash over the limit of "
                              f"{MAX_SCHEMA_NAME_CLASHES:,} times (names such as {name!r} that differ only in "
                              "characters a rule name cannot hold)")
        self.grow(node, keyword, _NODE_CHARS + 2 * len(escaped))

    def resolve(self, ref: str) -> Any:
        """A local ref's target (None where the converter refuses it)."""
        target = self.root
        for key in ref[2:].split("/"):
            if not isinstance(target, dict) or key not in target:
                return None
            target = target[key]
        return target


def check_schema_bounds(schema: Any, param: str) -> None:
    """Raise RequestError(400) naming the keyword and the limit where converting `schema` to a
    grammar would cost more than the limits allow. `param` names the request's field."""
    estimated_grammar_chars(schema, param)


def estimated_grammar_chars(schema: Any, param: str) -> int:
    """What the converter's grammar of `schema` will take, at most (characters), or RequestError."""
    walk = _Walk(schema, param, chars=_PRIMITIVE_CHARS)
    todo = [_Node(schema, "", 0, ())] if isinstance(schema, dict) else []
    while todo:
        node = todo.pop()
        if node.depth > MAX_SCHEMA_DEPTH:
            raise walk.refuse(node, "nesting", f"schemas nest over the limit of {MAX_SCHEMA_DEPTH} deep ($refs "
                              "included)")
        walk.rule(node, "nesting", node.name + "-" if node.name in _RESERVED else node.name or "root")
        todo.extend(child for child in _visit(walk, node) if isinstance(child.schema, dict))
    return walk.chars


def _branch(s: dict) -> str:
    """Which of its branches the converter's `visit` takes for schema `s` (in its order)."""
    kind, fmt = s.get("type"), s.get("format")
    if "$ref" in s:
        return "$ref"
    if "oneOf" in s or "anyOf" in s:
        return "anyOf"
    if isinstance(kind, list) or "const" in s or "enum" in s:
        return "type" if isinstance(kind, list) else "const" if "const" in s else "enum"
    untyped = kind is None
    if (untyped or kind == "object") and ("properties" in s or s.get("additionalProperties", True) is not True):
        return "properties"
    if (untyped or kind == "object") and "allOf" in s:
        return "allOf"
    if (untyped or kind == "array") and ("items" in s or "prefixItems" in s):
        return "items"
    if (untyped or kind == "string") and "pattern" in s:
        return "pattern"
    if (untyped or kind == "string") and isinstance(fmt, str) and (
            _UUID.match(fmt) or f"{fmt}-string" in llama_grammar.STRING_FORMAT_RULES):
        return "format"
    if kind == "string" and ("minLength" in s or "maxLength" in s):
        return "minLength"
    return "primitive"


def _visit(walk: _Walk, node: _Node) -> Iterator[_Node]:
    """One schema's cost, and the schemas the converter visits from it."""
    s, name = node.schema, node.name
    prefix = f"{name}-" if name else ""
    branch = _branch(s)
    if branch == "$ref":
        ref = s["$ref"]
        if isinstance(ref, str) and ref.startswith("#/") and ref not in walk.refs:
            walk.refs.add(ref)
            yield _child(node, walk.resolve(ref), ref.split("/")[-1], "$ref")
    elif branch == "anyOf":
        alternatives = s.get("oneOf") or s["anyOf"]
        _alternatives(walk, node, "oneOf" if s.get("oneOf") else "anyOf", alternatives)
        if isinstance(alternatives, list):
            yield from (_child(node, sub, f"{name}{'-' if name else 'alternative-'}{i}", branch, str(i))
                        for i, sub in enumerate(alternatives))
    elif branch in ("type", "enum"):
        _alternatives(walk, node, branch, s[branch])
        if branch == "enum" and isinstance(s["enum"], list):
            walk.grow(node, "enum", sum(_literal_chars(value) for value in s["enum"]))
    elif branch == "const":
        walk.grow(node, "const", _literal_chars(s["const"]))
    elif branch in ("properties", "allOf"):
        properties, required = _object(s) if branch == "properties" else _merged(walk, s)
        yield from _properties(walk, node, prefix, properties, required)
    elif branch == "items":
        yield from _items(walk, node, prefix)
    elif branch == "pattern" and isinstance(s["pattern"], str):
        walk.grow(node, "pattern", _pattern(walk, node, s["pattern"], len(name) + _ITEM_CHARS))
    elif branch == "minLength":
        walk.grow(node, branch, _repetition(walk, node, "minLength", "maxLength", _CHAR_CHARS))


def _literal_chars(value: Any) -> int:
    """A JSON value as a grammar literal, at most: its quotes escaped, between quotes, and ` | `."""
    return 2 * len(json.dumps(value)) + 5


def _child(node: _Node, schema: Any, name: str, *keys: str) -> _Node:
    return _Node(schema, name, node.depth + 1, (*node.path, *keys))


def _alternatives(walk: _Walk, node: _Node, keyword: str, values: Any) -> None:
    if isinstance(values, (list, dict)) and len(values) > MAX_SCHEMA_ALTERNATIVES:
        raise walk.refuse(node, keyword, f"{len(values):,} alternatives, over the limit of "
                          f"{MAX_SCHEMA_ALTERNATIVES:,} parse states (llama.cpp keeps one for each at every token)")


def _object(s: dict) -> tuple[dict, set[str]]:
    """An object schema's properties and the required ones; an additionalProperties schema is one
    more optional property, as the converter writes it."""
    properties = s.get("properties", {})
    properties = dict(properties) if isinstance(properties, dict) else {}
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        properties["additional-value"] = extra
    required = s.get("required", [])
    return properties, {str(p) for p in required} if isinstance(required, list) else set()


def _merged(walk: _Walk, s: dict) -> tuple[dict, set[str]]:
    """allOf: the properties of its components (and of the components of their anyOf), merged."""
    properties: dict = {}
    required: set[str] = set()
    components = s["allOf"] if isinstance(s["allOf"], list) else []
    for part in components:
        either = isinstance(part, dict) and isinstance(part.get("anyOf"), list)  # its properties are optional
        for sub in part["anyOf"] if either else [part]:
            ref = sub.get("$ref") if isinstance(sub, dict) else None
            sub = walk.resolve(ref) if isinstance(ref, str) and ref.startswith("#/") else sub
            if isinstance(sub, dict) and isinstance(sub.get("properties"), dict):
                properties.update(sub["properties"])
                if not either:
                    required.update(sub["properties"])
    return properties, required


def _properties(walk: _Walk, node: _Node, prefix: str, properties: dict, required: set[str]) -> Iterator[_Node]:
    if len(properties) > MAX_SCHEMA_PROPERTIES:
        raise walk.refuse(node, "properties", f"{len(properties):,} properties, over the limit of "
                          f"{MAX_SCHEMA_PROPERTIES:,}")
    optional = [p for p in properties if p not in required]
    if len(optional) > MAX_SCHEMA_OPTIONAL_PROPERTIES:
        raise walk.refuse(node, "properties", f"{len(optional):,} optional properties, over the limit of "
                          f"{MAX_SCHEMA_OPTIONAL_PROPERTIES} (the converter recurses through them)")
    for prop in properties:
        walk.rule(node, "properties", f"{prefix}{prop}-kv")
    for prop in optional:
        walk.rule(node, "properties", f"{prefix}{prop}-rest")
    yield from (_child(node, sub, f"{prefix}{prop}", "properties", str(prop)) for prop, sub in properties.items())


def _items(walk: _Walk, node: _Node, prefix: str) -> Iterator[_Node]:
    s = node.schema
    items = s.get("items") or s.get("prefixItems")
    key = "items" if s.get("items") else "prefixItems"
    if isinstance(items, list):
        yield from (_child(node, sub, f"{prefix}tuple-{i}", key, str(i)) for i, sub in enumerate(items))
    elif isinstance(items, dict):
        walk.grow(node, "minItems", _repetition(walk, node, "minItems", "maxItems",
                                                len(prefix) + len("item") + _ITEM_CHARS))
        yield _child(node, items, f"{prefix}item", key)


def _bound(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _repetition(walk: _Walk, node: _Node, low_key: str, high_key: str, unit: int) -> int:
    """The characters the copies `low_key`..`high_key` of an item of `unit` characters take."""
    low, high = _bound(node.schema.get(low_key, 0)), _bound(node.schema.get(high_key))
    return _copies(walk, node, (f"{low_key} {low!r}", f"{high_key} {high!r}"), low or 0, high, unit)


def _copies(walk: _Walk, node: _Node, labels: tuple[str, str], low: float, high: float | None, unit: int) -> int:
    """Refused over MAX_SCHEMA_REPETITION copies, or MAX_SCHEMA_OPTIONAL optional ones; `labels`
    name the bounds in the refusal."""
    if max(low, high or 0) > MAX_SCHEMA_REPETITION:
        raise walk.refuse(node, labels[low < (high or 0)], f"over the limit of {MAX_SCHEMA_REPETITION:,} copies "
                          "(the grammar writes each one out)")
    optional = max(high - low, 0) if high is not None else 0
    if optional > MAX_SCHEMA_OPTIONAL:
        raise walk.refuse(node, labels[1], f"{optional:g} optional copies, over the limit of {MAX_SCHEMA_OPTIONAL} "
                          "(the grammar nests a group for each)")
    return int(max(low, 0) + optional + 1) * unit


_PATTERN_PART = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]?|\{([^}]*)\}?", re.DOTALL)


def _pattern(walk: _Walk, node: _Node, pattern: str, unit: int) -> int:
    """The characters a regular expression's quantifiers `{m}`, `{m,}`, `{m,n}` write out, read as
    the converter reads them (escapes and classes skipped, bounds through int())."""
    chars = 4 * len(pattern)
    for part in _PATTERN_PART.finditer(pattern):
        inside = part.group(1)
        if inside is None:
            continue
        nums = [n.strip() for n in inside.split(",")]
        try:
            low = int(nums[0]) if nums[0] else 0
            high = int(nums[1]) if len(nums) == 2 and nums[1] else (low if len(nums) == 1 else None)
        except ValueError:  # the converter refuses the quantifier (too many digits too)
            continue
        label = f"pattern {{{inside.strip()[:40]}}}"
        chars += _copies(walk, node, (label, label), low, high, unit)
    return chars


def schema_grammar(schema: Any, param: str) -> str:
    """The GBNF grammar of a JSON schema, its shape checked and bounded first (RequestError 400
    naming `param`)."""
    wrong = shape_error(schema)
    if wrong is not None:
        raise RequestError(400, f"{param}{wrong[0]}: {wrong[1]}", param=param + wrong[0])
    check_schema_bounds(schema, param)
    try:
        return llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as error:  # the converter asserts, raises ValueError, KeyError, RecursionError
        raise RequestError(400, f"{param}: the JSON schema is not usable: {error}", param=param) from None
