"""llama-server's helper routes as a module-level router: /tokenize, /detokenize, /apply-template
(a chat's prompt through our chat template, not run) and GET /props (what a client reads to set
itself up: the context, the slots, the template, the modalities). Answered in llama-server's
shapes; /props holds only the fields we have true values for."""
from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import APIRouter, Depends, Request

from ..preparation.fim import text_tokens
from ..preparation.prepare import chat_prompt
from ..runtime.context import ServerContext, get_context
from ..runtime.media_prepare import prepared
from ..runtime.media_reader import media_kinds
from ..runtime.models import ServedModel
from ..wire.native_errors import NativeRoute
from ..wire.native_extras import NativeDetokenize, NativeTokenize, Piece
from ..wire.protocol import ChatCompletionRequest
from ..wire.responses import ERROR_RESPONSES

router = APIRouter(route_class=NativeRoute, tags=["llama-server"], responses=ERROR_RESPONSES)


def _piece(served: ServedModel, token: int) -> Piece:
    """A token's text, or its bytes where they are not UTF-8 alone (part of a character)."""
    raw = served.model.piece(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _tokenize(served: ServedModel, body: NativeTokenize) -> list[Any]:
    tokens = text_tokens(served, body.content, "content", body.add_special, body.parse_special)
    served.prompts.limit.check_tokens(tokens, "content")
    return [{"id": t, "piece": _piece(served, t)} for t in tokens] if body.with_pieces else tokens


@router.post("/tokenize")
async def tokenize(body: NativeTokenize, ctx: ServerContext = Depends(get_context)) -> Any:
    """{"tokens": ids}, or {id, piece} objects where with_pieces asks."""
    return {"tokens": await ctx.tokenizer.run(_tokenize, ctx.models.get(body.model), body)}


def _detokenize(served: ServedModel, tokens: list[int]) -> str:
    served.prompts.limit.check_tokens(tokens, "tokens")
    return served.model.detokenize(text_tokens(served, tokens, "tokens"))  # each id checked


@router.post("/detokenize")
async def detokenize(body: NativeDetokenize, ctx: ServerContext = Depends(get_context)) -> Any:
    return {"content": await ctx.tokenizer.run(_detokenize, ctx.models.get(body.model), body.tokens)}


@router.post("/apply-template")
async def apply_template(http: Request, body: ChatCompletionRequest, ctx: ServerContext = Depends(get_context)) -> Any:
    """The prompt a chat completion of this body would read (its tools, template switches), as text."""
    served = ctx.models.get(body.model)
    _, rendered = await prepared(http, served.media_preparation, body, chat_prompt, served, body)
    return {"prompt": rendered.text}


@router.get("/props")
async def props(ctx: ServerContext = Depends(get_context)) -> Any:
    """The default model's settings as llama-server's /props names them."""
    served = ctx.models.default
    kinds = media_kinds(served.engine.media)
    body: dict[str, Any] = {
        "default_generation_settings": {"n_ctx": served.max_ctx},
        "total_slots": served.plan.engine.n_slots,
        "model_alias": served.name,
        "model_path": served.settings.model,
        "modalities": {"vision": "image" in kinds, "audio": "audio" in kinds},
        "build_info": f"pflash-plugin {metadata.version('pflash-plugin')}, "
                      f"llama-cpp-python {metadata.version('llama-cpp-python')}",
    }
    template = served.model.chat_template() if served.settings.chat_format is None else None
    if template:
        body["chat_template"] = template
    return body
