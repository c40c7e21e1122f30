"""Other APIs' bodies (the Responses API, Anthropic's Messages) as chat completion requests: the
pieces their request models are translated with (api/bridge.py answers them through the chat path)."""
from __future__ import annotations

from typing import Any, Sequence

from pydantic import ValidationError

from .errors import validation_message
from .protocol import ChatCompletionRequest, RequestError


def joined_text(parts: Sequence[tuple[Any, Any]], field: str, accepted: tuple[str, ...], noun: str) -> str:
    """Text parts, as (type, text) pairs, joined by newlines (chat templates render a string); a part
    of another type, or without text, is refused naming its field and the first accepted type."""
    texts = []
    for j, (kind, text) in enumerate(parts):
        if kind not in accepted or not isinstance(text, str):
            raise RequestError(400, f"{field}.{j}: a {noun} of type {kind!r} is not taken here: send "
                               f"{accepted[0]!r} {noun}s (this server serves text only)", param=f"{field}.{j}.type")
        texts.append(text)
    return "\n".join(texts)


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
