"""The OpenAI Responses API as a module-level router: POST /v1/responses, through the same engine as
chat completions."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from .context import ServerContext, get_context
from .dispatch import respond
from .errors import OpenAIRoute
from .prepare import prepare_chat
from .responses import ERROR_RESPONSES
from .responses_presenter import ResponsesPresenter
from .responses_protocol import ResponsesRequest, chat_request

router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI Responses"], responses=ERROR_RESPONSES)


@router.post("/v1/responses")
async def create_response(http: Request, body: ResponsesRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    chat = chat_request(body)
    served = ctx.models.get(body.model)
    generation = await run_in_threadpool(prepare_chat, served, chat)
    return await respond(http, ctx, generation, body.stream, ResponsesPresenter(generation, body))
