"""The FastAPI app: the OpenAI routes of llama_cpp.server, the Responses API and Anthropic's
Messages API, served by concurrent engines.

`create_app` only assembles: the routes live in module-level routers (openai_api, responses_api,
anthropic_api, llama-server's infill_api, completion_api and native_extras_api, extras_api) that
find their models through the ServerContext attached to the app, so they can be mounted into
another FastAPI app as well (`attach(app, context)` then `include_router`).
"""
from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Iterable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api.anthropic_api import router as anthropic_router
from ..api.completion_api import router as completion_router
from ..api.extras_api import extras, operations
from ..api.infill_api import router as infill_router
from ..api.lora_api import router as lora_router
from ..api.native_extras_api import router as native_extras_router
from ..api.openai_api import router as openai_router
from ..api.responses_api import router as responses_router
from ..api.slots_api import router as slots_router
from ..config.settings import ModelSettings, ServerSettings
from ..operations.gc_heap import frozen_heap
from ..operations.received import ReceivedAt
from ..operations.root_path import RootPath
from ..operations.security import install_security
from ..operations.shutdown_cut import ShutdownCut
from ..runtime.context import ServerContext, attach
from ..runtime.models import ModelRegistry
from ..runtime.warmup import warm_request_path
from ..wire.errors import http_error
from .shutdown import drain_on_signal

ROUTERS = (openai_router, responses_router, anthropic_router, infill_router, completion_router, native_extras_router,
           slots_router, lora_router, extras, operations)


def create_app(
    server_settings: ServerSettings,
    model_settings: list[ModelSettings],
    models: ModelRegistry | None = None,
    extra_routers: Iterable[Any] = (),
) -> FastAPI:
    """An app serving `model_settings` (or an existing registry of loaded `models`), with the
    routers that plugins add after ours."""
    if server_settings.gil_switch_ms is not None:  # process-wide: the engine threads' wait for the GIL
        sys.setswitchinterval(server_settings.gil_switch_ms / 1000)
    context = ServerContext.build(server_settings, models or ModelRegistry(model_settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        drain_on_signal(context.models, server_settings.shutdown_grace_s)
        await warm_request_path()
        with frozen_heap():
            yield
        context.close()

    app = FastAPI(title="pflash-plugin: concurrent llama.cpp server", lifespan=lifespan)
    if server_settings.cors_origins:  # stock echoes any origin with credentials allowed: here only listed ones get them
        app.add_middleware(CORSMiddleware, allow_origins=server_settings.cors_origins, allow_methods=["*"],
                           allow_credentials="*" not in server_settings.cors_origins, allow_headers=["*"])
    app.add_exception_handler(StarletteHTTPException, http_error)  # 404, 405: OpenAI's error shape
    install_security(app, server_settings)
    app.add_middleware(ReceivedAt)  # usage's timings.prepare_ms counts from its mark (nothing ahead of it waits)
    app.add_middleware(ShutdownCut, metrics=context.metrics)  # a request cut at shutdown gets a 503
    if server_settings.root_path:  # outermost, as FastAPI's own root_path was: everything after sees it
        app.add_middleware(RootPath, root_path=server_settings.root_path)
    attach(app, context)
    for api in (*ROUTERS, *extra_routers):
        app.include_router(api)
    return app
