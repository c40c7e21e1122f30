"""What the routes need, found on the app they are mounted in (`app.state.pflash`), so the same
module-level routers serve any number of apps in one process."""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from fastapi import FastAPI, Request

from ...engine.request import ErrorKind
from ...engine.request import Request as EngineRequest
from ...engine.scheduler import AdmissionError
from ..config.settings import ServerSettings
from ..operations.metrics import Metrics
from ..wire.errors import http_of
from ..wire.protocol import RequestError
from .models import ModelRegistry, ServedModel
from .tokenizer_pool import TokenizerPool


@dataclass
class ServerContext:
    settings: ServerSettings
    models: ModelRegistry
    metrics: Metrics
    tokenizer: TokenizerPool  # the routes that only tokenize

    def polite_s(self) -> float:
        """How long a large request's preparation may wait (--polite_prepare_ms)."""
        return self.settings.polite_prepare_ms / 1000

    @classmethod
    def build(cls, settings: ServerSettings, models: ModelRegistry) -> ServerContext:
        metrics = Metrics(lambda: {name: m.served_stats() for name, m in models.models.items()})
        threads = settings.tokenizer_threads or max(1, (os.cpu_count() or 1) // 8)
        return cls(settings, models, metrics, TokenizerPool(threads, settings.tokenizer_queue))

    async def submit(self, served: ServedModel, requests: list[EngineRequest], prompt_field: str) -> None:
        """Hand a client's requests (its n choices) to their model's engine and wait for the engine
        thread's answer, so that a refusal (400, 429, 503) is a RequestError before any byte of
        the response, streamed or not. A prompt too long names `prompt_field` (the client's
        `messages` or `prompt`), as OpenAI's context_length_exceeded does."""
        try:
            await asyncio.wrap_future(served.engine.submit(*requests))
        except AdmissionError as error:
            # more choices than slots + queue: the client's `n` (times its prompts) asked for them
            param = "n" if len(requests) > served.engine.scheduler.limits.capacity else None
            raise self.refusal(served, error, prompt_field if error.kind is ErrorKind.TOO_LONG else param) from None

    def refusal(self, served: ServedModel, error: AdmissionError, param: str | None = None) -> RequestError:
        """A model's refusal (too long, busy, unavailable...) as the client's error, counted in /metrics."""
        status, kind, code = http_of(error.kind)
        self.metrics.errors.labels(served.name, str(status)).inc()
        return RequestError(status, error.message, kind, param=param, code=code, counted=True)

    def close(self) -> None:
        self.tokenizer.close()
        self.models.close(self.settings.shutdown_grace_s)


def attach(app: FastAPI, context: ServerContext) -> None:
    """Make `context` the one the routers see in `app` (call it before mounting them elsewhere)."""
    app.state.pflash = context
    app.state.models, app.state.metrics = context.models, context.metrics


async def get_context(request: Request) -> ServerContext:
    """The routes' dependency. A coroutine on purpose: FastAPI runs a plain function dependency on
    its thread pool, and that hop cost a short request 18 ms (median) of its way to the engine
    beside mix8's long bodies on 2 CPU cores (issue 48), waiting for the GIL and a worker twice."""
    try:
        return request.app.state.pflash
    except AttributeError:
        raise RuntimeError("the pflash routers need a context: "
                           "call pflash_plugin.server.runtime.context.attach(app, context)") from None
