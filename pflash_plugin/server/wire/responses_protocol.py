"""The OpenAI Responses API in (its non-stateful core): the request type and its input as a chat
completion request, so that it runs through the same chat template, tools and engine as
/v1/chat/completions. The server keeps no responses: what needs stored state is refused."""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .chat_request import as_chat, chat_tool, content_with_media, joined_text
from .media_parts import MediaSource, responses_source
from .protocol import ChatCompletionRequest, NullIsDefault, PflashOverride, RequestError


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity
    format: Optional[TextFormat] = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # generate_summary: accepted, the thinking is shown whole
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = Field(
        default=None, description="none or minimal: no thinking; low and up: thinking on (chat's reasoning_effort).")
    summary: Optional[str] = Field(default=None, description="Accepted: reasoning items carry the whole thinking "
                                   "as reasoning_text content, with no summary.")


class ResponsesRequest(NullIsDefault):
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]] = Field(description="Text, or message and function-call items.")
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    tools: Optional[List[FunctionTool]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    grammar: Optional[str] = Field(default=None, description="A GBNF grammar the answer follows (llama.cpp's "
                                   "extension, as on chat completions).")
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = None
    user: Optional[str] = None
    # server-side state: refused unless absent or off (chat_request says so, naming the field)
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    pflash: Optional[PflashOverride] = None
    priority: int = Field(default=0, description="As on chat completions (vLLM's field): the admission order "
                          "under --schedule_policy priority, lower first.")


_STATEFUL = {
    "previous_response_id": "this server stores no responses: send the whole conversation in input",
    "store": "this server stores no responses: send store false (or leave it out)",
    "background": "background responses need a stored response: this server answers in the foreground",
    "conversation": "this server stores no conversations: send the whole conversation in input",
    "prompt": "stored prompt templates are not kept here: send the prompt in input and instructions",
}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


_MEDIA_PARTS = ("input_image", "input_audio")


def _content(content: Any, field: str) -> str | list[Any]:
    """A message's content: text, or chat content parts where it holds input_image or input_audio
    parts (their sources read here, named by the client's fields: wire/media_parts.py)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{field}: a string or a list of content parts", param=field)
    parts = [(part.get("type"), part.get("text", part.get("refusal"))) if isinstance(part, dict) else (None, None)
             for part in content]

    def media(j: int, where: str) -> MediaSource | None:
        part = content[j]
        return responses_source(part, where) if isinstance(part, dict) and part.get("type") in _MEDIA_PARTS else None

    return content_with_media(parts, field, _TEXT_PARTS, "content part", media)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(400, f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thinking: its reasoning_text content, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise RequestError(400, f"{where}.content: a list of reasoning_text parts", param=f"{where}.content")
    pairs = [(p.get("type"), p.get("text")) if isinstance(p, dict) else (None, None) for p in parts]
    return joined_text(pairs, f"{where}.content", ("reasoning_text", "summary_text"), "part")


def _assistant(messages: list[dict[str, Any]], thought: str | None,
               content: str | list[Any] | None = None) -> dict[str, Any]:
    """A new assistant message, with the thinking of the reasoning items before it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thought is not None:
        message["reasoning_content"] = thought
    messages.append(message)
    return message


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """Instructions and input items as chat messages: consecutive function calls are one
    assistant message's tool calls, their outputs tool messages; a reasoning item's text is the
    reasoning_content of the assistant message after it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    thought: str | None = None  # reasoning items' text, for the next assistant message
    for i, item in enumerate(items):
        where, kind = f"input.{i}", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(400, f"{where}.role: user, assistant, system or developer", param=f"{where}.role")
            content = _content(item.get("content"), f"{where}.content")
            if role == "assistant":
                _assistant(messages, thought, content)
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": content})
            thought = None
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            thought = text if thought is None else f"{thought}\n{text}"
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if thought is None and last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                _assistant(messages, thought)["tool_calls"] = [call]
            thought = None
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": _content(item.get("output"), f"{where}.output")})
            thought = None
        else:
            raise RequestError(400, f"{where}: an input item of type {kind!r} is not taken here (message, "
                               "reasoning, function_call, function_call_output)", param=f"{where}.type")
    if not messages:  # else chat's own error, which names `messages`
        raise RequestError(400, "input: at least one message or item is required", param="input")
    return messages


def _tools(body: ResponsesRequest) -> dict[str, Any]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function" or not tool.name:
            raise RequestError(400, f"tools.{i}: only function tools with a name are run here (not {tool.type!r})",
                               param=f"tools.{i}.type")
        tools.append(chat_tool(tool.name, tool.description, tool.parameters))
    out: dict[str, Any] = {"tools": tools or None, "parallel_tool_calls": body.parallel_tool_calls}
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestError(400, "tool_choice: none, auto, required, or {'type': 'function', 'name': ...}",
                               param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    out["tool_choice"] = choice
    return out


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    form = body.text.format if body.text else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    # without a schema: any JSON object, as on chat and completions (docs/api.md)
    return {"type": "json_schema", "json_schema": {"name": form.name, "schema": form.schema_, "strict": form.strict}}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    for name, why in _STATEFUL.items():
        value = getattr(body, name)
        if value is not None and value is not False:
            raise RequestError(400, f"{name}: {why}", param=name)
    chat = {"model": body.model, "messages": _messages(body), "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
            "response_format": _response_format(body), "pflash": body.pflash, **_tools(body),
            "reasoning_effort": body.reasoning.effort if body.reasoning else None, "grammar": body.grammar,
            "priority": body.priority}
    return as_chat(chat)
