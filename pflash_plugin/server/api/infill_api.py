"""llama-server's POST /infill as a module-level router: code editors' fill-in-the-middle
completion (llama.vim, llama.vscode), answered in llama-server's own shape."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..output.dispatch import respond
from ..output.native_presenter import NativePresenter, NativeShape, unrun
from ..preparation.infill import prepare_infill
from ..runtime.context import ServerContext, get_context
from ..wire.infill import InfillRequest
from ..wire.native_errors import NativeRoute
from ..wire.offload import offload
from ..wire.responses import ERROR_RESPONSES

router = APIRouter(route_class=NativeRoute, tags=["llama-server"], responses=ERROR_RESPONSES)


@router.post("/infill")
async def infill(http: Request, body: InfillRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    """The code between input_prefix (and prompt, the cursor's line) and input_suffix."""
    served = ctx.models.get(body.model)
    tokens, generation = await offload(prepare_infill, served, body)
    shape = NativeShape(body.response_fields)
    if generation is None:  # n_predict 0: llama-server evaluates the prompt into its cache and answers nothing
        return unrun(served.name, [len(tokens)], shape, body.stream)
    return await respond(http, ctx, generation, body.stream, NativePresenter(generation, shape, probs=body.n_probs > 0))
