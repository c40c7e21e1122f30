"""The OpenAI response shapes: typed models (for the OpenAPI schema) and the builders that turn one
engine request's output into one choice, streamed or whole."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Protocol, Union

from pydantic import BaseModel, ConfigDict

from ...chat.deltas import CallDelta, Delta, ReasoningDelta, TextDelta, call_deltas, merged
from ...chat.reasoning import Reader
from ...chat.tool_calls import ToolCallReader
from ...engine.request import TokenOutput

Piece = Callable[[int], bytes]


# ---- typed response models -------------------------------------------------------------------
class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")  # timings, pflash report
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[Dict[str, int]] = None
    completion_tokens_details: Optional[Dict[str, int]] = None
    timings: Optional[Dict[str, Any]] = None


class CompletionLogprobsModel(BaseModel):
    tokens: List[str]
    text_offset: List[int]
    token_logprobs: List[Optional[float]]
    top_logprobs: List[Optional[Dict[str, float]]]


class CompletionChoiceModel(BaseModel):
    text: str
    index: int
    logprobs: Optional[CompletionLogprobsModel] = None
    finish_reason: Optional[str] = None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Optional[Usage] = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: List[CompletionChoiceModel]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # the model's thinking, split from content (docs/reasoning.md)
    tool_calls: Optional[List[ToolCall]] = None


class ChatChoiceModel(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: List[ChatChoiceModel]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: Union[List[float], str]  # str: base64 of little-endian float32 (encoding_format=base64)
    index: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: List[Embedding]
    model: str
    usage: Dict[str, int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "me"
    permissions: List[str] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# every 4xx is an OpenAI error body (documenting 4XX also keeps FastAPI's 422 out of the schema)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {"4XX": {"model": ErrorResponse, "description": "An OpenAI error"}}
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {
        "type": "string", "title": "SSE chunks, when stream=true, ending with data: [DONE]"}}}},
}


# ---- envelopes ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def envelope(rid: str, obj: str, model: str, choices: list, usage: dict | None = None) -> dict:
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


# ---- logprobs -------------------------------------------------------------------------------
def _text(piece: Piece, token: int) -> str:
    return piece(token).decode("utf-8", errors="replace")


class CompletionLogprobs:
    """Accumulates the legacy /v1/completions logprobs object."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self._offset = 0

    def add(self, outputs: list[TokenOutput]) -> dict[str, Any]:
        start = len(self.tokens)
        for out in outputs:
            text = _text(self.piece, out.token)
            self.tokens.append(text)
            self.text_offset.append(self._offset)
            self._offset += len(text)
            self.token_logprobs.append(out.logprob)
            self.top_logprobs.append({_text(self.piece, t): lp for t, lp in out.top_logprobs or []})
        return self.as_dict(start)

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "text_offset": self.text_offset[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
        }


def chat_logprobs(piece: Piece, outputs: list[TokenOutput], ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs; `ids`: each token's id too (llama-server's completion_probabilities)."""
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        raw = piece(token)
        shown = {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
        return {"id": token, **shown} if ids else shown

    return [
        {**entry(o.token, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top_logprobs or []]}
        for o in outputs
    ]


# ---- choices --------------------------------------------------------------------------------
class Choice(Protocol):
    """One choice of a response, fed the engine output of one request."""

    index: int

    @property
    def reasoning_tokens(self) -> int:
        """The tokens the choice spent thinking (usage's reasoning_tokens)."""

    def head(self) -> dict | None:
        """The choice's first streamed delta, sent before any token (or None)."""

    def chunk(self, text: str, outputs: list[TokenOutput], finish: str | None) -> dict:
        """A streamed delta."""

    def add(self, text: str, outputs: list[TokenOutput]) -> None:
        """Accumulate output for the whole (non-streamed) choice."""

    def final(self, finish: str) -> dict:
        """The whole choice."""


class CompletionChoice:
    def __init__(self, index: int, piece: Piece, echo: str, logprobs: bool) -> None:
        self.index, self.echo = index, echo
        self.texts: list[str] = [echo]
        self.logprobs = CompletionLogprobs(piece) if logprobs else None

    @property
    def reasoning_tokens(self) -> int:
        return 0  # a completion's text is not read for thinking

    def head(self) -> dict | None:
        return self.chunk(self.echo, [], None) if self.echo else None

    def chunk(self, text: str, outputs: list[TokenOutput], finish: str | None) -> dict:
        logprobs = self.logprobs.add(outputs) if self.logprobs else None
        return {"text": text, "index": self.index, "logprobs": logprobs, "finish_reason": finish}

    def add(self, text: str, outputs: list[TokenOutput]) -> None:
        self.texts.append(text)
        if self.logprobs:
            self.logprobs.add(outputs)

    def final(self, finish: str) -> dict:
        logprobs = self.logprobs.as_dict() if self.logprobs else None
        return {"text": "".join(self.texts), "index": self.index, "logprobs": logprobs, "finish_reason": finish}


@dataclass(frozen=True)
class Answer:
    """A whole chat choice as typed deltas (one per block: reasoning, text, each call), and the
    finish reason its readers give (tool_calls when it made calls)."""

    deltas: list[Delta]
    finish_reason: str


class ChatChoice:
    """A chat choice: its text read by the reasoning reader (thinking split from the answer), then
    the content by the tool-call reader, whose calls' text is held back and becomes tool calls.
    Both read streamed and whole text alike; their output is typed deltas (chat/deltas.py)."""

    def __init__(self, index: int, piece: Piece, logprobs: bool, tools: ToolCallReader | None = None,
                 reasoning: Reader | None = None) -> None:
        self.index, self.piece, self.tools, self.reasoning = index, piece, tools, reasoning
        self.parts: list[Delta] = []  # a whole choice's reasoning and content, as read so far
        self.logprobs: list | None = [] if logprobs else None
        self.answer: Answer | None = None  # the whole choice, once finished

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.tokens if self.reasoning is not None else 0

    def head(self) -> dict | None:
        # the role alone, as stock sends it: a client that checks each content delta is non-empty passes
        return {"index": self.index, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}

    def _split(self, text: str, outputs: list[TokenOutput], finish: str | None) -> list[Delta]:
        """`text` as reasoning and content deltas."""
        if self.reasoning is None:
            return [TextDelta(text)] if text else []
        deltas = self.reasoning.feed(text, len(outputs))
        return deltas + self.reasoning.finish() if finish is not None else deltas

    def _read(self, parts: list[Delta], finish: str | None, stream: bool) -> tuple[list[Delta], str | None]:
        """The reasoning, then the content to release and the tool calls; the finish reason."""
        thought = [d for d in parts if isinstance(d, ReasoningDelta)]
        content = "".join(d.text for d in parts if isinstance(d, TextDelta))
        calls: list[dict] = []
        if self.tools is not None:
            content, calls, finish = self.tools.read(content, finish, stream)
        return [*thought, *([TextDelta(content)] if content else []), *call_deltas(calls)], finish

    def step(self, text: str, outputs: list[TokenOutput], finish: str | None) -> tuple[list[Delta], str | None]:
        """A streamed step: its deltas and, at the end, the finish reason."""
        return self._read(self._split(text, outputs, finish), finish, stream=True)

    def chunk(self, text: str, outputs: list[TokenOutput], finish: str | None) -> dict:
        logprobs = {"content": chat_logprobs(self.piece, outputs)} if self.logprobs is not None else None
        deltas, finish = self.step(text, outputs, finish)
        return {"index": self.index, "delta": openai_delta(deltas), "logprobs": logprobs, "finish_reason": finish}

    def add(self, text: str, outputs: list[TokenOutput]) -> None:
        self.parts += self._split(text, outputs, None)
        if self.logprobs is not None:
            self.logprobs.extend(chat_logprobs(self.piece, outputs))

    def finished(self, finish: str) -> Answer:
        """The whole choice (read once: later calls return the same answer)."""
        if self.answer is None:
            deltas, reason = self._read(self.parts + self._split("", [], finish), finish, stream=False)
            self.answer = Answer(merged(deltas), reason or finish)
        return self.answer

    def final(self, finish: str) -> dict:
        answer = self.finished(finish)
        logprobs = {"content": self.logprobs} if self.logprobs is not None else None
        return {"index": self.index, "message": openai_message(answer.deltas), "logprobs": logprobs,
                "finish_reason": answer.finish_reason}


def openai_delta(deltas: list[Delta]) -> dict[str, Any]:
    """A streamed step's deltas as an OpenAI chunk's `delta`: its texts joined, each call one entry
    of tool_calls, its header (id, name) in its first chunk. A call's deltas of one step join in
    its entry: OpenAI never sends two entries of one index in a chunk, and a client that reads
    `tool_calls[0]` lost the arguments' start (`{"`) of a forced call's second entry."""
    delta: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    for part in deltas:
        if isinstance(part, ReasoningDelta):
            delta["reasoning_content"] = delta.get("reasoning_content", "") + part.text
        elif isinstance(part, TextDelta):
            delta["content"] = delta.get("content", "") + part.text
        elif calls and calls[-1]["index"] == part.index:
            calls[-1]["function"]["arguments"] += part.arguments
        elif part.opens:
            calls.append({"index": part.index, "id": part.id, "type": "function",
                          "function": {"name": part.name, "arguments": part.arguments}})
        else:
            calls.append({"index": part.index, "function": {"arguments": part.arguments}})
    if calls:
        delta["tool_calls"] = calls
    return delta


def openai_message(deltas: list[Delta]) -> dict[str, Any]:
    """A whole choice's deltas (merged: one per block) as an OpenAI chat message."""
    thought = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    calls = [{"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
             for d in deltas if isinstance(d, CallDelta)]
    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
    if thought:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = calls
    return message
