"""A JSON schema's keywords checked for the kind of value JSON Schema gives them, before anything
converts it: `properties: [1, 2]` is a 400 naming the keyword and where it is, not the converter's
Python error ("'list' object has no attribute 'items'", issue 49)."""
from __future__ import annotations

from typing import Any, Iterable

# keyword -> what its value must be: "schemas" a map of names to schemas, "schema" a schema
# (an object, or true/false), "schema list" an array of schemas, "schema or list" either (`items`,
# a tuple's in older drafts), "array", "string or array", "string"
_KEYWORDS = {
    "properties": "schemas", "patternProperties": "schemas", "$defs": "schemas", "definitions": "schemas",
    "items": "schema or list", "additionalProperties": "schema", "not": "schema", "contains": "schema",
    "propertyNames": "schema", "additionalItems": "schema", "unevaluatedProperties": "schema",
    "anyOf": "schema list", "oneOf": "schema list", "allOf": "schema list", "prefixItems": "schema list",
    "required": "array", "enum": "array", "type": "string or array", "$ref": "string", "pattern": "string",
}
_SAID = {"schemas": "an object of schemas", "schema": "a schema (an object, or true or false)",
         "schema list": "an array of schemas", "schema or list": "a schema or an array of schemas",
         "array": "an array", "string or array": "a string or an array",
         "string": "a string"}


def shape_error(schema: Any) -> tuple[str, str] | None:
    """Where (a dotted path from the schema's root, "" for the root) and why the first keyword
    whose value is not of its kind fails; None for a schema of the right shape. Iterative: the
    body's depth is bounded before this, and nothing here recurses on it."""
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:
        node, where = todo.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return where, f"a JSON schema is an object (or true or false), not {type(node).__name__}"
        for keyword, kind in _KEYWORDS.items():
            if keyword not in node:
                continue
            value, at = node[keyword], f"{where}.{keyword}"
            if not _fits(value, kind):
                return at, f"must be {_SAID[kind]}, not {type(value).__name__}"
            todo += _children(value, kind, at)
    return None


def first_shape_error(schemas: Iterable[tuple[str, Any]]) -> tuple[str, str] | None:
    """Of (field, schema) pairs (a schema None: none given), the first wrong one's keyword as a
    field of the client's body, and why; None when all are of the right shape."""
    for field, schema in schemas:
        wrong = shape_error(schema) if schema is not None else None
        if wrong is not None:
            return field + wrong[0], wrong[1]
    return None


def _fits(value: Any, kind: str) -> bool:
    return {"schemas": isinstance(value, dict), "schema": isinstance(value, (dict, bool)),
            "schema list": isinstance(value, list), "schema or list": isinstance(value, (dict, bool, list)),
            "array": isinstance(value, list), "string or array": isinstance(value, (str, list)),
            "string": isinstance(value, str)}[kind]


def _children(value: Any, kind: str, where: str) -> list[tuple[Any, str]]:
    """The schemas inside a keyword's value (of its kind), to check next."""
    if kind == "schemas":
        return [(child, f"{where}.{name}") for name, child in value.items()]
    if kind == "schema" or kind == "schema or list" and not isinstance(value, list):
        return [(value, where)]
    if kind in ("schema list", "schema or list"):
        return [(child, f"{where}.{i}") for i, child in enumerate(value)]
    return []
