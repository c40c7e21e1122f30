"""/v1/embeddings: inputs tokenized and checked on the worker pool, then embedded on the embedder's
own thread (engine/embedder.py) while the route awaits, without holding a worker; a client that
disconnects drops what it still waits for."""
from __future__ import annotations

import asyncio
import base64
import threading
import time
from typing import Any

import numpy as np
from fastapi import Request
from starlette.responses import Response

from ...engine.embedder import Embedder
from ...engine.scheduler import AdmissionError
from ..output.dispatch import client_gone
from ..runtime.context import ServerContext
from ..runtime.models import ServedModel
from ..wire.offload import offload
from ..wire.protocol import EmbeddingRequest, RequestError
from ..wire.responses import Embedding, EmbeddingResponse


async def embed(http: Request, ctx: ServerContext, served: ServedModel, body: EmbeddingRequest) -> Any:
    if served.embedder is None:
        raise RequestError(400, f"the model {served.name!r} is not served with embedding: true", param="model")
    inputs = await offload(_inputs, served, served.embedder, body)
    started = time.perf_counter()
    try:
        vectors = await _vectors(http, served.embedder, inputs)
    except AdmissionError as error:
        raise ctx.refusal(served, error) from None
    if vectors is None:
        return Response(status_code=499)
    data = [Embedding(embedding=_encoded(v, body.encoding_format), index=i) for i, v in enumerate(vectors)]
    n_tokens = sum(len(tokens) for tokens in inputs)
    ctx.metrics.llama.embedded(n_tokens, len(inputs), time.perf_counter() - started)  # llamacpp:* series
    return EmbeddingResponse(data=data, model=served.name, usage={"prompt_tokens": n_tokens, "total_tokens": n_tokens})


def _inputs(served: ServedModel, embedder: Embedder, body: EmbeddingRequest) -> list[list[int]]:
    inputs = [tokens for tokens, _ in served.prompts.tokenize_prompts(body.input, param="input")]
    for index, tokens in enumerate(inputs):
        try:
            embedder.check(tokens)
        except ValueError as error:
            raise RequestError(400, f"embedding input {index}: {error}", param="input") from None
    return inputs


async def _vectors(http: Request, embedder: Embedder, inputs: list[list[int]]) -> list[list[float]] | None:
    """The inputs' vectors, or None if the client left first (what still waits is dropped)."""
    cancelled = threading.Event()
    waiting = asyncio.wrap_future(embedder.submit(inputs, cancelled))
    gone = asyncio.ensure_future(client_gone(http))
    either: set[asyncio.Future[Any]] = {waiting, gone}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiting.done():  # the client left, or this route was cancelled
            cancelled.set()
            waiting.cancel()
    return waiting.result() if not waiting.cancelled() else None


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64 is the vector's little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
