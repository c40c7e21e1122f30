"""OpenAI request types (llama_cpp.server's, extended), the error shape, and sampling parameters."""
from __future__ import annotations

import math
from typing import List, Literal, Optional, Union

from llama_cpp.server.types import CreateChatCompletionRequest as StockChatRequest
from llama_cpp.server.types import CreateCompletionRequest as StockCompletionRequest
from pydantic import BaseModel, Field

from ..engine.request import SamplingParams


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


MAX_N = 128  # choices per request: each one is an engine request

# OpenAI accepts a prompt as text, token ids, or a batch of either
Prompt = Union[str, List[str], List[int], List[List[int]]]


class CompletionRequest(StockCompletionRequest, _Extensions):
    prompt: Prompt = Field(default="", description="Text or token ids, or a list of either (one choice set each).")
    n: Optional[int] = Field(default=1, ge=1, le=MAX_N, description="Samples per prompt.")


class ChatCompletionRequest(StockChatRequest, _Extensions):
    n: Optional[int] = Field(default=1, ge=1, le=MAX_N, description="Samples of the conversation.")


class RequestError(Exception):
    """A bad request caught after validation: becomes an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is -100..100


def _check_sampling_numbers(body: CompletionRequest | ChatCompletionRequest, logit_bias: dict[int, float]) -> None:
    """JSON as Python reads it allows NaN and Infinity: no such number reaches llama.cpp."""
    for name in ("temperature", "repeat_penalty"):
        if not math.isfinite(getattr(body, name)):
            raise RequestError(400, f"{name} must be a finite number", param=name)
    if body.temperature < 0:
        raise RequestError(400, "temperature must be >= 0", param="temperature")
    for token, bias in logit_bias.items():
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails this too
            raise RequestError(400, f"logit_bias of token {token} is {bias}: the range is -100..100", param="logit_bias")


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    grammar: str | None,
    logit_bias: dict[int, float],
) -> SamplingParams:
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    _check_sampling_numbers(body, logit_bias)
    if logprobs is not None and logprobs > MAX_LOGPROBS:  # each token would carry that many alternatives
        param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise RequestError(400, f"at most {MAX_LOGPROBS} log probabilities per token", param=param)
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
