"""The OpenAI routes (completions, chat, embeddings, models) as a module-level router: mount it in
any FastAPI app whose state carries a ServerContext (see context.attach)."""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from .context import ServerContext, get_context
from .dispatch import respond
from .errors import OpenAIRoute
from .models import ServedModel
from .prepare import prepare_chat, prepare_completion
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RequestError
from .responses import (
    ERROR_RESPONSES,
    STREAM_RESPONSES,
    ChatCompletionResponse,
    CompletionResponse,
    Embedding,
    EmbeddingResponse,
    ModelCard,
    ModelList,
)

router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI V1"], responses=ERROR_RESPONSES)


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_RESPONSES)
@router.post("/v1/engines/copilot-codex/completions", response_model=CompletionResponse, include_in_schema=False)
async def create_completion(http: Request, body: CompletionRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    served = ctx.models.get(body.model)
    generation = await run_in_threadpool(prepare_completion, served, body)
    return await respond(http, ctx, generation, body.stream)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_RESPONSES)
async def create_chat_completion(http: Request, body: ChatCompletionRequest,
                                 ctx: ServerContext = Depends(get_context)) -> Any:
    served = ctx.models.get(body.model)
    generation = await run_in_threadpool(prepare_chat, served, body)
    return await respond(http, ctx, generation, body.stream)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64 is the vector's little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _embed(served: ServedModel, body: EmbeddingRequest) -> EmbeddingResponse:
    if served.embedder is None:
        raise RequestError(400, f"the model {served.name!r} is not served with embedding: true", param="model")
    data: list[Embedding] = []
    n_tokens = 0
    for index, (tokens, _) in enumerate(served.prompts.tokenize_prompts(body.input, param="input")):
        n_tokens += len(tokens)
        try:
            vector = served.embedder.embed(tokens)
        except ValueError as error:
            raise RequestError(400, f"embedding input {index}: {error}", param="input") from None
        data.append(Embedding(embedding=_encoded(vector, body.encoding_format), index=index))
    return EmbeddingResponse(data=data, model=served.name, usage={"prompt_tokens": n_tokens, "total_tokens": n_tokens})


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embedding(body: EmbeddingRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    if body.input == []:  # as OpenAI and stock llama_cpp.server: an error, not an empty list
        raise RequestError(400, "input: at least one text to embed is required", param="input")
    return await run_in_threadpool(_embed, ctx.models.get(body.model), body)


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServerContext = Depends(get_context)) -> Any:
    return ModelList(data=[ModelCard(id=name) for name in ctx.models.models])
