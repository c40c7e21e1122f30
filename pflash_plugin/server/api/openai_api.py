"""The OpenAI routes (completions, chat, embeddings, models) as a module-level router: mount it in
any FastAPI app whose state carries a ServerContext (see context.attach)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..output.dispatch import respond
from ..preparation.format_cache import formats
from ..preparation.inline import inline
from ..preparation.prepare import prepare_chat, prepare_completion
from ..runtime.context import ServerContext, get_context
from ..runtime.media_prepare import prepared
from ..runtime.polite import after_first_tokens
from ..wire.errors import OpenAIRoute
from ..wire.offload import offload
from ..wire.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RequestError
from ..wire.responses import (
    ERROR_RESPONSES,
    STREAM_RESPONSES,
    ChatCompletionResponse,
    CompletionResponse,
    EmbeddingResponse,
    ModelCard,
    ModelList,
)
from .embeddings import embed

router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI V1"], responses=ERROR_RESPONSES)


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_RESPONSES)
@router.post("/v1/engines/copilot-codex/completions", response_model=CompletionResponse, include_in_schema=False)
async def create_completion(http: Request, body: CompletionRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    served = ctx.models.get(body.model)
    if inline(body, formats(served)):
        generation = prepare_completion(served, body)
    else:
        await after_first_tokens(served.engine.activity, ctx.polite_s())
        generation = await offload(prepare_completion, served, body)
    return await respond(http, ctx, generation, body.stream)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_RESPONSES)
async def create_chat_completion(http: Request, body: ChatCompletionRequest,
                                 ctx: ServerContext = Depends(get_context)) -> Any:
    served = ctx.models.get(body.model)
    if inline(body, formats(served)):
        generation = prepare_chat(served, body)
    else:
        await after_first_tokens(served.engine.activity, ctx.polite_s())
        generation = await prepared(http, served.media_preparation, body, prepare_chat, served, body)
    return await respond(http, ctx, generation, body.stream)


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embedding(http: Request, body: EmbeddingRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    if body.input == []:  # as OpenAI and stock llama_cpp.server: an error, not an empty list
        raise RequestError(400, "input: at least one text to embed is required", param="input")
    return await embed(http, ctx, ctx.models.get(body.model), body)


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServerContext = Depends(get_context)) -> Any:
    return ModelList(data=[ModelCard(id=name) for name in ctx.models.models])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, ctx: ServerContext = Depends(get_context)) -> Any:
    """One served model by its exact name (client.models.retrieve); any other name is a 404, even
    with one model, which answers requests under any name: this says what is served."""
    if model_id not in ctx.models.models:
        raise RequestError(404, f"the model {model_id!r} does not exist; served: {', '.join(ctx.models.models)}",
                           param="model", code="model_not_found")
    return ModelCard(id=model_id)
