"""The OpenAI Responses API as a module-level router: POST /v1/responses, through the same engine as
chat completions."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from .bridge import answer
from .context import ServerContext, get_context
from .errors import OpenAIRoute
from .responses import ERROR_RESPONSES
from .responses_presenter import ResponsesPresenter
from .responses_protocol import ResponsesRequest, chat_request

router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI Responses"], responses=ERROR_RESPONSES)


@router.post("/v1/responses")
async def create_response(http: Request, body: ResponsesRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    chat = await run_in_threadpool(chat_request, body)  # linear in the body, off the event loop
    return await answer(http, ctx, chat, lambda generation: ResponsesPresenter(generation, body),
                        {"response_format": "text.format", "max_tokens": "max_output_tokens"})
