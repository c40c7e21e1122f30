"""The OpenAI routes (completions, chat, embeddings, models) as a module-level router: mount it in
any FastAPI app whose state carries a ServerContext (see context.attach)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from llama_cpp.server.types import CreateEmbeddingRequest
from starlette.concurrency import run_in_threadpool

from .context import ServerContext, get_context
from .dispatch import respond
from .errors import OpenAIRoute
from .models import ServedModel
from .prepare import prepare_chat, prepare_completion
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError
from .responses import ERROR_RESPONSES, STREAM_RESPONSES, ChatCompletionResponse, CompletionResponse, EmbeddingResponse, ModelList

router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI V1"], responses=ERROR_RESPONSES)


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_RESPONSES)
@router.post("/v1/engines/copilot-codex/completions", response_model=CompletionResponse, include_in_schema=False)
async def create_completion(http: Request, body: CompletionRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    served = ctx.models.get(body.model)
    generation = await run_in_threadpool(prepare_completion, served, body)
    return await respond(http, ctx, generation, body.stream)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_RESPONSES)
async def create_chat_completion(http: Request, body: ChatCompletionRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    served = ctx.models.get(body.model)
    generation = await run_in_threadpool(prepare_chat, served, body)
    return await respond(http, ctx, generation, body.stream)


def _embed(served: ServedModel, inputs: list[str]) -> EmbeddingResponse:
    if served.embedder is None:
        raise RequestError(400, f"the model {served.name!r} is not served with embedding: true", param="model")
    data, n_tokens = [], 0
    for index, text in enumerate(inputs):
        tokens = served.tokenize_prompt(text)
        n_tokens += len(tokens)
        try:
            data.append({"embedding": served.embedder.embed(tokens), "index": index})
        except ValueError as error:
            raise RequestError(400, str(error), param="input") from None
    return EmbeddingResponse(data=data, model=served.name, usage={"prompt_tokens": n_tokens, "total_tokens": n_tokens})


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embedding(body: CreateEmbeddingRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    inputs = body.input if isinstance(body.input, list) else [body.input]
    if not inputs:  # as OpenAI and stock llama_cpp.server: an error, not an empty list
        raise RequestError(400, "input: at least one text to embed is required", param="input")
    return await run_in_threadpool(_embed, ctx.models.get(body.model), inputs)


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServerContext = Depends(get_context)) -> Any:
    return ModelList(data=[{"id": name} for name in ctx.models.models])
