"""FastAPI app: the OpenAI routes of llama_cpp.server, served by concurrent engines."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from llama_cpp import llama_grammar
from llama_cpp.server.types import CreateEmbeddingRequest, DetokenizeInputRequest, TokenizeInputRequest
from sse_starlette.sse import EventSourceResponse

from ..engine.request import ErrorEvent, FinishEvent, Request as EngineRequest, TextEvent
from ..engine.scheduler import AdmissionError
from .metrics import Metrics
from .models import ModelRouter, ServedModel
from .protocol import (
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    RequestError,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
    sampling_params,
    usage_chunk,
)
from .security import install_security
from .settings import ModelSettings, ServerSettings

_bearer = HTTPBearer(auto_error=False)


def create_app(server_settings: ServerSettings, model_settings: list[ModelSettings], router: ModelRouter | None = None) -> FastAPI:
    models = router or ModelRouter(model_settings)
    metrics = Metrics(lambda: {name: m.engine.status() for name, m in models.models.items()})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        models.close()

    app = FastAPI(title="pflash-plugin: concurrent llama.cpp server", lifespan=lifespan, root_path=server_settings.root_path)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"])
    install_security(app, server_settings)
    app.state.models, app.state.metrics = models, metrics

    async def authenticate(authorization=Depends(_bearer)) -> None:
        if server_settings.api_key is not None and (
            authorization is None or authorization.credentials != server_settings.api_key
        ):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Invalid API key")

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, error: RequestError) -> JSONResponse:
        return error_response(error.status, error.message, error.type, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{field}: {first.get('msg', 'invalid value')}" if field else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", field), 422)

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "authentication_error" if error.status_code == 401 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), error.status_code, headers=error.headers)

    def submit(served: ServedModel, request: EngineRequest) -> None:
        try:
            served.engine.submit(request)
        except AdmissionError as error:
            metrics.errors.labels(served.name, str(error.status)).inc()
            raise RequestError(error.status, error.message, error.type, code=error.type) from None

    # ---- generation ------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=[Depends(authenticate)])
    @app.post("/v1/engines/copilot-codex/completions", include_in_schema=False, dependencies=[Depends(authenticate)])
    async def create_completion(http: Request, body: CompletionRequest) -> Any:
        served = models.get(body.model)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise RequestError(400, "exactly one prompt string is supported", param="prompt")
            prompt = prompt[0]
        if body.suffix:
            raise RequestError(400, "suffix is not supported", param="suffix")
        tokens = served.tokenize_prompt(prompt)
        grammar = body.grammar
        params = sampling_params(
            body,
            max_tokens=_max_tokens(body.max_tokens, tokens, served),
            logprobs=body.logprobs,
            grammar=grammar,
            logit_bias=served.logit_bias(body.logit_bias, body.logit_bias_type == "tokens"),
        )
        request = EngineRequest(tokens, params)
        served.plan_compression(request, body.pflash, json_format=bool(grammar))
        rid, echo = new_id("cmpl"), prompt if body.echo else ""
        logprobs = CompletionLogprobs(served.model.piece) if body.logprobs is not None else None

        def chunk(text: str, outputs: list, finish: str | None) -> dict:
            return completion_chunk(rid, served.name, text, finish, logprobs.add(outputs) if logprobs else None)

        def final(text: str, finish: str, usage: dict) -> dict:
            return completion_response(rid, served.name, echo + text, finish, usage, logprobs.as_dict() if logprobs else None)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _serve(http, served, request, body.stream, chunk, final, "text_completion", include_usage,
                            prefix=echo, on_tokens=logprobs.add if logprobs else None)

    @app.post("/v1/chat/completions", dependencies=[Depends(authenticate)])
    async def create_chat_completion(http: Request, body: ChatCompletionRequest) -> Any:
        served = models.get(body.model)
        if not body.messages:
            raise RequestError(400, "messages must contain at least one message", param="messages")
        rendered = served.render_chat([dict(m) for m in body.messages], body.tools, body.tool_choice)
        grammar = body.grammar
        if body.response_format and body.response_format.get("type") == "json_object":
            schema = body.response_format.get("schema")
            try:
                grammar = llama_grammar.json_schema_to_gbnf(json.dumps(schema)) if schema else llama_grammar.JSON_GBNF
            except Exception as error:
                raise RequestError(400, f"response_format schema is not usable: {error}", param="response_format")
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        params = sampling_params(
            body,
            max_tokens=_max_tokens(body.max_tokens, rendered.tokens, served),
            logprobs=top,
            grammar=grammar,
            logit_bias=served.logit_bias(body.logit_bias, body.logit_bias_type == "tokens"),
        )
        params.stop = params.stop + [s for s in rendered.stop if s not in params.stop]
        request = EngineRequest(rendered.tokens, params)
        served.plan_compression(
            request, body.pflash, last_user=rendered.last_user, system=rendered.system,
            has_tools=bool(body.tools or body.functions), json_format=bool(grammar),
        )
        rid = new_id("chatcmpl")
        all_logprobs: list | None = [] if body.logprobs else None

        def chunk(text: str, outputs: list, finish: str | None) -> dict:
            lp = chat_logprobs(served.model.piece, outputs) if all_logprobs is not None else None
            return chat_chunk(rid, served.name, {"content": text} if text else {}, finish, lp)

        def final(text: str, finish: str, usage: dict) -> dict:
            return chat_response(rid, served.name, text, finish, usage, all_logprobs)

        def on_tokens(outputs: list) -> None:
            if all_logprobs is not None:
                all_logprobs.extend(chat_logprobs(served.model.piece, outputs))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        first = chat_chunk(rid, served.name, {"role": "assistant", "content": ""}, None, None)
        return await _serve(http, served, request, body.stream, chunk, final, "chat.completion.chunk", include_usage, first=first, on_tokens=on_tokens)

    async def _serve(http, served, request, stream, chunk, final, obj, include_usage, prefix="", first=None, on_tokens=None):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request.sink = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        submit(served, request)

        def on_finish(event: FinishEvent) -> None:
            metrics.finished(served.name, event.reason, event.usage)

        def on_error(event: ErrorEvent) -> dict:
            metrics.errors.labels(served.name, str(event.status)).inc()
            return error_body(event.message, event.type, code=event.type)

        if not stream:
            texts: list[str] = []
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(events.get(), timeout=1.0)
                    except asyncio.TimeoutError:
                        if await http.is_disconnected():
                            return Response(status_code=499)
                        continue
                    if isinstance(event, TextEvent):
                        texts.append(event.text)
                        if on_tokens:
                            on_tokens(event.tokens)
                    elif isinstance(event, FinishEvent):
                        on_finish(event)
                        return final("".join(texts), event.reason, event.usage)
                    else:
                        on_error(event)
                        return error_response(event.status, event.message, event.type, code=event.type)
            finally:
                if request.finish_reason is None:
                    served.engine.cancel(request)

        async def publish() -> AsyncIterator[dict]:
            try:
                if first is not None:
                    yield {"data": json.dumps(first)}
                if prefix:
                    yield {"data": json.dumps(chunk(prefix, [], None))}
                while True:
                    event = await events.get()
                    if isinstance(event, TextEvent):
                        yield {"data": json.dumps(chunk(event.text, event.tokens, None))}
                    elif isinstance(event, FinishEvent):
                        on_finish(event)
                        yield {"data": json.dumps(chunk("", [], event.reason))}
                        if include_usage:
                            yield {"data": json.dumps(usage_chunk(new_id("usage"), served.name, obj, event.usage))}
                        yield {"data": "[DONE]"}
                        return
                    else:
                        yield {"data": json.dumps(on_error(event))}
                        return
            finally:
                if request.finish_reason is None:
                    served.engine.cancel(request)

        # comment pings keep the stream alive while a prompt waits or is compressed
        return EventSourceResponse(publish(), ping=10**9 if server_settings.disable_ping_events else server_settings.sse_ping_seconds, sep="\n")

    # ---- the rest --------------------------------------------------------------------------
    @app.post("/v1/embeddings", dependencies=[Depends(authenticate)])
    async def create_embedding(body: CreateEmbeddingRequest) -> Any:
        served = models.get(body.model)
        if served.embedder is None:
            raise RequestError(400, f"the model {served.name!r} is not served with embedding: true", param="model")
        inputs = body.input if isinstance(body.input, list) else [body.input]
        data = []
        for index, text in enumerate(inputs):
            tokens = served.tokenize_prompt(text)
            try:
                vector = await asyncio.to_thread(served.embedder.embed, tokens)
            except ValueError as error:
                raise RequestError(400, str(error), param="input") from None
            data.append({"object": "embedding", "embedding": vector, "index": index})
        n = sum(len(served.tokenize_prompt(t)) for t in inputs)
        return {"object": "list", "data": data, "model": served.name, "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.get("/v1/models", dependencies=[Depends(authenticate)])
    async def list_models() -> Any:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "owned_by": "me", "permissions": []} for name in models.models],
        }

    @app.post("/extras/tokenize", dependencies=[Depends(authenticate)])
    async def tokenize(body: TokenizeInputRequest) -> Any:
        return {"tokens": models.get(body.model).tokenize_prompt(body.input)}

    @app.post("/extras/tokenize/count", dependencies=[Depends(authenticate)])
    async def count_tokens(body: TokenizeInputRequest) -> Any:
        return {"count": len(models.get(body.model).tokenize_prompt(body.input))}

    @app.post("/extras/detokenize", dependencies=[Depends(authenticate)])
    async def detokenize(body: DetokenizeInputRequest) -> Any:
        served = models.get(body.model)
        for token in body.tokens:
            if not 0 <= token < served.model.n_vocab:
                raise RequestError(400, f"token id {token} is outside the vocabulary", param="tokens")
        return {"text": served.model.detokenize(body.tokens)}

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/status")
    async def server_status() -> Any:
        return {"models": {name: m.engine.status() | {"max_ctx": m.max_ctx} for name, m in models.models.items()}}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


def _max_tokens(requested: int | None, prompt: list[int], served: ServedModel) -> int:
    """None or 0 means: until the context ends, as in llama_cpp."""
    if requested is None or requested <= 0:
        return max(served.max_ctx - len(prompt), 1)
    return requested
