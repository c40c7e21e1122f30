"""Chat deltas as content blocks (server/output/blocks.py), the shape the Responses and Messages APIs share."""
from __future__ import annotations

from pflash_plugin.chat.deltas import CallDelta, ReasoningDelta, TextDelta
from pflash_plugin.server.output.blocks import BlockStream, blocks_of
from pflash_plugin.server.wire.responses import Answer


def _kinds(events) -> list[tuple[str, int, str]]:
    return [(e.kind, e.block.position, e.fragment) for e in events]


def test_text_then_calls_open_and_close_in_turn():
    stream = BlockStream()
    assert _kinds(stream.feed([TextDelta("Hi")])) == [("open", 0, ""), ("delta", 0, "Hi")]
    assert _kinds(stream.feed([CallDelta(0, "", "call_1", "f")])) == [("close", 0, ""), ("open", 1, "")]
    assert _kinds(stream.feed([CallDelta(0, '{"a": 1}')])) == [("delta", 1, '{"a": 1}')]
    assert _kinds(stream.feed([CallDelta(1, "{}", "call_2", "g")])) == \
        [("close", 1, ""), ("open", 2, ""), ("delta", 2, "{}")]
    assert _kinds(stream.close()) == [("close", 2, "")]
    assert [(b.kind, b.text, b.call_id, b.name) for b in stream.blocks] == \
        [("text", "Hi", "", ""), ("call", '{"a": 1}', "call_1", "f"), ("call", "{}", "call_2", "g")]
    assert stream.blocks[1].arguments() == {"a": 1}


def test_reasoning_is_a_block_of_its_own_before_the_text():
    stream = BlockStream()
    events = stream.feed([ReasoningDelta("Hm"), ReasoningDelta(", yes."), TextDelta("\n"), TextDelta("Paris.")])
    assert _kinds(events) == [("open", 0, ""), ("delta", 0, "Hm"), ("delta", 0, ", yes."), ("close", 0, ""),
                              ("open", 1, ""), ("delta", 1, "\nParis.")]
    assert [(b.kind, b.text) for b in stream.blocks] == [("reasoning", "Hm, yes."), ("text", "\nParis.")]


def test_whitespace_before_a_call_is_no_block_but_before_text_it_is_kept():
    stream = BlockStream()
    assert stream.feed([TextDelta("\n ")]) == []
    assert [b.kind for b in (stream.feed([CallDelta(0, "{}", "c", "f")]) and stream.blocks)] == ["call"]
    stream = BlockStream()
    stream.feed([TextDelta("\n ")])
    stream.feed([TextDelta("Hi")])
    stream.close()
    assert [b.text for b in stream.blocks] == ["\n Hi"]


def test_a_whole_answer_and_a_call_cut_short():
    blocks = blocks_of(Answer([CallDelta(0, '{"x": ', "c", "f")], "length"))
    assert [(b.kind, b.name) for b in blocks] == [("call", "f")] and blocks[0].arguments() == {}
    assert blocks_of(Answer([], "stop")) == []
