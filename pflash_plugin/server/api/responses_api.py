"""The OpenAI Responses API as a module-level router: POST /v1/responses, through the same engine as
chat completions."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..output.responses_presenter import ResponsesPresenter
from ..runtime.context import ServerContext, get_context
from ..runtime.models import ServedModel
from ..wire.errors import OpenAIRoute
from ..wire.offload import offload
from ..wire.protocol import ChatCompletionRequest, RequestError
from ..wire.responses import ERROR_RESPONSES
from ..wire.responses_protocol import ResponsesRequest, chat_request
from ..wire.schema_shape import first_shape_error
from .bridge import answer

router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI Responses"], responses=ERROR_RESPONSES)


@router.post("/v1/responses")
async def create_response(http: Request, body: ResponsesRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    chat = await offload(_converted, ctx.models.get(body.model), body)  # off the event loop
    return await answer(http, ctx, chat, lambda generation: ResponsesPresenter(generation, body),
                        {"response_format": "text.format", "max_tokens": "max_output_tokens",
                         "messages": "input"})


def _converted(served: ServedModel, body: ResponsesRequest) -> ChatCompletionRequest:
    """The body as a chat request; checked first, so that a refusal names the field as the client
    sent it (`tools.0.parameters.properties`) and comes before the conversion: more input items
    than max_ctx tokens cannot fit (each one takes a token at least)."""
    if isinstance(body.input, list):
        served.prompts.limit.check_turns(len(body.input), "input items", "input")
    wrong = first_shape_error((f"tools.{i}.parameters", tool.parameters) for i, tool in enumerate(body.tools or []))
    if wrong is not None:
        raise RequestError(400, f"{wrong[0]}: {wrong[1]}", param=wrong[0])
    return chat_request(body)
