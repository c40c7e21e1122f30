"""The models a server serves: each one's model, engine, drafter and embedder from start to close,
found by the request's `model` in the registry."""
from __future__ import annotations

import logging
import threading
from dataclasses import asdict, replace
from typing import Any

from ...chat.reasoning import requested_tags, think_tags
from ...engine.runner import LlamaRunner
from ...engine.stats import SchedulerStats
from ...llama.devices import gpu_count
from ...pflash.payoff import Calibration
from ...pflash.planning import Planner
from ..config.settings import ModelSettings
from ..wire.protocol import RequestError
from .assembly import assemble
from .calibrate import calibrate
from .media_prepare import MediaPreparation
from .media_reader import MediaLimits, MediaReader, media_kinds
from .warmup import warm_engine, warmup_tokens

log = logging.getLogger(__name__)


class ServedModel:
    """One model from start to close: its weights, engine, PFlash drafter and thread, embedder, and
    the per-model parts of a request's preparation (prompts, PFlash planner)."""

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        parts = assemble(settings)  # every key applied, or refused here (SettingsRefused)
        self.plan, self.name, self.model, self.engine = parts.plan, parts.plan.name, parts.model, parts.engine
        self.compression, self.embedder, self.prompts = parts.compression, parts.embedder, parts.prompts
        self.drafter_file = parts.drafter_file  # the GGUF a separate drafter runs (its cut copy, say)
        # the markers of the thinking the chat template teaches, and those read under --reasoning_format
        # (None: answers are read as content only); a request's reasoning_format may read the template's
        self.template_tags = think_tags(self.model.chat_template() if settings.chat_format is None else None)
        self.think_tags = requested_tags(self.template_tags, settings.reasoning_format)
        for tags in (self.template_tags, self.think_tags):  # markers that are control tokens reach the readers
            if tags is not None:
                self.model.render_tokens(tags.markers)
        self.media = MediaReader(MediaLimits.of(settings), media_kinds(self.engine.media))  # issue 46
        self.media_preparation = MediaPreparation() if self.engine.media else None  # media chats' own pool
        self.pflash = self.plan.pflash.config
        self.planner = Planner(self.pflash, self.model, enabled=self.compression is not None)
        if self.pflash_scorer == "numpy" and self.plan.pflash.scorer == "auto":
            log.warning("model %s: PFlash scores with numpy, about 50x slower than the native scorer (201 ms "
                        "against 4 ms at 16K tokens, docs/scoring_cpu.md), which is not built (or PFLASH_NATIVE=0): "
                        "reinstall with a C++17 compiler, pip install --no-build-isolation -e . (its build warning "
                        "says what failed)", self.name)
        self.calibration = self._calibrate(parts.on_gpu) if self.plan.pflash.mode == "auto" else None
        # not where it speculates: speculation's budget prices drafts against the plain steps it measured,
        # and a warm-up's steps (the draft model still cold) left a first request drafting nothing
        if settings.warmup and self.plan.engine.speculation is None:
            warm_engine(self, self.model, warmup_tokens(self.model.layers_on_gpu, self.plan.engine.n_ubatch,
                                                         self.max_ctx))
        self.warmup_steps = self.engine.steps
        if parts.vocabulary is not None:  # built beside the context's creation and the warm-up (assemble)
            parts.vocabulary.join()

    def _calibrate(self, on_gpu: bool) -> Calibration | None:
        """Whether compression pays here, measured once at start (by default on a GPU only: a long
        prefill on a CPU takes minutes); auto then plans with the config it returns, which
        compresses only where it does (before any client request: nothing plans meanwhile)."""
        asked = self.plan.pflash.calibrate
        if asked == "off" or asked == "auto" and not on_gpu:
            return None
        outcome = calibrate(self, self.plan.pflash.min_speedup)
        if outcome is None:
            return None
        self.pflash = outcome.config
        self.planner = Planner(self.pflash, self.model, enabled=self.compression is not None)
        return outcome.calibration

    def served_stats(self) -> SchedulerStats:
        """The engine's stats with its steps counted from the end of the warm-up (llama-server's
        n_decode_total leaves its warm-up out too)."""
        stats = self.engine.stats()
        return replace(stats, steps=stats.steps - self.warmup_steps)

    def status(self) -> dict[str, Any]:
        """This model's entry in /status: its engine's last stats, its limits and what runs PFlash."""
        media = None  # issue 46: the projector's encoder, and the media requests' preparation
        if self.engine.media and self.media_preparation:
            media = asdict(self.engine.media.stats()) | self.media_preparation.counts()
        runner = self.engine.runner  # issue 49: the constraint work's phases, sums since start
        constraints = runner.sampling.constraints.counts.as_dict() if isinstance(runner, LlamaRunner) else None
        return self.engine.stats().as_dict() | {"max_ctx": self.max_ctx, "pflash_scorer": self.pflash_scorer,
                                                "pflash_drafter": self.drafter_file, "media": media,
                                                "constraints": constraints,
                                                "cpu_path": self.model.cpu_path, **self.pflash_status()}

    def pflash_status(self) -> dict[str, Any]:
        """What /status says of PFlash: its mode and keep ratio (or curve); in auto mode its
        threshold, and the start-up measurement behind it."""
        mode: dict[str, Any] = {"pflash": self.plan.pflash.mode}
        if not self.plan.pflash.on:
            return mode
        mode |= {"pflash_keep_ratio": self.pflash.keep_ratio, "pflash_curve": self.plan.pflash.curve}
        if self.plan.pflash.mode != "auto":
            return mode
        calibration = None
        if self.calibration is not None:
            calibration = {**asdict(self.calibration), "speedup": round(self.calibration.speedup, 3)}
        return mode | {"pflash_threshold": self.pflash.threshold, "pflash_calibration": calibration}

    def summary(self) -> str:
        """One line of how the model serves, for the start-up log."""
        cache = self.engine.stats().cache
        parts = [f"{self.plan.engine.n_slots} slots", f"KV pool {cache.kv_pages_total * cache.kv_page_size} tokens",
                 f"max_ctx {self.max_ctx}", f"PFlash {self.plan.pflash.mode}"]
        if self.plan.pflash.on:
            keep = self.plan.pflash.curve or self.pflash.keep_ratio
            scorer = self.pflash_scorer or "chosen per prompt"
            parts[-1] += (f" (threshold {self.pflash.threshold}, keep {keep}, scorer {scorer}, "
                          f"drafter {self.drafter_file or 'the model itself'})")
        layers = self.model.n_gpu_layers
        parts.append(f"GPU layers {'all' if layers == -1 else layers} on {gpu_count()} GPU(s)" if layers
                     else f"CPU path {self.model.cpu_path}")
        return ", ".join(parts)

    @property
    def pflash_scorer(self) -> str | None:
        """The scorer in use (native-cpu, native-cuda, native-hip, numpy), once a drafter exists."""
        return self.compression.compressor.scorer_name if self.compression else None

    @property
    def max_ctx(self) -> int:
        return self.plan.max_ctx

    def close(self, grace_s: float = 0.0) -> None:
        """Stop admitting and drain the engine (requests in flight get `grace_s` seconds to finish,
        then are cancelled), stop the compression thread, free the contexts."""
        self.engine.shutdown(grace_s)
        if self.compression is not None:
            self.compression.stop()
        self.engine.close()
        if self.embedder is not None:
            self.embedder.close()
        if self.media_preparation is not None:
            self.media_preparation.close()


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
        """Every engine and embedder stops admitting (503) and drains within `grace_s`, all at once."""
        threads = [threading.Thread(target=part.shutdown, args=(grace_s,), name=f"drain-{name}")
                   for name, served in self.models.items()
                   for part in (served.engine, served.embedder) if part is not None]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def close(self, grace_s: float = 0.0) -> None:
        """Drain (within `grace_s`) and free every model; `drain` first to drain them all at once."""
        for served in self.models.values():
            served.close(grace_s)
