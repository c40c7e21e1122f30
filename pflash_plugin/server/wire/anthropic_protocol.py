"""Anthropic's Messages API in: the request types, their errors' shape, and the conversation as a
chat completion request, so that a message runs through the same chat template, tool syntaxes,
forced-call grammars and engine as /v1/chat/completions."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ...chat.switches import template_kwargs
from .chat_request import as_chat, chat_tool, content_with_media, joined_text
from .media_parts import MediaSource, anthropic_source
from .protocol import ChatCompletionRequest, NullIsDefault, PflashOverride, RequestError


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# every 4xx is an Anthropic error body (documenting 4XX also keeps FastAPI's 422 out of the schema)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": AnthropicErrorResponse, "description": "An Anthropic error"}}


class ContentBlock(BaseModel):
    """One block of a message. Any type validates here so that the conversion can say which block
    the server cannot take, by its field, rather than a union error."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None
    id: Optional[str] = None  # tool_use
    name: Optional[str] = None  # tool_use
    input: Optional[Any] = None  # tool_use
    tool_use_id: Optional[str] = None  # tool_result
    content: Optional[Union[str, List["ContentBlock"]]] = None  # tool_result
    is_error: Optional[bool] = None  # tool_result


class InputMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, List[ContentBlock]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None
    type: Optional[str] = Field(default=None, description="'custom' or none: a client tool (server tools are refused).")


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # effort: accepted, the model has one effort
    format: Optional[OutputFormat] = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(
        default=None, ge=1, description="With type enabled: the thinking's tokens at most; past them the server "
        "closes the thinking block and the model answers (docs/reasoning.md).")


class CountTokensRequest(NullIsDefault):
    model: Optional[str] = None
    messages: List[InputMessage]
    system: Optional[Union[str, List[ContentBlock]]] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = Field(
        default=None, description="enabled or disabled: the template's thinking switch (enable_thinking); the "
        "thinking comes back as thinking blocks (docs/reasoning.md).")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="Required, as Anthropic requires it.")
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    metadata: Optional[Dict[str, Any]] = None
    output_config: Optional[OutputConfig] = Field(default=None, description="format: a JSON schema the answer follows.")
    grammar: Optional[str] = Field(default=None, description="A GBNF grammar the answer follows (llama.cpp's "
                                   "extension, as on chat completions).")
    stream: bool = False
    pflash: Optional[PflashOverride] = None


def _text(content: str | list[ContentBlock] | None, field: str, at: list[int] | None = None) -> str | list[Any]:
    """Text blocks (and plain-text documents) joined by newlines, or chat content parts where image
    blocks are among them (each a MediaPart, its source named by the client's field); any other
    block is refused, naming its field. `at`: each block's index in the client's content (default:
    its own)."""
    if content is None or isinstance(content, str):
        return content or ""
    blocks = content
    names = list(range(len(blocks)) if at is None else at)

    def media(k: int, where: str) -> MediaSource | None:
        block = blocks[k]
        if block.type != "image":
            return None
        return anthropic_source((block.model_extra or {}).get("source"), where)

    parts = [("text", _document(block, f"{field}.{k}")) if block.type == "document" else (block.type, block.text)
             for k, block in zip(names, blocks)]
    return content_with_media(parts, field, ("text",), "block", media, names)


def _document(block: ContentBlock, where: str) -> str:
    """A document block's text: its title (if any) on the first line, then a `text` source's data or
    a `content` source's text blocks; a PDF (base64, url or file source) is refused: it is not read here."""
    source = (block.model_extra or {}).get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source, dict) and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content" and isinstance(source, dict):
        text = _document_content(source.get("content"), f"{where}.source.content")
    elif kind in ("base64", "url", "file"):
        raise RequestError(400, f"{where}.source: a {kind} document (a PDF) is not read by this server: send its "
                           "text (source type 'text' or 'content')", param=f"{where}.source.type")
    else:
        raise RequestError(400, f"{where}.source: a document needs a source of type 'text' (with a string "
                           "'data') or 'content'", param=f"{where}.source")
    title = (block.model_extra or {}).get("title")
    return f"{title}\n{text}" if isinstance(title, str) and title else text


def _document_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: a string or a list of text blocks", param=where)
    pairs = [(b.get("type"), b.get("text")) if isinstance(b, dict) else (None, None) for b in content]
    return joined_text(pairs, where, ("text",), "block")


def _call(block: ContentBlock, field: str) -> dict[str, Any]:
    if block.id is None or block.name is None:
        raise RequestError(400, f"{field}: a tool_use block needs an id and a name", param=field)
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input or {}, ensure_ascii=False)}}


def _turn(message: InputMessage, field: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool messages (before the
    user's text, where Anthropic puts them), tool uses an assistant's tool calls; an assistant's
    thinking blocks its reasoning_content (redacted ones, unreadable here, are dropped)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    texts: list[ContentBlock] = []
    at: list[int] = []  # their indices in the message's content
    thoughts: list[str] = []
    for j, block in enumerate(message.content):
        where = f"{field}.content.{j}"
        if block.type == "tool_result" and message.role == "user":
            if block.tool_use_id is None:
                raise RequestError(400, f"{where}: a tool_result block needs tool_use_id", param=f"{where}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _text(block.content, f"{where}.content")})
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append(_call(block, where))
        elif block.type == "thinking" and message.role == "assistant":
            thoughts.append(_thinking(block, where))
        elif block.type == "redacted_thinking" and message.role == "assistant":
            continue
        else:
            texts.append(block)
            at.append(j)
    chat = results
    text = _text(texts, f"{field}.content", at) if texts else None
    thought = {"reasoning_content": "\n".join(thoughts)} if thoughts else {}
    if calls:
        chat.append({"role": "assistant", "content": text, **thought, "tool_calls": calls})
    elif text is not None or not results:
        chat.append({"role": message.role, "content": text or "", **thought})
    return chat


def _thinking(block: ContentBlock, where: str) -> str:
    thinking = (block.model_extra or {}).get("thinking")
    if not isinstance(thinking, str):
        raise RequestError(400, f"{where}: a thinking block needs its 'thinking' text", param=f"{where}.thinking")
    return thinking


def _tools(body: CountTokensRequest) -> dict[str, Any]:
    """The chat request's tools and tool_choice."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise RequestError(400, f"tools.{i}: a server tool of type {tool.type!r} is not run by this server: "
                               "send client tools (name, description, input_schema)", param=f"tools.{i}.type")
        tools.append(chat_tool(tool.name, tool.description, tool.input_schema))
    out: dict[str, Any] = {"tools": tools} if tools else {}
    choice = body.tool_choice
    if choice is None:
        return out
    if choice.type == "tool":
        if choice.name is None:
            raise RequestError(400, "tool_choice: type 'tool' needs the tool's name", param="tool_choice.name")
        if choice.name not in {tool.name for tool in body.tools or []}:
            raise RequestError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                               param="tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The conversation as a chat completion request; a MessagesRequest's sampling too."""
    if not body.messages:
        raise RequestError(400, "messages: at least one message is required", param="messages")
    messages = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, message in enumerate(body.messages):
        messages += _turn(message, f"messages.{i}")
    chat: dict[str, Any] = {"model": body.model, "messages": messages, **_tools(body)}
    if body.thinking is not None and body.thinking.type != "adaptive":  # adaptive: the template's default
        chat["chat_template_kwargs"] = template_kwargs(thinking=body.thinking.type == "enabled")
        if body.thinking.type == "enabled" and body.thinking.budget_tokens is not None:
            chat["thinking_budget_tokens"] = body.thinking.budget_tokens
    if isinstance(body, MessagesRequest):
        form = body.output_config.format if body.output_config else None
        chat.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences or None,
                    pflash=body.pflash, grammar=body.grammar,
                    **{key: getattr(body, key) for key in ("temperature", "top_p", "top_k")
                       if getattr(body, key) is not None})
        if form is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": form.schema_}}
    return as_chat(chat)

