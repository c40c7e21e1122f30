"""llama-server's POST /infill as a module-level router: code editors' fill-in-the-middle
completion (llama.vim, llama.vscode), answered in llama-server's own shape."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from ..output.dispatch import respond
from ..output.infill_presenter import InfillPresenter, final
from ..output.presenters import sse
from ..preparation.infill import prepare_infill
from ..runtime.context import ServerContext, get_context
from ..wire.errors import OpenAIRoute
from ..wire.infill import InfillRequest
from ..wire.responses import ERROR_RESPONSES

router = APIRouter(route_class=OpenAIRoute, tags=["llama-server"], responses=ERROR_RESPONSES)


@router.post("/infill")
async def infill(http: Request, body: InfillRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    """The code between input_prefix (and prompt, the cursor's line) and input_suffix."""
    served = ctx.models.get(body.model)
    tokens, generation = await run_in_threadpool(prepare_infill, served, body)
    if generation is None:  # n_predict 0: llama-server evaluates the prompt into its cache and answers nothing
        empty = final(served.name, "", None, len(tokens), body.response_fields)
        return EventSourceResponse(iter([sse(empty)]), sep="\n") if body.stream else empty
    return await respond(http, ctx, generation, body.stream, InfillPresenter(generation, body.response_fields))
