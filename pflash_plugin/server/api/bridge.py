"""Other APIs' bodies (the Responses API, Anthropic's Messages), made chat completion requests (the
one request type that prepare.py turns into engine requests, wire/chat_request.py), answered through
the chat path in their own shapes (a presenter)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from fastapi import Request

from ..output.dispatch import respond
from ..output.presenters import Presenter
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
        generation = prepare_chat(served, chat) if inline(chat) else await prepared(
            http, served.media_preparation, chat, prepare_chat, served, chat)
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
