"""The OpenAI Responses API out: a response object with output items (reasoning, a message of
output_text, function calls), or its stream of named events (response.created ... response.completed), each
with its sequence_number."""
from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.responses import JSONResponse

from ...engine.request import ErrorEvent, FinishEvent, TextEvent
from ..runtime.generation import Generation
from ..wire.errors import http_of
from ..wire.responses_protocol import ResponsesRequest
from ..wire.usage import Totals, reasoning_tokens, responses_usage
from .blocks import Block, BlockEvent, BlockStream, blocks_of, chat_choice
from .presenters import Sse, openai_error, sse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesPresenter:
    """One response (the API has no n): choice 0 of the generation. Item ids are fixed per block,
    so the streamed items and the final response name them alike."""

    def __init__(self, gen: Generation, body: ResponsesRequest) -> None:
        self.gen, self.request = gen, body
        self.id, self.created = _id("resp"), int(time.time())
        self.blocks = BlockStream()
        self.item_ids: dict[int, str] = {}
        self.sequence = 0
        self.finish_reason = "stop"
        self.ending = False  # in finish(): the blocks closed now were open when the answer ended
        self.closed: dict[int, str] = {}  # each streamed item's status at its output_item.done

    # ---- shapes shared by the stream and the body ---------------------------------------------
    def _item(self, block: Block, status: str) -> dict[str, Any]:
        item_id = self.item_ids.setdefault(block.position, _id(_PREFIX[block.kind]))
        done = status != "in_progress"  # completed, or incomplete: cut by max_output_tokens, its text so far
        if block.kind == "text":
            return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                    "content": [_part(block.text)] if done else []}
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
                    "content": [_part(block.text, "reasoning_text")] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
                "arguments": block.text if done else "", "status": status}

    def _response(self, status: str, output: list[dict], used: Totals | None) -> dict[str, Any]:
        body = self.request
        form = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else \
            {"type": "text"}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.gen.served.name, "output": output, "output_text": text, "error": None,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "text": {"format": form}, "store": False, "previous_response_id": None, "truncation": "disabled",
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "usage": responses_usage(used, reasoning_tokens(self.gen.choices)) if used is not None else None,
        }

    def _status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def _closing_status(self) -> str:
        """An item closed at an answer cut by max_output_tokens is incomplete (as OpenAI marks it);
        any other closed item is completed."""
        return "incomplete" if self.ending and self._status() == "incomplete" else "completed"

    # ---- the stream ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Sse:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def _rendered(self, event: BlockEvent) -> list[Sse]:
        block, at = event.block, event.block.position
        if event.kind == "open":
            added = [self._event("response.output_item.added", output_index=at, item=self._item(block, "in_progress"))]
            if block.kind != "call":
                added.append(self._event("response.content_part.added", item_id=self.item_ids[at], output_index=at,
                                         content_index=0, part=_part("", _PART[block.kind])))
            return added
        where = {"item_id": self.item_ids[at], "output_index": at}
        if event.kind == "delta":
            if block.kind == "text":
                return [self._event("response.output_text.delta", **where, content_index=0, delta=event.fragment,
                                    logprobs=[])]
            if block.kind == "reasoning":
                return [self._event("response.reasoning_text.delta", **where, content_index=0, delta=event.fragment)]
            return [self._event("response.function_call_arguments.delta", **where, delta=event.fragment)]
        if block.kind == "text":
            closing = [self._event("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[]),
                       self._event("response.content_part.done", **where, content_index=0, part=_part(block.text))]
        elif block.kind == "reasoning":
            part = _part(block.text, "reasoning_text")
            closing = [self._event("response.reasoning_text.done", **where, content_index=0, text=block.text),
                       self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            closing = [self._event("response.function_call_arguments.done", **where, name=block.name,
                                   arguments=block.text)]
        status = self.closed[at] = self._closing_status()
        done = self._event("response.output_item.done", output_index=at, item=self._item(block, status))
        return [*closing, done]

    def head(self) -> list[Sse]:
        started = self._response("in_progress", [], None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def delta(self, index: int, event: TextEvent) -> list[Sse]:
        events = self.blocks.read(chat_choice(self.gen.choices[index]), event.text, event.tokens)
        return [item for e in events for item in self._rendered(e)]

    def finish(self, index: int, event: FinishEvent) -> list[Sse]:
        events, reason = self.blocks.end(chat_choice(self.gen.choices[index]), event.reason)
        self.finish_reason, self.ending = reason, True
        return [item for e in events for item in self._rendered(e)]

    def done(self, used: Totals) -> list[Sse]:
        output = [self._item(block, self.closed.get(block.position, "completed")) for block in self.blocks.blocks]
        status = self._status()
        return [self._event(f"response.{status}", response=self._response(status, output, used))]

    def stream_error(self, event: ErrorEvent) -> list[Sse]:
        return [self._event("error", code=http_of(event.kind).code, message=event.message, param=None)]

    # ---- the whole body -----------------------------------------------------------------------
    def body(self, finals: list[dict], ends: list[FinishEvent], used: Totals) -> dict:
        answer = chat_choice(self.gen.choices[0]).finished(ends[0].reason)
        self.finish_reason = answer.finish_reason
        blocks = blocks_of(answer)
        cut = len(blocks) - 1 if self._status() == "incomplete" else None  # the last item: the one being written
        output = [self._item(block, "incomplete" if i == cut else "completed") for i, block in enumerate(blocks)]
        return self._response(self._status(), output, used)

    def error(self, event: ErrorEvent) -> JSONResponse:
        return openai_error(event)


_PREFIX = {"text": "msg", "reasoning": "rs", "call": "fc"}  # item ids by block kind
_PART = {"text": "output_text", "reasoning": "reasoning_text"}  # content part types by block kind


def _part(text: str, kind: str = "output_text") -> dict[str, Any]:
    if kind == "reasoning_text":
        return {"type": kind, "text": text}
    return {"type": kind, "text": text, "annotations": [], "logprobs": []}
