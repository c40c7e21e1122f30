"""llama_cpp.server's extras (tokenize, detokenize) and our operations routes (health, status,
metrics), as module-level routers. The extras run on the tokenizer's own threads
(tokenizer_pool.py), never beside generation unbounded."""
from __future__ import annotations

from typing import Any, Dict, Optional

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from llama_cpp.server.types import (
    DetokenizeInputRequest,
    DetokenizeInputResponse,
    TokenizeInputCountResponse,
    TokenizeInputRequest,
    TokenizeInputResponse,
)
from pydantic import BaseModel

from ..runtime.context import ServerContext, get_context
from ..runtime.models import ServedModel
from ..wire.errors import OpenAIRoute
from ..wire.protocol import RequestError
from ..wire.responses import ERROR_RESPONSES

extras = APIRouter(route_class=OpenAIRoute, tags=["Extras"], responses=ERROR_RESPONSES)
operations = APIRouter(route_class=OpenAIRoute, tags=["Operations"], responses=ERROR_RESPONSES)


def _tokens(served: ServedModel, text: str) -> list[int]:
    """`input` tokenized within the completion routes' caps: max_ctx tokens, a text too long for
    them refused before it is tokenized (a 7 MB body peaked at 848 MB here)."""
    tokens = served.prompts.tokenize(text, "input")
    served.prompts.limit.check_tokens(tokens, "input")
    return tokens


@extras.post("/extras/tokenize", response_model=TokenizeInputResponse)
async def tokenize(body: TokenizeInputRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    return TokenizeInputResponse(tokens=await ctx.tokenizer.run(_tokens, ctx.models.get(body.model), body.input))


@extras.post("/extras/tokenize/count", response_model=TokenizeInputCountResponse)
async def count_tokens(body: TokenizeInputRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    tokens = await ctx.tokenizer.run(_tokens, ctx.models.get(body.model), body.input)
    return TokenizeInputCountResponse(count=len(tokens))


@extras.post("/extras/detokenize", response_model=DetokenizeInputResponse)
async def detokenize(body: DetokenizeInputRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    served = ctx.models.get(body.model)
    served.prompts.limit.check_tokens(body.tokens, "tokens")
    for token in body.tokens:
        if not 0 <= token < served.model.n_vocab:
            raise RequestError(400, f"token id {token} is outside the vocabulary", param="tokens")
    return DetokenizeInputResponse(text=await ctx.tokenizer.run(served.model.detokenize, body.tokens))


class Health(BaseModel):
    status: str  # "ok", or the first unhealthy engine's state: "failed", "draining", "stalled", "stopped"
    reason: Optional[str] = None


class Status(BaseModel):
    models: Dict[str, Dict[str, Any]]


@operations.get("/health", response_model=Health, response_model_exclude_none=True, responses={503: {"model": Health}})
async def health(ctx: ServerContext = Depends(get_context)) -> Any:
    """200 while every model serves; 503 naming one that does not (llama.cpp failed, shutting down)."""
    for name, served in ctx.models.models.items():
        state = served.engine.health()
        if not state.ok:
            body = Health(status=state.state, reason=f"model {name}: {state.reason}")
            return JSONResponse(body.model_dump(), status_code=503)
    return Health(status="ok")


@operations.get("/status", response_model=Status)
async def server_status(ctx: ServerContext = Depends(get_context)) -> Any:
    return Status(models={name: served.status() for name, served in ctx.models.models.items()})


@operations.get("/metrics", response_class=Response)
async def prometheus(ctx: ServerContext = Depends(get_context)) -> Response:
    if not ctx.settings.metrics:
        raise RequestError(501, "This server does not serve /metrics: start it with --metrics true",
                           type_="not_supported_error")
    response = Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")
    # llama-server's header, in its own case (Starlette lowercases the names it is given; llama.cpp's tests look
    # the name up as llama-server spells it)
    response.raw_headers.append((b"Process-Start-Time-Unix", str(ctx.metrics.started).encode()))
    return response
