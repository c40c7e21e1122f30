"""OpenAI request types (llama_cpp.server's, extended), the error shape, and sampling parameters."""
from __future__ import annotations

import functools
import math
from typing import Annotated, Any, Dict, List, Literal, Optional, Union, get_args

from llama_cpp.llama_types import ChatCompletionMessageToolCalls, ChatCompletionRequestAssistantMessageFunctionCall
from llama_cpp.server.types import CreateChatCompletionRequest as StockChatRequest
from llama_cpp.server.types import CreateCompletionRequest as StockCompletionRequest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic import StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, TypedDict

from ...chat.switches import reserved_keys, template_kwargs
from ...engine.request import SamplingParams
from .peer_fields import LlamaServerFields, VllmFields
from .request_error import RequestError
from .schema_shape import first_shape_error


class StreamOptions(BaseModel):
    include_usage: bool = False


PflashMode = Literal["off", "auto", "always"]


class PflashOverride(BaseModel):
    """Per-request PFlash control."""

    mode: Optional[PflashMode] = None
    keep_ratio: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    query: Optional[str] = Field(default=None, description="Text whose tokens score the prompt.")


class NullIsDefault(BaseModel):
    """A request model whose fields sent as null take their defaults where their type has no null."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A field sent as null that does not take null gets its default, as OpenAI reads null for
        `temperature`, `top_p`, `stream` and the rest (the openai SDK sends null for an argument
        given as None); stock's types refused it with a 422."""
        if isinstance(data, dict) and None in data.values():
            defaulted = _defaulted_by_null(cls)
            return {key: value for key, value in data.items() if value is not None or key not in defaulted}
        return data


class LoraScale(BaseModel):
    """One entry of llama-server's LoRA scale lists (wire/lora.py)."""

    id: StrictInt
    scale: float = 0.0


class _Extensions(NullIsDefault, LlamaServerFields, VllmFields):
    stream_options: Optional[StreamOptions] = None
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    pflash: Optional[PflashOverride] = None
    priority: int = Field(default=0, description="vLLM's field: under --schedule_policy priority a queued request "
                          "with a lower value takes a free slot first (ties in arrival order); otherwise ignored.")
    speculative: bool = Field(default=True, description="False: no speculative decoding for this request (where the "
                              "server speculates: --draft_model); the text is the same either way for greedy requests.")
    lora: Optional[List[LoraScale]] = Field(default=None, description="llama-server's per-request LoRA scales "
                                            "([{id, scale}], the unlisted 0): only the server's own are served here.")
    ignore_eos: bool = Field(default=False, description="llama-server's and vLLM's field: end-of-generation tokens "
                             "are held back until max_tokens (min_tokens = max_tokens); stop strings still stop.")


@functools.cache
def _defaulted_by_null(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` with a default whose type does not take None."""
    return frozenset(name for name, field in model.model_fields.items()
                     if not field.is_required() and not _takes_none(field.annotation))


def _takes_none(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in get_args(annotation)


MAX_N = 128  # choices per request: each one is an engine request

# OpenAI accepts a prompt as text, token ids, or a batch of either. Each list stops at its first bad
# item: the union tries every member, and a prompt of 22K token ids took 6 ms of the event loop to
# fail as a list of strings with an error per id (0.3 ms this way; the same values either way).
_FAIL_FAST = Field(fail_fast=True)
TokenIds = Annotated[List[int], _FAIL_FAST]


def _prompt_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A prompt of none of its four shapes is one error naming them: each member's error alone
    named a wrong item (`[1, "a"]`: item 0, "a valid string")."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("prompt_shape", "Input should be a string, a list of strings, a list of token ids "
                                  "(integers) or a list of token id lists") from None


Prompt = Annotated[Union[str, Annotated[List[str], _FAIL_FAST], TokenIds, Annotated[List[TokenIds], _FAIL_FAST]],
                   WrapValidator(_prompt_shape)]


class ContentPart(BaseModel):
    """One part of a message's content. Any type validates here so that `message_text` can say
    which part the server cannot take, by its field, rather than a union error about roles."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class _Message(BaseModel):
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None


class SystemMessage(_Message):
    # "developer": OpenAI's name for the system role of newer models, which the SDK and agent
    # frameworks send; rendered as a system message (as OpenAI does for models without that role)
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    reasoning_content: Optional[str] = Field(
        default=None, description="The turn's thinking, as the answer gave it: passed to the template, which "
        "renders it where the model reads it (Qwen3: within the turn's <think> block) or leaves it out.")
    tool_calls: Optional[ChatCompletionMessageToolCalls] = None
    function_call: Optional[ChatCompletionRequestAssistantMessageFunctionCall] = None


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str


class FunctionMessage(_Message):
    role: Literal["function"]
    name: str


# tagged by role: a bad message is reported under its own role, never as a failed `system` message
Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage],
                    Field(discriminator="role")]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the grammar enforces the schema either way


class ResponseFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema",
                                              description="json_object's schema (llama_cpp's extension).")
    json_schema: Optional[JsonSchemaFormat] = None

    def schema_for_grammar(self) -> Optional[Dict[str, Any]]:
        """The JSON schema the output must follow; None: any JSON value."""
        if self.type != "json_schema":
            return self.schema_
        if self.json_schema is None:
            raise RequestError(400, "response_format.json_schema is required when type is json_schema",
                               param="response_format.json_schema")
        return self.json_schema.schema_


class CompletionRequest(StockCompletionRequest, _Extensions):
    # wider than the stock field: token ids too
    prompt: Prompt = Field(  # type: ignore[assignment]
        default="", description="Text or token ids, or a list of either (one choice set each).")
    n: Optional[int] = Field(default=1, ge=1, le=MAX_N, description="Samples per prompt.")
    response_format: Optional[ResponseFormat] = Field(
        default=None, description="json_object or json_schema: the text is constrained by a grammar, as in chat.")


class FunctionDefinition(TypedDict):
    name: str
    description: NotRequired[str]
    parameters: NotRequired[Dict[str, Any]]  # OpenAI: omitted, the function takes no arguments


class FunctionTool(TypedDict):
    type: Literal["function"]
    function: FunctionDefinition


NO_PARAMETERS: Dict[str, Any] = {"type": "object", "properties": {}}


class ChatCompletionRequest(StockChatRequest, _Extensions):
    messages: List[Message] = Field(default=[],  # type: ignore[assignment]  # our message models
                                    description="The conversation; content as text or a list of text parts.")
    response_format: Optional[ResponseFormat] = None  # type: ignore[assignment]  # adds json_schema
    n: Optional[int] = Field(default=1, ge=1, le=MAX_N, description="Samples of the conversation.")
    parallel_tool_calls: Optional[bool] = Field(
        default=None, description="false: at most one tool call per answer (default: any number).")
    tools: Optional[List[FunctionTool]] = Field(  # type: ignore[assignment]  # parameters optional, as OpenAI
        default=None, description="Functions the model may call; one without parameters takes no arguments.")
    max_completion_tokens: Optional[int] = Field(
        default=None, description="OpenAI's current name for max_tokens, with the same meaning (LangChain sends it).")
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        default=None, description="Variables for the chat template (e.g. enable_thinking), over the server's "
        "chat_template_kwargs setting, as llama-server and vLLM take them.")
    reasoning_format: Optional[Literal["auto", "deepseek", "none"]] = Field(
        default=None, description="This request's --reasoning_format (llama-server's field): none leaves the "
        "thinking in the content; deepseek reads <think> tags on any template (docs/reasoning.md).")
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = Field(
        default=None, description="none or minimal: no thinking (the template's enable_thinking false); low and up: "
        "thinking on; gpt-oss's effort (low, medium or high) either way (docs/reasoning.md).")
    thinking_budget_tokens: Optional[int] = Field(
        default=None, ge=0, description="llama-server's field: the thinking's tokens at most, where the prompt opens "
        "the thinking block; past them the server closes the block and the model answers (docs/reasoning.md).")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, kwargs: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        taken = reserved_keys(kwargs or {})
        if taken:
            raise RequestError(400, f"chat_template_kwargs: {', '.join(taken)} are the server's to set (the "
                               "request's messages and tools are)", param="chat_template_kwargs")
        return kwargs

    def template_kwargs(self) -> Dict[str, Any]:
        """The request's template variables (the server's setting goes under them)."""
        return template_kwargs(self.reasoning_effort, explicit=self.chat_template_kwargs)

    @field_validator("tools")
    @classmethod
    def _parameters_default_to_none(cls, tools: Optional[List[FunctionTool]]) -> Optional[List[FunctionTool]]:
        """A function without `parameters` as the templates and the forcing grammar read one: an
        object with no properties; one whose parameters are no JSON schema, a 400 naming them."""
        for tool in tools or []:
            tool["function"].setdefault("parameters", dict(NO_PARAMETERS))
        wrong = first_shape_error((f"tools.{i}.function.parameters", tool["function"]["parameters"])
                                  for i, tool in enumerate(tools or []))
        if wrong is not None:
            raise RequestError(400, f"{wrong[0]}: {wrong[1]}", param=wrong[0])
        return tools

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        """max_completion_tokens is max_tokens; both, when they differ, is a 400; so is either
        below 1 (stock llama_cpp reads 0 or less as "to the context's end": a slot held for max_ctx
        tokens, where OpenAI, Responses and Messages refuse it)."""
        given = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        value = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if value is not None and value < 1:
            raise RequestError(400, f"{given} must be at least 1 ({value} given)", param=given)
        if self.max_completion_tokens is None:
            return self
        if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise RequestError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                               f"({self.max_completion_tokens}) differ: send one", param="max_completion_tokens")
        self.max_tokens = self.max_completion_tokens
        return self


class EmbeddingRequest(BaseModel):
    model: Optional[str] = None
    input: Prompt = Field(description="Text or token ids, or a list of either (one embedding each).")
    encoding_format: Literal["float", "base64"] = "float"
    user: Optional[str] = None


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# OpenAI takes 4 stop strings; clients that send a chat template's turn markers and their own
# (role play front ends, agent loops) send a dozen or two, each a few words long
MAX_STOPS = 32
MAX_STOP_CHARS = 1024
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
            raise RequestError(400, f"logit_bias of token {token} is {bias}: the range is -100..100",
                               param="logit_bias")


def _stop_strings(body: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """The request's stop strings, within the caps (each one is matched against every token)."""
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    if len(stop) > MAX_STOPS:
        raise RequestError(400, f"at most {MAX_STOPS} stop strings ({len(stop)} given)", param="stop")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise RequestError(400, f"stop.{i}: at most {MAX_STOP_CHARS} characters ({len(text)} given)",
                               param=f"stop.{i}")
    return stop


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    grammar: str | None,
    logit_bias: dict[int, float],
) -> SamplingParams:
    stop = _stop_strings(body)
    kept = frozenset(stop) if body.include_stop_str_in_output else frozenset()
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
        kept_stops=kept,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repeat_penalty=_repeat_penalty(body),
        logit_bias=logit_bias,
        logprobs=logprobs,
        grammar=grammar,
        min_tokens=max_tokens if body.ignore_eos else body.min_tokens,
        speculative=body.speculative,
        mirostat=body.mirostat_mode,
        mirostat_tau=body.mirostat_tau,
        mirostat_eta=body.mirostat_eta,
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        **body.peer_samplers(),
    )


def _repeat_penalty(body: CompletionRequest | ChatCompletionRequest) -> float:
    """repeat_penalty, or vLLM's repetition_penalty where the client sent that name instead."""
    if body.repetition_penalty is None:
        return body.repeat_penalty
    if "repeat_penalty" in body.model_fields_set and body.repeat_penalty != body.repetition_penalty:
        raise RequestError(400, f"repeat_penalty ({body.repeat_penalty}) and repetition_penalty "
                           f"({body.repetition_penalty}) differ: send one", param="repetition_penalty")
    return body.repetition_penalty
