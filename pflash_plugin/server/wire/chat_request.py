"""Other APIs' bodies (the Responses API, Anthropic's Messages) as chat completion requests: the
pieces their request models are translated with (api/bridge.py answers them through the chat path)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from pydantic import ValidationError

from .errors import validation_message
from .media_parts import MediaPart, MediaSource
from .protocol import ChatCompletionRequest, RequestError


def joined_text(parts: Sequence[tuple[Any, Any]], field: str, accepted: tuple[str, ...], noun: str,
                at: Sequence[int] | None = None) -> str:
    """Text parts, as (type, text) pairs, joined by newlines (chat templates render a string); a part
    of another type, or without text, is refused naming its field and the first accepted type.
    `at`: each part's index in the client's list (default: its own)."""
    names = range(len(parts)) if at is None else at
    return "\n".join(_part_text(kind, text, f"{field}.{k}", accepted, noun) for k, (kind, text) in zip(names, parts))


def _part_text(kind: Any, text: Any, where: str, accepted: tuple[str, ...], noun: str) -> str:
    if kind not in accepted:
        raise RequestError(400, f"{where}: a {noun} of type {kind!r} is not taken here: send {accepted[0]!r} "
                           f"{noun}s or media", param=f"{where}.type")
    if not isinstance(text, str):
        raise RequestError(400, f"{where}.text: a {noun} of type {kind!r} needs a string 'text'", param=f"{where}.text")
    return text


def content_with_media(parts: Sequence[tuple[Any, Any]], field: str, accepted: tuple[str, ...], noun: str,
                       media: Callable[[int, str], MediaSource | None],
                       at: Sequence[int] | None = None) -> str | list[Any]:
    """`joined_text`, where no part is media (`media(j, where)` gives a part's source, else None);
    otherwise the parts as chat content: text parts, and each media part a MediaPart holding its
    source (wire/chat_content.py puts the marker where it was). `at`: as joined_text's."""
    names = list(range(len(parts)) if at is None else at)
    sources = [media(j, f"{field}.{names[j]}") for j in range(len(parts))]
    if not any(sources):
        return joined_text(parts, field, accepted, noun, names)
    return [MediaPart(type="media", source=source) if source is not None
            else {"type": "text", "text": _part_text(kind, text, f"{field}.{names[j]}", accepted, noun)}
            for j, ((kind, text), source) in enumerate(zip(parts, sources))]


def chat_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function tool as the chat request takes it (no parameters: an object without properties)."""
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def as_chat(chat: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built from another API's body: what it still lacks is that body's error (a 400)."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as error:
        where, message = validation_message(error.errors(), chat)
        raise RequestError(400, f"{where}: {message}" if where else message, param=where) from None
