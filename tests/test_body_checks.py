"""The checks every JSON body passes before FastAPI reads it (server/wire/errors.py), on bodies that mix
token ids with what the checks look for: they skip the ids, not what sits among them."""
from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from pflash_plugin.server.wire.errors import (COUNT_WINDOW, MAX_JSON_DEPTH, may_hold_lone_surrogate, deeper_than,
                                              more_than, unencodable_field)
from pflash_plugin.server.wire.protocol import CompletionRequest


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


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\\udcff"}', b'{"prompt": "\\uDCFF"}',  # escapes, either case
    '{"prompt": "a\udcffb"}'.encode("utf-8", "surrogatepass"),  # raw bytes json.loads lets through
    '{"prompt": "a\udcffb"}'.encode("utf-16", "surrogatepass"),
])
def test_every_way_json_loads_yields_a_lone_surrogate_keeps_the_walk(raw):
    assert unencodable_field(json.loads(raw)) == "prompt"
    assert may_hold_lone_surrogate(raw)


def test_token_ids_and_plain_text_skip_the_walk():
    assert not may_hold_lone_surrogate(json.dumps({"prompt": list(range(22000))}).encode())
    assert not may_hold_lone_surrogate(json.dumps({"prompt": "caf\u00e9 \U0001f600"}, ensure_ascii=False).encode())
    assert may_hold_lone_surrogate(json.dumps({"prompt": "\U0001f600"}).encode())  # an escaped pair: walked, fine


def test_a_bad_prompt_of_many_token_ids_is_one_error_per_union_member_not_one_per_id():
    """Each list of the prompt's union stops at its first bad item: 22K ids tried as a list of text
    cost 6 ms of the event loop, an error each."""
    with pytest.raises(ValidationError) as refused:
        CompletionRequest.model_validate({"prompt": list(range(5000)) + [None]})
    assert refused.value.error_count() <= 4


def test_more_than_counts_dense_and_sparse_bytes_alike():
    """more_than counts a window from each byte it finds: the same answer as counting them all,
    at every density and at the windows' edges."""
    rng = random.Random(7)
    bodies = [b",".join(b"x" * gap for _ in range(n)) for gap, n in
              ((0, 3000), (1, 2000), (COUNT_WINDOW - 1, 40), (COUNT_WINDOW, 40), (COUNT_WINDOW + 1, 40))]
    bodies += [bytes(rng.choice(b",[{a") if rng.random() < p else 97 for _ in range(rng.randrange(20000)))
               for p in (0.0, 0.001, 0.05, 0.5) for _ in range(25)]
    for raw in bodies:
        for chars in (b",", b"[{"):
            total = sum(raw.count(bytes([c])) for c in chars)
            for limit in {0, 1, total - 1, total, total + 1, 1024} - {-1}:
                assert more_than(raw, chars, limit) == (total > limit), (len(raw), chars, limit, total)
