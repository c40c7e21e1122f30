"""Other APIs' bodies (the Responses API, Anthropic's Messages) as chat completion requests: the one
request type that prepare.py turns into engine requests."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .protocol import ChatCompletionRequest, RequestError


def as_chat(chat: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built from another API's body: what it still lacks is that body's error (a 400)."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RequestError(400, f"{where}: {first.get('msg', 'invalid')}", param=where or None) from None
