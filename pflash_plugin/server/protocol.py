"""OpenAI request types (llama_cpp.server's, extended) and the response shapes we send back."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional

from llama_cpp.server.types import CreateChatCompletionRequest as StockChatRequest
from llama_cpp.server.types import CreateCompletionRequest as StockCompletionRequest
from pydantic import BaseModel, Field

from ..engine.request import SamplingParams, TokenOutput


class StreamOptions(BaseModel):
    include_usage: bool = False


class PflashOverride(BaseModel):
    """Per-request PFlash control."""

    mode: Optional[Literal["off", "auto", "always"]] = None
    keep_ratio: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    query: Optional[str] = Field(default=None, description="Text whose tokens score the prompt.")


class _Extensions(BaseModel):
    stream_options: Optional[StreamOptions] = None
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    pflash: Optional[PflashOverride] = None


class CompletionRequest(StockCompletionRequest, _Extensions):
    pass


class ChatCompletionRequest(StockChatRequest, _Extensions):
    pass


class RequestError(Exception):
    """A bad request caught after validation: becomes an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    grammar: str | None,
    logit_bias: dict[int, float],
) -> SamplingParams:
    if (body.n or 1) != 1:
        raise RequestError(400, "only n=1 is supported", param="n")
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    if body.temperature < 0:
        raise RequestError(400, "temperature must be >= 0", param="temperature")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        typical_p=body.typical_p,
        seed=body.seed,
        stop=stop,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repeat_penalty=body.repeat_penalty,
        logit_bias=logit_bias,
        logprobs=logprobs,
        grammar=grammar,
        min_tokens=body.min_tokens,
        mirostat=body.mirostat_mode,
        mirostat_tau=body.mirostat_tau,
        mirostat_eta=body.mirostat_eta,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class CompletionLogprobs:
    """Accumulates the legacy /v1/completions logprobs object."""

    def __init__(self, piece) -> None:
        self.piece = piece
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self._offset = 0

    def add(self, outputs: list[TokenOutput]) -> dict[str, Any]:
        start = len(self.tokens)
        for out in outputs:
            text = self.piece(out.token).decode("utf-8", errors="replace")
            self.tokens.append(text)
            self.text_offset.append(self._offset)
            self._offset += len(text)
            self.token_logprobs.append(out.logprob)
            self.top_logprobs.append(
                {self.piece(t).decode("utf-8", errors="replace"): lp for t, lp in out.top_logprobs or []}
            )
        return self.as_dict(start)

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "text_offset": self.text_offset[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
        }


def chat_logprobs(piece, outputs: list[TokenOutput]) -> list[dict[str, Any]]:
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        raw = piece(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(o.token, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top_logprobs or []]}
        for o in outputs
    ]


def _envelope(rid: str, obj: str, model: str, choices: list, usage: dict | None = None) -> dict:
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def _chat_logprobs(logprobs: list | None) -> dict | None:
    return {"content": logprobs} if logprobs is not None else None


def completion_response(rid: str, model: str, text: str, finish: str, usage: dict, logprobs: dict | None) -> dict:
    choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
    return _envelope(rid, "text_completion", model, [choice], usage)


def completion_chunk(rid: str, model: str, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return _envelope(rid, "text_completion", model, [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}])


def chat_response(rid: str, model: str, text: str, finish: str, usage: dict, logprobs: list | None) -> dict:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": _chat_logprobs(logprobs), "finish_reason": finish}
    return _envelope(rid, "chat.completion", model, [choice], usage)


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, logprobs: list | None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(logprobs), "finish_reason": finish}
    return _envelope(rid, "chat.completion.chunk", model, [choice])


def usage_chunk(rid: str, model: str, obj: str, usage: dict) -> dict:
    return _envelope(rid, obj, model, [], usage)
