"""A chat answer as a sequence of content blocks, the shape both the Responses API (output items)
and Anthropic's Messages API (content blocks) give it: reasoning, text, then tool calls, each block
opened, written to and closed in turn. Built from the chat choice's typed deltas (chat/deltas.py,
from responses.ChatChoice, which already read the thinking and the tool calls out of the model's
text, streamed or whole)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ...chat.deltas import CallDelta, Delta, ReasoningDelta, TextDelta
from ...engine.request import TokenOutput
from ..wire.responses import Answer, ChatChoice, Choice

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    position: int  # its place among the answer's blocks
    kind: BlockKind
    text: str = ""  # the text (or reasoning), or a call's arguments (JSON) as far as written
    call_id: str = ""
    name: str = ""

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object (a call the model cut short has none)."""
        try:
            value = json.loads(self.text or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {"value": value}


@dataclass(frozen=True)
class BlockEvent:
    kind: Literal["open", "delta", "close"]
    block: Block
    fragment: str = ""  # a delta's text


class BlockStream:
    """Chat deltas in, block events out. Whitespace before the first text is held: when calls
    follow it, it is no text block of its own."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self._space = ""
        self._calls: dict[int, Block] = {}  # the delta's call index -> its block

    def feed(self, deltas: list[Delta]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in deltas:
            if isinstance(delta, TextDelta):
                events += self._text(delta.text)
            elif isinstance(delta, ReasoningDelta):
                events += self._write("reasoning", delta.text)
            else:
                events += self._call(delta)
        return events

    def read(self, choice: ChatChoice, text: str, outputs: list[TokenOutput]) -> list[BlockEvent]:
        """A streamed choice's text as block events."""
        return self.feed(choice.step(text, outputs, None)[0])

    def end(self, choice: ChatChoice, reason: str) -> tuple[list[BlockEvent], str]:
        """The choice's end: its last events, the open block closed, and the finish reason the choice
        gives (tool_calls when it made calls)."""
        deltas, finish = choice.step("", [], reason)
        return [*self.feed(deltas), *self.close()], finish or reason

    def close(self) -> list[BlockEvent]:
        """Close the open block (at the end of the answer, or when the next one opens)."""
        self._space = ""
        if self.open is None:
            return []
        closed, self.open = self.open, None
        return [BlockEvent("close", closed)]

    def _open(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self.open = block
        return [*events, BlockEvent("open", block)]

    def _write(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        """`text` into the open block of `kind`, opened first unless it is open."""
        events: list[BlockEvent] = []
        if self.open is None or self.open.kind != kind:
            events = self._open(Block(len(self.blocks), kind))
        assert self.open is not None
        self.open.text += text
        return [*events, BlockEvent("delta", self.open, text)]

    def _text(self, text: str) -> list[BlockEvent]:
        if not text:
            return []
        if self.open is None or self.open.kind != "text":
            if not (self._space + text).strip():
                self._space += text
                return []
            text, self._space = self._space + text, ""
        return self._write("text", text)

    def _call(self, call: CallDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if call.opens:  # a call's first delta names it
            block = Block(len(self.blocks), "call", call_id=call.id, name=call.name)
            self._calls[call.index] = block
            events = self._open(block)
        block = self._calls[call.index]
        if call.arguments:
            block.text += call.arguments
            events.append(BlockEvent("delta", block, call.arguments))
        return events


def chat_choice(choice: Choice) -> ChatChoice:
    """A generation's choice as the chat choice the block APIs (Responses, Messages) always make."""
    assert isinstance(choice, ChatChoice), "the block APIs answer chat requests"
    return choice


def blocks_of(answer: Answer) -> list[Block]:
    """A whole chat choice (ChatChoice.finished's) as blocks."""
    stream = BlockStream()
    stream.feed(answer.deltas)
    stream.close()
    return stream.blocks
