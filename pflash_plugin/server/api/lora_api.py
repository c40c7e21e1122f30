"""llama-server's /lora-adapters: GET lists the default model's adapters (id, path, scale); POST
takes a scale list ([{id, scale}], the unlisted 0) and answers {"success": true} where it leaves the
scales as they are, a 400 saying why otherwise (preparation/lora.py: they are the server's, set at
start, here)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends

from ..preparation.lora import adapters, refuse_other_scales
from ..runtime.context import ServerContext, get_context
from ..wire.native_errors import NativeRoute
from ..wire.lora import scale_list
from ..wire.responses import ERROR_RESPONSES

router = APIRouter(route_class=NativeRoute, tags=["llama-server"], responses=ERROR_RESPONSES)


@router.get("/lora-adapters")
async def lora_adapters(ctx: ServerContext = Depends(get_context)) -> Any:
    return adapters(ctx.models.default)


@router.post("/lora-adapters")
async def set_lora_adapters(body: Any = Body(...), ctx: ServerContext = Depends(get_context)) -> Any:
    refuse_other_scales(ctx.models.default, scale_list(body), "body")
    return {"success": True}
