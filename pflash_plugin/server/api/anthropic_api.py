"""Anthropic's Messages API as a module-level router: /v1/messages and /v1/messages/count_tokens,
answered in Anthropic's shapes, errors included, through the same engine as chat completions."""
from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from ..output.anthropic_presenter import MessagesPresenter
from ..preparation.prepare import chat_prompt
from ..runtime.context import ServerContext, get_context
from ..runtime.models import ServedModel
from ..wire.anthropic_errors import error_body
from ..wire.anthropic_protocol import ERROR_RESPONSES, CountTokensRequest, MessagesRequest, chat_request
from ..wire.errors import OpenAIRoute
from ..wire.offload import offload
from ..wire.protocol import ChatCompletionRequest
from .anthropic_checks import check_body
from .bridge import answer


class AnthropicRoute(OpenAIRoute):
    """The OpenAI route's checks and errors, each error re-shaped as Anthropic's
    (`{"type": "error", "error": {"type", "message"}}`, its type named by the status)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            response = await handler(request)
            if response.status_code < 400 or not isinstance(response, JSONResponse):
                return response
            error = json.loads(bytes(response.body)).get("error")
            if not isinstance(error, dict) or "message" not in error:
                return response
            headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
            return JSONResponse(error_body(response.status_code, error["message"]), response.status_code, headers)

        return route


router = APIRouter(route_class=AnthropicRoute, tags=["Anthropic Messages"], responses=ERROR_RESPONSES)


@router.post("/v1/messages")
async def create_message(http: Request, body: MessagesRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    stops = body.stop_sequences or []
    chat = await offload(converted, ctx.models.get(body.model), body)  # off the event loop
    return await answer(http, ctx, chat, lambda generation: MessagesPresenter(generation, stops),
                        {"response_format": "output_config.format", "stop": "stop_sequences"})


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    """The prompt's length as the template renders it: converted, rendered and tokenized on the
    tokenizer's threads (a 429 when they are busy), never on the event loop."""
    served = ctx.models.get(body.model)
    return {"input_tokens": await ctx.tokenizer.run(_prompt_length, served, body)}


def _prompt_length(served: ServedModel, body: CountTokensRequest) -> int:
    _, prompt = chat_prompt(served, converted(served, body))
    return len(prompt.tokens)


def converted(served: ServedModel, body: CountTokensRequest) -> ChatCompletionRequest:
    """The body as a chat request, checked first (anthropic_checks.py)."""
    check_body(body, served.prompts.limit)
    return chat_request(body)
