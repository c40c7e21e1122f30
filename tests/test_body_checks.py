"""The checks every JSON body passes before FastAPI reads it (server/errors.py), on bodies that mix
token ids with what the checks look for: they skip the ids, not what sits among them."""
from __future__ import annotations

from pflash_plugin.server.errors import MAX_JSON_DEPTH, deeper_than, unencodable_field


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_nesting_among_token_ids_is_found_one_level_over_the_limit_and_not_at_it():
    def body(levels: int) -> dict:  # the object, its list, then lists inside among the ids
        return {"prompt": [1, 2, nested(levels - 2), 3]}

    assert deeper_than(body(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert not deeper_than(body(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert not deeper_than({"prompt": list(range(22000))}, MAX_JSON_DEPTH)


def test_a_lone_surrogate_among_token_ids_is_named_by_its_path():
    assert unencodable_field({"prompt": [5, 6, "ok", "\udcff"]}) == "prompt.3"
    assert unencodable_field({"prompt": [5, [7, {"k": "\udcff"}]]}) == "prompt.1.1.k"
    assert unencodable_field({"prompt": list(range(22000))}) is None
