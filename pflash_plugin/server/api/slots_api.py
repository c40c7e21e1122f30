"""llama-server's GET /slots (server-context.cpp, SERVER_TASK_TYPE_SLOT_GET): each slot's state, as
monitors and llama.cpp's web UI read it, from what the engine publishes for /status (its last
round's frozen stats); nothing of a request's parameters, which the engine does not publish. Its
save/restore/erase actions are a 501."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Depends

from ...engine.stats import SchedulerStats
from ..runtime.context import ServerContext, get_context
from ..wire.native_errors import NativeRoute
from ..wire.protocol import RequestError
from ..wire.responses import ERROR_RESPONSES

router = APIRouter(route_class=NativeRoute, tags=["llama-server"], responses=ERROR_RESPONSES)


def slots_json(stats: SchedulerStats, n_ctx: int) -> list[dict[str, Any]]:
    """Each slot as llama-server shows it (id, n_ctx: the most one request holds, speculative,
    is_processing, id_task while busy) and ours: state (idle, prefill, decode), tokens in its KV."""
    slots = []
    for slot in stats.slots:
        body: dict[str, Any] = {"id": slot.id, "n_ctx": n_ctx, "speculative": stats.speculation is not None,
                                "is_processing": slot.request_id is not None, "state": slot.state,
                                "kv_tokens": slot.kv_tokens}
        if slot.request_id is not None:
            body["id_task"] = slot.request_id
        slots.append(body)
    return slots


@router.get("/slots")
async def slots(model: Optional[str] = None, fail_on_no_slot: Optional[str] = None,
                ctx: ServerContext = Depends(get_context)) -> Any:
    """The model's slots (default: the first); fail_on_no_slot (any value): a 503 when none is idle."""
    if not ctx.settings.slots:
        raise RequestError(501, "This server does not support slots endpoint. Start it with `--slots true`",
                           type_="not_supported_error")
    served = ctx.models.get(model)
    body = slots_json(served.engine.stats(), served.max_ctx)
    if fail_on_no_slot and all(slot["is_processing"] for slot in body):
        raise RequestError(503, "no slot available", type_="unavailable_error")
    return body


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str) -> Any:
    """llama-server's save, restore and erase of a slot's KV (its --slot-save-path): not served, a 501
    as llama-server answers without that option. Requests here are not tied to a slot, whose cache
    the engine keeps, moves and evicts on its own (docs/api.md)."""
    raise RequestError(501, "slot save, restore and erase are not served here: the engine places requests and "
                       "keeps their prefixes in its own cache", type_="not_supported_error")
