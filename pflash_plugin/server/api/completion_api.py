"""llama-server's POST /completion (and /completions, its alias without /v1; /v1/completions stays
OpenAI's) as a module-level router: clients written for llama-server (SillyTavern's llama.cpp
backend, scripts) complete text here, answered in llama-server's own shape."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..output.dispatch import respond
from ..output.native_presenter import NativePresenter, NativeShape, unrun
from ..preparation.native import prepare_native
from ..runtime.context import ServerContext, get_context
from ..wire.native import NativeCompletionRequest
from ..wire.native_errors import NativeRoute
from ..wire.offload import offload
from ..wire.responses import ERROR_RESPONSES

router = APIRouter(route_class=NativeRoute, tags=["llama-server"], responses=ERROR_RESPONSES)


@router.post("/completion")
@router.post("/completions")  # llama-server's alias (server.cpp's route table)
async def completion(http: Request, body: NativeCompletionRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    """A completion of each prompt: one answer object, or a list of them for a list of prompts."""
    served = ctx.models.get(body.model)
    prepared = await offload(prepare_native, served, body)
    shape = NativeShape(body.response_fields, body.settings(), prepared.texts)
    if prepared.generation is None:  # n_predict 0: nothing to generate
        return unrun(served.name, [len(tokens) for tokens in prepared.prompts], shape, body.stream)
    presenter = NativePresenter(prepared.generation, shape, body.return_tokens, body.n_probs > 0)
    return await respond(http, ctx, prepared.generation, body.stream, presenter)
