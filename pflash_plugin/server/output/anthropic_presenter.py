"""Anthropic's Messages API out: a message with content blocks (thinking, text, tool_use), or its
stream of events (message_start, content_block_start/delta/stop, message_delta, message_stop)."""
from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from starlette.responses import JSONResponse

from ...engine.request import ErrorEvent, FinishEvent, TextEvent
from ..runtime.generation import Generation
from ..wire.anthropic_errors import error_body
from ..wire.errors import http_of
from ..wire.usage import Totals, anthropic_usage
from .blocks import Block, BlockEvent, BlockStream, blocks_of, chat_choice
from .presenters import Sse, sse


def stop_reason(finish: str, stop: str | None, client_stops: list[str]) -> tuple[str, str | None]:
    """The chat finish reason as Anthropic's stop_reason and stop_sequence: a stop string of the
    chat template (its end-of-turn marker) is the end of the turn, not the client's stop sequence."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stop is not None and stop in client_stops:
        return "stop_sequence", stop
    return "end_turn", None


def _block(block: Block) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    if block.kind == "reasoning":  # no signature: the server signs nothing, and takes thinking back unsigned
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments()}


def _delta(block: Block, fragment: str) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text_delta", "text": fragment}
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": fragment}
    return {"type": "input_json_delta", "partial_json": fragment}


def _rendered(event: BlockEvent) -> list[Sse]:
    block, at = event.block, event.block.position
    if event.kind == "open":
        start = {**_block(block), "input": {}} if block.kind == "call" else _block(replace(block, text=""))
        return [sse({"type": "content_block_start", "index": at, "content_block": start}, "content_block_start")]
    if event.kind == "delta":
        delta = _delta(block, event.fragment)
        return [sse({"type": "content_block_delta", "index": at, "delta": delta}, "content_block_delta")]
    signed = [sse({"type": "content_block_delta", "index": at, "delta": {"type": "signature_delta", "signature": ""}},
                  "content_block_delta")] if block.kind == "reasoning" else []
    return [*signed, sse({"type": "content_block_stop", "index": at}, "content_block_stop")]


class MessagesPresenter:
    """One message (Anthropic has no n): choice 0 of the generation."""

    def __init__(self, gen: Generation, client_stops: list[str]) -> None:
        self.gen, self.client_stops = gen, client_stops
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks = BlockStream()
        self.stop: tuple[str, str | None] = ("end_turn", None)

    def _message(self, content: list[dict], stop: tuple[str | None, str | None], used: dict) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.gen.served.name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": used}

    def head(self) -> list[Sse]:
        used = {"input_tokens": self.gen.prompt_tokens, "output_tokens": 0}
        return [sse({"type": "message_start", "message": self._message([], (None, None), used)}, "message_start"),
                sse({"type": "ping"}, "ping")]

    def delta(self, index: int, event: TextEvent) -> list[Sse]:
        events = self.blocks.read(chat_choice(self.gen.choices[index]), event.text, event.tokens)
        return [item for e in events for item in _rendered(e)]

    def finish(self, index: int, event: FinishEvent) -> list[Sse]:
        events, reason = self.blocks.end(chat_choice(self.gen.choices[index]), event.reason)
        self.stop = stop_reason(reason, event.stop, self.client_stops)
        return [item for e in events for item in _rendered(e)]

    def done(self, used: Totals) -> list[Sse]:
        delta = {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}
        return [sse({"type": "message_delta", "delta": delta, "usage": anthropic_usage(used)}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]

    def stream_error(self, event: ErrorEvent) -> list[Sse]:
        return [sse(error_body(http_of(event.kind).status, event.message), "error")]

    def body(self, finals: list[dict], ends: list[FinishEvent], used: Totals) -> dict:
        answer = chat_choice(self.gen.choices[0]).finished(ends[0].reason)
        content = [_block(block) for block in blocks_of(answer)]
        return self._message(content, stop_reason(answer.finish_reason, ends[0].stop, self.client_stops),
                             anthropic_usage(used))

    def error(self, event: ErrorEvent) -> JSONResponse:
        status = http_of(event.kind).status
        return JSONResponse(error_body(status, event.message), status)
