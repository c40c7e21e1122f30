"""A chat answer as a sequence of content blocks, the shape both the Responses API (output items)
and Anthropic's Messages API (content blocks) give it: text, then tool calls, each block opened,
written to and closed in turn. Built from the chat choice's deltas (responses.ChatChoice), which
already read the tool calls out of the model's text, streamed or whole."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ..engine.request import TokenOutput
from .responses import Choice


@dataclass
class Block:
    position: int  # its place among the answer's blocks
    kind: Literal["text", "call"]
    text: str = ""  # the text, or a call's arguments (JSON) as far as written
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
        self._calls: dict[int, Block] = {}  # the chat delta's call index -> its block

    def feed(self, delta: dict[str, Any]) -> list[BlockEvent]:
        events = self._text(delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def read(self, choice: Choice, text: str, outputs: list[TokenOutput]) -> list[BlockEvent]:
        """A streamed choice's text as block events."""
        return self.feed(choice.chunk(text, outputs, None)["delta"])

    def end(self, choice: Choice, reason: str) -> tuple[list[BlockEvent], str]:
        """The choice's end: its last events, the open block closed, and the finish reason the choice
        gives (tool_calls when it made calls)."""
        chunk = choice.chunk("", [], reason)
        return [*self.feed(chunk["delta"]), *self.close()], chunk["finish_reason"]

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

    def _text(self, text: str) -> list[BlockEvent]:
        if not text:
            return []
        events: list[BlockEvent] = []
        if self.open is None or self.open.kind != "text":
            if not (self._space + text).strip():
                self._space += text
                return []
            text, self._space = self._space + text, ""
            events = self._open(Block(len(self.blocks), "text"))
        assert self.open is not None
        self.open.text += text
        return [*events, BlockEvent("delta", self.open, text)]

    def _call(self, call: dict[str, Any]) -> list[BlockEvent]:
        function = call.get("function") or {}
        events: list[BlockEvent] = []
        if call.get("id"):  # a call's first delta names it
            block = Block(len(self.blocks), "call", call_id=call["id"], name=function.get("name", ""))
            self._calls[call["index"]] = block
            events = self._open(block)
        block = self._calls[call["index"]]
        fragment = function.get("arguments") or ""
        if fragment:
            block.text += fragment
            events.append(BlockEvent("delta", block, fragment))
        return events


def blocks_of(message: dict[str, Any]) -> list[Block]:
    """A whole chat message (ChatChoice.final's) as blocks."""
    stream = BlockStream()
    calls = [{**call, "index": i} for i, call in enumerate(message.get("tool_calls") or [])]
    stream.feed({"content": message.get("content"), "tool_calls": calls})
    stream.close()
    return stream.blocks
