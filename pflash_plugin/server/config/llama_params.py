"""Every key of a model's settings, mapped once: `plan` before the weights load (what llama.cpp
loads them with), `resolve` once they have (the frozen `ModelPlan` the model is served with, max_ctx
and the PFlash keys included). Nothing downstream reads the settings.

A stock `llama_cpp.server` key either reaches llama.cpp (model load, context, sampler chain, chat
template) with the meaning `llama_cpp.server` gives it (llama_cpp/server/model.py,
llama_cpp/llama.py), or, set to a value this server cannot honour, is refused at start with a
message that names it and says why. Nothing is ignored: `tests/test_llama_params.py` walks the
stock fields and checks each one.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import llama_cpp
from llama_cpp.server.settings import ModelSettings as StockModelSettings

from ... import plugins
from ...chat.vision_formats import OWN_TEMPLATE, needs_projector
from ...engine.loader import EngineConfig, check_config
from ...engine.speculation.setup import DRAFT_PFLASH, PROMPT_LOOKUP, SpeculationConfig
from ...llama import Model, ModelParams, RopeParams
from ...llama.backend import init_numa
from ...llama.cuda_graphs import disable_graphs, graphs_off_reason
from ...llama.devices import add_rpc_servers, gpu_count, gpus_split_rows
from ...pflash.compressor import PflashConfig
from ...pflash.planning import MAX_EXPLICIT_QUERY
from ...pflash.selection import KeepCurve
from ...pflash.windows import DraftWindows
from .settings import ModelSettings

log = logging.getLogger(__name__)


class SettingsRefused(ValueError):
    """A model key set to what the batched engine cannot honour; the message names the key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key


_HF = "HuggingFace tokenizers and hub downloads are not supported: the GGUF's own tokenizer and chat template are used"

# Refused when set to anything but the stock default (a default that means "off" is no refusal).
REFUSED: dict[str, str] = {
    "vocab_only": "the engine generates, which needs the weights, not the vocabulary alone",
    "lora_base": "llama.cpp applies a LoRA adapter to the loaded model itself; a separate base model is not "
    "supported (llama-cpp-python 0.3.36 ignores this key)",
    "hf_model_repo_id": _HF,
    "hf_tokenizer_config_path": _HF,
    "hf_pretrained_model_name_or_path": _HF,
    "cache_type": "there is no disk prompt cache: --cache keeps evicted prefixes in host RAM (--cache_size bytes)",
    "mul_mat_q": "llama.cpp has no such switch any more (its backends choose their matmul kernels); "
    "llama-cpp-python 0.3.36 ignores it too",
}

SPLIT_MODES = {
    llama_cpp.LLAMA_SPLIT_MODE_NONE: "none",
    llama_cpp.LLAMA_SPLIT_MODE_LAYER: "layer",
    llama_cpp.LLAMA_SPLIT_MODE_ROW: "row",
    llama_cpp.LLAMA_SPLIT_MODE_TENSOR: "tensor",
}
SPLIT_MODES_TEXT = ", ".join(f"{mode} ({name})" for mode, name in SPLIT_MODES.items())
# llama.cpp then fails at load with "device CUDA0 does not support split buffers" (seen on two H200s,
# in llama-server as in ours): its CUDA backend of this version has no row split
NO_ROW_SPLIT = ("2 (row) needs split buffers, which this llama.cpp build's GPU backend does not have; "
                "use 1 (layer) or 3 (tensor parallel, experimental in llama.cpp)")

# Accepted with any value: what the key asks for is what the engine always does.
ALWAYS_SO: dict[str, str] = {
    "logits_all": "logprobs are computed from each sampled row whatever its value, and no all-token "
    "logits buffer is kept",
}

# At their stock values these leave llama.cpp's own default, "as the model says" (stock would force
# the GGUF-less value onto models whose metadata sets another).
_YARN_STOCK = {"yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
_RANDOM_SEEDS = (-1, llama_cpp.LLAMA_DEFAULT_SEED)
_KV_TYPES: dict[str, Callable[[str], bool | int | float | str]] = {
    "bool": lambda v: v.lower() in ("true", "1"), "int": int, "float": float, "str": str}


@dataclass(frozen=True)
class LlamaPlan:
    """What one model's settings tell llama.cpp before its weights load, built by `plan` alone."""

    model_path: str | None
    alias: str | None
    target: ModelParams  # the target's load, rope and LoRA
    max_ctx: int | None  # asked for (--max_ctx, else --n_ctx); None: the model's training context
    drafter: ModelParams  # a separate --pflash_drafter GGUF (placement only)
    numa: int  # ggml_numa_strategy
    rpc_servers: tuple[str, ...]
    embedding: bool
    chat_format: str | None  # None: the GGUF's template (stock's mtmd and gemma4 formats included)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    verbose: bool = False
    mmproj: str | None = None  # the multimodal projector GGUF (--mmproj, clip_model_path), loaded beside the model
    cuda_graphs: str | None = None  # why CUDA graphs go off on a GPU (cuda_graphs.graphs_off_reason); None: not


# drafter ubatch (capped by n_batch); on an H200, 2048 drafted 64K-128K tokens 7-13% slower than 512
DRAFT_BATCH = 512


@dataclass(frozen=True)
class PflashPlan:
    """Every PFlash key, mapped once max_ctx is known."""

    mode: str  # off | auto | always
    config: PflashConfig  # what the planner and the compressor read (threshold, keep ratio, curve, ...)
    curve: str | None  # --pflash_curve as given, for /status
    scorer: str
    drafter: str | None  # a separate drafter GGUF; None: the target stopped early
    layers: tuple[int, ...] | None  # scoring layers asked for; None: the drafter's first global one
    drafter_cut: bool
    cache_dir: str | None
    max_tokens: int  # the longest text a drafter takes: max_ctx and an explicit query's room
    windows: DraftWindows
    n_batch: int  # tokens of a drafter window per ubatch
    n_threads: int
    lanes: int | None  # asked for; None: sized with the memory (assembly.size_memory)
    pin_view: bool | None  # None: where the drafter is on a GPU
    rope: str
    shared_duty: float
    persistent: bool  # the drafter stays loaded (draft_residency)
    calibrate: str  # auto | on | off
    min_speedup: float

    @property
    def on(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True)
class ModelPlan:
    """How one model serves, resolved once its weights loaded (`resolve`)."""

    name: str
    engine: EngineConfig  # the target's engine: context, pool, slots, sampler defaults
    pflash: PflashPlan
    llama: LlamaPlan  # the stock keys' mapping the weights were loaded with

    @property
    def max_ctx(self) -> int:
        return self.engine.max_ctx


def plan(s: ModelSettings) -> LlamaPlan:
    """The mapping; raises SettingsRefused for a key it cannot honour."""
    check_refused(s)
    return LlamaPlan(
        model_path=s.model,
        alias=s.model_alias,
        target=model_params(s),
        max_ctx=s.max_ctx or s.n_ctx or None,
        drafter=drafter_params(s),
        numa=numa_strategy(s.numa),
        rpc_servers=tuple(e.strip() for e in (s.rpc_servers or "").split(",") if e.strip()),
        embedding=s.embedding,
        chat_format=None if s.chat_format in OWN_TEMPLATE else s.chat_format,
        chat_template_kwargs=dict(s.chat_template_kwargs or {}),
        verbose=s.verbose,
        mmproj=projector_path(s),
        cuda_graphs=graphs_off_reason(s.cuda_graphs, s.max_concurrency, s.flash_attn, s.n_gpu_layers != 0),
    )


def projector_path(s: ModelSettings) -> str | None:
    """--mmproj or stock's clip_model_path (one meaning, two names: set both, they must agree); a
    chat_format naming stock's vision handler needs one, as stock asserts."""
    if s.mmproj and s.clip_model_path and s.mmproj != s.clip_model_path:
        raise SettingsRefused("clip_model_path", f"{s.clip_model_path!r} and --mmproj {s.mmproj!r} differ: "
                              "they are the same key (the projector), set one")
    key, path = ("mmproj", s.mmproj) if s.mmproj else ("clip_model_path", s.clip_model_path)
    if path and not os.path.isfile(path):
        raise SettingsRefused(key, f"no such file: {path}")
    if not path and needs_projector(s.chat_format):
        raise SettingsRefused("chat_format", f"{s.chat_format!r} is stock's vision handler: serve it with its "
                              "projector GGUF (--mmproj or clip_model_path)")
    return path or None


def check_refused(s: ModelSettings) -> None:
    stock = StockModelSettings.model_fields
    for key, reason in REFUSED.items():
        if getattr(s, key) != stock[key].default:
            raise SettingsRefused(key, reason)


def model_params(s: ModelSettings) -> ModelParams:
    """The target's load (llama_model_params), LoRA adapter and rope, as llama_cpp.Llama sets them."""
    if s.lora_path and not os.path.isfile(s.lora_path):
        raise SettingsRefused("lora_path", f"no such file: {s.lora_path}")
    if s.split_mode not in SPLIT_MODES:
        raise SettingsRefused("split_mode", f"{s.split_mode} is not one of {SPLIT_MODES_TEXT}")
    if s.tensor_split is not None and len(s.tensor_split) > llama_cpp.LLAMA_MAX_DEVICES:
        raise SettingsRefused("tensor_split", f"more entries than llama.cpp's {llama_cpp.LLAMA_MAX_DEVICES} devices")
    return ModelParams(
        n_gpu_layers=s.n_gpu_layers,
        split_mode=s.split_mode,
        main_gpu=s.main_gpu,
        tensor_split=tuple(s.tensor_split) if s.tensor_split is not None else None,
        kv_overrides=tuple(kv_override(entry) for entry in s.kv_overrides or ()),
        use_mmap=s.use_mmap,
        use_mlock=s.use_mlock,
        loras=((s.lora_path, 1.0),) if s.lora_path else (),  # llama_cpp.Llama's lora_scale default
        rope=rope_params(s),
    )


def rope_params(s: ModelSettings) -> RopeParams:
    yarn = {key: -1.0 if getattr(s, key) == value else getattr(s, key) for key, value in _YARN_STOCK.items()}
    return RopeParams(
        scaling_type=s.rope_scaling_type,
        freq_base=s.rope_freq_base,
        freq_scale=s.rope_freq_scale,
        yarn_ext_factor=s.yarn_ext_factor,
        yarn_attn_factor=yarn["yarn_attn_factor"],
        yarn_beta_fast=yarn["yarn_beta_fast"],
        yarn_beta_slow=yarn["yarn_beta_slow"],
        yarn_orig_ctx=s.yarn_orig_ctx,
    )


def kv_override(entry: str) -> tuple[str, bool | int | float | str]:
    """`key=type:value`, type one of bool, int, float, str (llama_cpp.server's format)."""
    key, sep, typed = entry.partition("=")
    kind, colon, value = typed.partition(":")
    if not (sep and colon and key) or kind not in _KV_TYPES:
        raise SettingsRefused("kv_overrides", f"{entry!r} is not key=type:value with type bool, int, float or str")
    if len(key.encode()) > 127 or len(value.encode()) > 127:
        raise SettingsRefused("kv_overrides", f"{entry!r}: llama.cpp takes keys and values of up to 127 bytes")
    try:
        return key, _KV_TYPES[kind](value)
    except ValueError:
        raise SettingsRefused("kv_overrides", f"{entry!r}: {value!r} is not a {kind}") from None


def numa_strategy(numa: bool | int) -> int:
    """llama_cpp.Llama's mapping: true is DISTRIBUTE, an int is a ggml_numa_strategy."""
    strategy = int(numa) if not isinstance(numa, bool) else (1 if numa else 0)
    if not 0 <= strategy <= 4:
        raise SettingsRefused("numa", f"{numa} is not a ggml_numa_strategy (0-4)")
    return strategy


def resolve(s: ModelSettings, llama: LlamaPlan, name: str, model: Model) -> ModelPlan:
    """The plan a model serves with, once its weights loaded: max_ctx is the one asked for, else
    the model's training context; refuses what the model or the drafter's windows cannot serve."""
    engine = replace(engine_config(s, llama.target, llama.max_ctx or model.n_ctx_train), mmproj=llama.mmproj,
                     media_cache_bytes=s.media_cache_mb << 20, media_encoders=s.media_encoders)
    check_config(engine, model)
    pflash = pflash_plan(s, engine.max_ctx)
    if pflash.on:
        pflash.windows.check(pflash.n_batch, pflash.max_tokens)  # at start, also for drafters loaded per prompt
    return ModelPlan(name, engine, pflash, llama)


def pflash_plan(s: ModelSettings, max_ctx: int) -> PflashPlan:
    max_tokens = max_ctx + MAX_EXPLICIT_QUERY
    windows = (DraftWindows.default(s.pflash_drafter_sink, s.pflash_drafter_causal_max, max_tokens)
               if s.pflash_drafter_window is None
               else DraftWindows(s.pflash_drafter_window, s.pflash_drafter_sink, s.pflash_drafter_causal_max))
    return PflashPlan(
        mode=s.pflash,
        config=pflash_config(s),
        curve=s.pflash_curve,
        scorer=s.pflash_scorer,
        drafter=s.pflash_drafter,
        layers=tuple(s.pflash_layers) if s.pflash_layers is not None else None,
        drafter_cut=s.pflash_drafter_cut,
        cache_dir=s.pflash_cache_dir,
        max_tokens=max_tokens,
        windows=windows,
        n_batch=min(s.n_batch, DRAFT_BATCH) if s.pflash_drafter_ubatch is None else s.pflash_drafter_ubatch,
        n_threads=s.n_threads_batch,
        lanes=s.pflash_drafter_lanes,
        pin_view={"auto": None, "on": True, "off": False}[s.pflash_drafter_pin_view],
        rope=s.pflash_rope,
        shared_duty=s.pflash_shared_duty,
        persistent=s.draft_residency == "persistent",
        calibrate=s.pflash_calibrate,
        min_speedup=s.pflash_min_speedup,
    )


def pflash_config(s: ModelSettings) -> PflashConfig:
    return PflashConfig(
        mode=s.pflash,
        threshold=s.pflash_threshold,
        keep_ratio=s.pflash_keep_ratio,
        curve=KeepCurve.parse(s.pflash_curve) if s.pflash_curve else None,
        query_tokens=s.pflash_query_tokens,
        segment_min=s.pflash_segment_min,
        segment_max=s.pflash_segment_max,
        select=plugins.selector(s.pflash_selector),
        polite_s=s.pflash_polite_s,
    )


# llama-server's n_batch, the default here where the model's layers run on a GPU: every H200 figure of
# ours was measured with it, and a 32-image vision round ran 6.97 req/s at stock's 512 against 10.91
# (docs/vision.md: fewer, fuller prefill steps); stock's 512 stays on the CPU, where 128-token
# prefill chunks bound the steps anyway
GPU_N_BATCH = 2048


def n_batch(s: ModelSettings) -> int:
    """The engine's n_batch: the one given, else GPU_N_BATCH where the model has layers on a GPU."""
    if "n_batch" in s.model_fields_set or s.n_gpu_layers == 0 or gpu_count() == 0:
        return s.n_batch
    return max(s.n_batch, GPU_N_BATCH)


def engine_config(s: ModelSettings, target: ModelParams, max_ctx: int) -> EngineConfig:
    seed = None if s.seed in _RANDOM_SEEDS else s.seed
    return EngineConfig(
        n_slots=s.max_concurrency,
        max_ctx=max_ctx,
        kv_pool_tokens=s.kv_pool_tokens,
        kv_layout=s.kv_layout,
        host_cache_bytes=s.cache_size if s.cache else 0,
        page_size=s.kv_page_size,
        prefill_chunk=s.prefill_chunk,
        prefill_per_answer=s.prefill_per_answer,
        prefill_chunk_per_step=s.prefill_chunk_per_step,
        reuse_compressed=s.pflash_reuse_compressed,
        n_batch=n_batch(s),
        n_ubatch=s.n_ubatch,
        max_queue=s.max_queue,
        schedule_policy=s.schedule_policy,
        n_threads=s.n_threads,
        n_threads_batch=s.n_threads_batch,
        model=target,
        flash_attn=s.flash_attn,
        offload_kqv=s.offload_kqv,
        swa_full=s.swa_full,
        type_k=s.type_k,
        type_v=s.type_v,
        seed=seed,
        penalty_last_n=s.last_n_tokens_size,
        backend_sampling=s.backend_sampling,
        steady_decode=None if s.steady_decode == "auto" else s.steady_decode == "on",
        max_step_s=s.max_step_s,
        speculation=speculation_config(s),
        verbose=s.verbose,
    )


def speculation_config(s: ModelSettings) -> SpeculationConfig | None:
    """Stock's speculative keys: `--draft_model prompt-lookup-decoding`, a draft model's GGUF, or
    `pflash` (PFlash's drafter GGUF drafts tokens too), `--draft_model_num_pred_tokens` draft tokens
    per row and step at most (only with a draft_model). A draft model loads where the target does."""
    if not s.draft_model:
        return None
    draft = draft_model_path(s.draft_model, s.pflash_drafter)
    if s.draft_model_num_pred_tokens < 1:
        raise SettingsRefused("draft_model_num_pred_tokens", f"at least 1, not {s.draft_model_num_pred_tokens}")
    return SpeculationConfig(draft, s.draft_model_num_pred_tokens, draft_params=draft_model_params(s),
                             n_threads=s.n_threads, n_threads_batch=s.n_threads_batch)


def draft_model_path(given: str, pflash_drafter: str | None) -> str:
    """PROMPT_LOOKUP, or the draft model's GGUF: the path given, or for `pflash` the --pflash_drafter
    file (the whole model, not the copy cut for scoring; its weights load a second time, on the CPU
    the same pages of the file)."""
    path = given
    if path == DRAFT_PFLASH:
        if not pflash_drafter:
            raise SettingsRefused("draft_model", f"{DRAFT_PFLASH!r} drafts with PFlash's drafter GGUF, and there is "
                                  "none (--pflash_drafter PATH.gguf): the target drafting for itself saves nothing")
        path = pflash_drafter
    if path != PROMPT_LOOKUP and not os.path.isfile(path):
        raise SettingsRefused("draft_model", f"{PROMPT_LOOKUP!r}, {DRAFT_PFLASH!r} or the path of a draft model's "
                              f"GGUF, and there is no such file: {path}")
    return path


def draft_model_params(s: ModelSettings) -> ModelParams:
    """A draft model: the target's placement (on main_gpu alone when split), none of its rope,
    kv_overrides or LoRA, which describe the target's weights."""
    return ModelParams(n_gpu_layers=s.n_gpu_layers, split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE, main_gpu=s.main_gpu,
                       use_mmap=s.use_mmap, use_mlock=s.use_mlock)


def drafter_params(s: ModelSettings) -> ModelParams:
    """A separate drafter GGUF: the target's placement (on main_gpu alone when split), none of its
    rope, kv_overrides or LoRA, which describe the target's weights."""
    gpu_layers = s.n_gpu_layers if s.pflash_drafter_gpu_layers is None else s.pflash_drafter_gpu_layers
    return ModelParams(n_gpu_layers=gpu_layers, split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE, main_gpu=s.main_gpu,
                       use_mmap=s.use_mmap, use_mlock=s.use_mlock)


def bring_up(p: LlamaPlan) -> None:
    """The process-wide part, before any weights load: the NUMA strategy and the RPC servers'
    devices; then main_gpu against the devices llama.cpp sees (none on a CPU build: nothing to check)."""
    try:
        init_numa(p.numa)
    except ValueError as error:
        raise SettingsRefused("numa", str(error)) from None
    if p.rpc_servers:
        try:
            add_rpc_servers(list(p.rpc_servers))
        except RuntimeError as error:
            raise SettingsRefused("rpc_servers", str(error)) from None
    gpus, main_gpu = gpu_count(), p.target.main_gpu
    if gpus and p.cuda_graphs and disable_graphs():
        log.warning("CUDA graphs off: %s", p.cuda_graphs)
    if gpus and main_gpu >= gpus:
        raise SettingsRefused("main_gpu", f"{main_gpu} is not one of the {gpus} GPU devices llama.cpp sees")
    if gpus and p.target.split_mode == llama_cpp.LLAMA_SPLIT_MODE_ROW and not gpus_split_rows():
        raise SettingsRefused("split_mode", NO_ROW_SPLIT)
