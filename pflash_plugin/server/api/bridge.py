"""Other APIs' bodies (the Responses API, Anthropic's Messages), made chat completion requests (the
one request type that prepare.py turns into engine requests, wire/chat_request.py), answered through
the chat path in their own shapes (a presenter)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from fastapi import Request

from ..output.dispatch import respond
from ..output.presenters import Presenter
from ..preparation.format_cache import formats
from ..preparation.inline import inline
from ..preparation.prepare import prepare_chat
from ..runtime.media_prepare import prepared
from ..runtime.context import ServerContext
from ..runtime.generation import Generation
from ..wire.protocol import ChatCompletionRequest, RequestError


async def answer(http: Request, ctx: ServerContext, chat: ChatCompletionRequest,
                 presenter: Callable[[Generation], Presenter], fields: Mapping[str, str]) -> Any:
    """Run `chat` as /v1/chat/completions does, shown by the presenter made for its generation; a
    refusal names the client's field where `fields` maps the chat field it was found in."""
    served = ctx.models.get(chat.model)
    try:
        generation = prepare_chat(served, chat) if inline(chat, formats(served)) else await prepared(
            http, served.media_preparation, chat, prepare_chat, served, chat)
        return await respond(http, ctx, generation, bool(chat.stream), presenter(generation))
    except RequestError as error:  # a refusal, before any byte of the answer
        raise renamed(error, fields) from None


# Chat fields renamed whole only: the chat request's messages are not the client's items one for one
# (the Responses API's instructions come first), so `messages.2` names no input item.
_WHOLE_ONLY = frozenset({"messages"})


def renamed(error: RequestError, fields: Mapping[str, str]) -> RequestError:
    """`error` with its chat fields as the client named them: the param and the start of the
    message (`response_format.schema` -> `text.format.schema`), and each field the message shows
    with its value in parentheses (the engine's "prompt (N tokens) + max_tokens (M)")."""
    param, message = error.param, error.message
    chat_field = next((f for f in fields if param is not None and (
        param == f or f not in _WHOLE_ONLY and param.startswith(f + "."))), None)
    if chat_field is not None:
        assert param is not None
        ours = fields[chat_field]
        param = ours + param[len(chat_field):]
        message = ours + message[len(chat_field):] if message.startswith(chat_field) else message
    for said, ours in fields.items():
        message = message.replace(f"{said} (", f"{ours} (")
    if (param, message) == (error.param, error.message):
        return error
    return RequestError(error.status, message, error.type, param, error.code, error.counted)
