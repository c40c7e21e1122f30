"""Chat deltas as content blocks (server/blocks.py), the shape the Responses and Messages APIs share."""
from __future__ import annotations

from pflash_plugin.server.blocks import BlockStream, blocks_of


def _kinds(events) -> list[tuple[str, int, str]]:
    return [(e.kind, e.block.position, e.fragment) for e in events]


def test_text_then_calls_open_and_close_in_turn():
    stream = BlockStream()
    assert _kinds(stream.feed({"content": "Hi"})) == [("open", 0, ""), ("delta", 0, "Hi")]
    header = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert _kinds(stream.feed({"tool_calls": [header]})) == [("close", 0, ""), ("open", 1, "")]
    assert _kinds(stream.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]})) == \
        [("delta", 1, '{"a": 1}')]
    second = {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    assert _kinds(stream.feed({"tool_calls": [second]})) == [("close", 1, ""), ("open", 2, ""), ("delta", 2, "{}")]
    assert _kinds(stream.close()) == [("close", 2, "")]
    assert [(b.kind, b.text, b.call_id, b.name) for b in stream.blocks] == \
        [("text", "Hi", "", ""), ("call", '{"a": 1}', "call_1", "f"), ("call", "{}", "call_2", "g")]
    assert stream.blocks[1].arguments() == {"a": 1}


def test_whitespace_before_a_call_is_no_block_but_before_text_it_is_kept():
    stream = BlockStream()
    assert stream.feed({"content": "\n "}) == []
    header = {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}
    assert [b.kind for b in (stream.feed({"tool_calls": [header]}) and stream.blocks)] == ["call"]
    stream = BlockStream()
    stream.feed({"content": "\n "})
    stream.feed({"content": "Hi"})
    stream.close()
    assert [b.text for b in stream.blocks] == ["\n Hi"]


def test_a_whole_message_and_a_call_cut_short():
    blocks = blocks_of({"content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": '}}]})
    assert [(b.kind, b.name) for b in blocks] == [("call", "f")] and blocks[0].arguments() == {}
    assert blocks_of({"content": "", "tool_calls": None}) == []
