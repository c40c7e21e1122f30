"""Other APIs' bodies (the Responses API, Anthropic's Messages) as chat completion requests, the one
request type that prepare.py turns into engine requests, answered through the chat path in their
own shapes (a presenter)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from .context import ServerContext
from .dispatch import respond
from .errors import validation_message
from .generation import Generation
from .prepare import prepare_chat
from .presenters import Presenter
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


async def answer(http: Request, ctx: ServerContext, chat: ChatCompletionRequest,
                 presenter: Callable[[Generation], Presenter], fields: Mapping[str, str]) -> Any:
    """Run `chat` as /v1/chat/completions does, shown by the presenter made for its generation; a
    refusal names the client's field where `fields` maps the chat field it was found in."""
    served = ctx.models.get(chat.model)
    try:
        generation = await run_in_threadpool(prepare_chat, served, chat)
        return await respond(http, ctx, generation, bool(chat.stream), presenter(generation))
    except RequestError as error:  # a refusal, before any byte of the answer
        raise renamed(error, fields) from None


def renamed(error: RequestError, fields: Mapping[str, str]) -> RequestError:
    """`error` with its chat field as the client named it: the start of its param and of its
    message, or, in the message of an error without a param (the engine's "prompt (N tokens) +
    max_tokens (M)"), where the field's value follows it in parentheses."""
    chat_field = next((f for f in fields if error.param is not None
                       and (error.param == f or error.param.startswith(f + "."))), None)
    if chat_field is None and error.param is None:
        said = next((f for f in fields if f"{f} (" in error.message), None)
        if said is not None:
            message = error.message.replace(f"{said} (", f"{fields[said]} (")
            return RequestError(error.status, message, error.type, None, error.code, error.counted)
    if chat_field is None:
        return error
    assert error.param is not None
    ours = fields[chat_field]
    message = ours + error.message[len(chat_field):] if error.message.startswith(chat_field) else error.message
    return RequestError(error.status, message, error.type, ours + error.param[len(chat_field):], error.code,
                        error.counted)
