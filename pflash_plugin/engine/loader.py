"""Builds a ready engine for one model: weights, context sized for the slots, pool, scheduler."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..llama import Context, ContextConfig, Model, ModelParams
from ..llama.media import Projector
from .engine import Engine
from .host_cache import HostCache
from .kv_pool import PagePool
from .media_encoder import MediaEncoder
from .runner import LlamaRunner
from .sampling import device_sampling
from .scheduler import Scheduler, SchedulerConfig
from .speculation.setup import DraftModel, SpeculationConfig, speculation
from .seams import Compressor


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings counted once), at least 1:
    the thread count of batches (prefill, drafting, embeddings)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:  # no topology (not Linux): every CPU counts
            return max(len(cpus), 1)
    return max(len(cores), 1)


def decode_threads() -> int:
    """n_threads, the narrow thread count of decode steps: half the physical cores, at least 1.
    Beside a competing load it wins (engine/threads.py measures both counts and takes the faster):
    on 2 shared cores beside a busy process 4 slots decoded in 65 ms on 1 thread and 174 ms on 2."""
    return max(physical_cores() // 2, 1)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What the engine is built with, whole before it is built (the server resolves max_ctx
    against the loaded model: server/config/llama_params.resolve)."""

    max_ctx: int  # per-request limit on prompt + max_tokens
    n_slots: int = 4
    kv_pool_tokens: int | None = None  # None: every slot can hold a full max_ctx request
    kv_layout: str = "auto"  # "per_slot", "unified" or "auto" (kv_layout())
    host_cache_bytes: int = 0  # the host-RAM tier of saved sequences (engine/host_cache.py); 0: none
    host_cache_min_tokens: int = 256  # shorter sequences are not saved, nor restored for a smaller gain
    page_size: int = 32
    prefill_chunk: int | None = None  # while requests decode: prefill tokens per step (on a GPU times the
    # prompts prefilling, prefill_chunk_per_step aside); None: step_chunks' default for where the model's layers run
    prefill_per_answer: int | None = None  # SchedulerConfig.prefill_per_answer; None: step_chunks' default
    prefill_chunk_per_step: bool | None = None  # SchedulerConfig.chunk_per_step; None: step_chunks' default
    reuse_compressed: bool = False  # SchedulerConfig.reuse_compressed
    n_batch: int = 512
    n_ubatch: int = 512
    max_queue: int = 64
    schedule_policy: str = "fcfs"  # SchedulerConfig.schedule_policy
    n_threads: int = field(default_factory=decode_threads)
    n_threads_batch: int = field(default_factory=physical_cores)
    model: ModelParams = field(default_factory=ModelParams)  # the target's load, rope and LoRA
    flash_attn: bool | None = None
    offload_kqv: bool = True
    swa_full: bool = True  # False: a window-sized SWA cache (less KV memory; reuse only near a sequence's end)
    type_k: int | None = None
    type_v: int | None = None
    seed: int | None = None  # requests without a seed draw one from an RNG seeded with this (None: random)
    penalty_last_n: int = 64  # the repeat-penalty window of every sampler chain
    backend_sampling: str = "auto"  # "on", "off", "auto": sampled rows where the output layer is on a GPU (sampling.py)
    max_step_s: float = 300.0  # a step running longer marks the engine stalled (/health 503); 0: never
    speculation: SpeculationConfig | None = None  # speculative decoding (stock's --draft_model); None: off
    verbose: bool = False
    mmproj: str | None = None  # a multimodal projector GGUF (issue 46): the engine serves media through libmtmd
    media_cache_bytes: int = 256 << 20  # encoded media embeddings kept, LRU by their bytes' hash
    media_encoders: int = 0  # projectors encoding at once (0: 1 on the CPU, MEDIA_ENCODERS_GPU with GPU layers)
    # decode steps keep their slots one run while rows end (filler rows, engine/steps.py) where each slot
    # has a KV stream (None or True; False: never): llama.cpp splits a stream per slot into a ubatch per run
    # of consecutive slots, each reading all the weights. On the CPU (demo model, 2 cores) 3 answers in slots
    # 0, 2 and 5 took 69.5 ms a decode step as 3 ubatches and 36.3 ms as one with logit-free fillers (31.0 in
    # slots 0-2); on a GPU a new shape is also launched kernel by kernel
    steady_decode: bool | None = None


class MemoryReserveError(ValueError):
    """The KV pool would not leave the drafter's reserve free."""


@dataclass(frozen=True)
class MemoryBudget:
    """What the KV pool must leave free on the device that also holds the PFlash drafter."""

    reserve_bytes: int  # the drafter's need up to max_ctx
    available_bytes: int  # free on that device once the weights are loaded
    kv_share: float = 1.0  # of each token's KV, the fraction on that device (a split by layers puts the rest on others)
    holder: str = "the PFlash drafter"  # whose need the reserve is, as errors name it
    remedy: str = "turn PFlash off"  # besides lowering max_ctx


def pool_tokens(config: EngineConfig, kv_per_token: int, budget: MemoryBudget | None = None) -> int:
    """KV pool size in tokens (whole pages). Without a budget: the configured or automatic size.
    With one: the automatic size shrinks to what leaves the reserve free, and an explicit size
    that does not leave it free is refused, saying how many tokens fit."""
    page = config.page_size
    # automatic: a whole llama.cpp KV stream of max_ctx for every slot
    wanted = config.kv_pool_tokens or config.n_slots * -(-config.max_ctx // STREAM_ALIGN) * STREAM_ALIGN
    if budget is None or budget.reserve_bytes <= 0:
        return -(-wanted // page) * page
    reserve_bytes, available = budget.reserve_bytes, budget.available_bytes
    kv_here = max(math.ceil(kv_per_token * budget.kv_share), 1)
    fit = max((available - reserve_bytes) // kv_here, 0) // page * page
    mib = reserve_bytes / 2**20
    if config.kv_pool_tokens and config.kv_pool_tokens > fit:
        raise MemoryReserveError(
            f"--kv_pool_tokens {config.kv_pool_tokens} does not leave {budget.holder}'s reserve "
            f"({mib:.0f} MiB) free: at most {fit} tokens fit in {available / 2**20:.0f} MiB available"
        )
    if fit < config.max_ctx:
        raise MemoryReserveError(
            f"with {budget.holder}'s reserve ({mib:.0f} MiB) only {fit} KV tokens fit, less than "
            f"max_ctx ({config.max_ctx}): lower --max_ctx or {budget.remedy}"
        )
    return min(-(-wanted // page) * page, fit)


def pool_fits(config: EngineConfig, kv_per_token: int, budget: MemoryBudget) -> bool:
    """Whether pool_tokens takes this budget (a pool of at least max_ctx beside the reserve)."""
    try:
        pool_tokens(config, kv_per_token, budget)
    except MemoryReserveError:
        return False
    return True


# per-slot streams: a prefix is copied from another slot's stream when it is at least 1/this of a
# stream longer than what the chosen slot reuses in place (llama.cpp copies the whole stream): on the
# demo model on 2 CPU cores a copy of 5,120 cells cost what 12-22 prompt tokens do (docs/prefix_reuse.md)
MIN_COPY_FRACTION = 256
STREAM_ALIGN = 256  # llama.cpp pads one sequence's KV stream (n_ctx / n_seq_max) to a multiple of this
LAYOUTS = ("auto", "per_slot", "unified")
# projectors encoding media at once on a GPU: one ViT encode of an image leaves the device mostly idle
MEDIA_ENCODERS_GPU = 4


@dataclass(frozen=True)
class KVLayout:
    """How the pool's tokens map onto llama.cpp's KV cache: one stream per slot (`kv_unified =
    false`: a ubatch attends to and masks its own slot's cells only) or one stream for all."""

    per_slot: bool
    slot_tokens: int  # KV tokens one slot can hold: its stream's, or the whole pool's

    def pools(self, n_slots: int, page_size: int) -> list[PagePool]:
        """One page pool per slot; the same pool for every slot when the KV is unified."""
        if self.per_slot:
            return [PagePool(self.slot_tokens // page_size, page_size) for _ in range(n_slots)]
        return [PagePool(self.slot_tokens // page_size, page_size)] * n_slots


def kv_layout(config: EngineConfig, pool: int) -> KVLayout:
    """`auto` gives each slot its own stream when every stream can hold a max_ctx request (the
    automatic pool size does), and keeps one unified pool when the pool is smaller than that: an
    oversubscribed pool serves more by letting the slots share its cells."""
    if config.kv_layout not in LAYOUTS:
        raise ValueError(f"unknown kv_layout {config.kv_layout!r}: choose one of {', '.join(LAYOUTS)}")
    stream = pool // config.n_slots // STREAM_ALIGN * STREAM_ALIGN
    if config.kv_layout == "per_slot" and stream == 0:
        raise ValueError(f"kv_layout per_slot: {pool} KV tokens give {config.n_slots} slots less than "
                         f"{STREAM_ALIGN} tokens each")
    per_slot = config.n_slots > 1 and (config.kv_layout == "per_slot"
                                       or (config.kv_layout == "auto" and stream >= config.max_ctx))
    return KVLayout(True, stream) if per_slot else KVLayout(False, pool)


def load_model(path: str | os.PathLike, config: EngineConfig) -> Model:
    """The weights of `config.model`, checked against the config (check_config)."""
    model = Model(path, config.model, verbose=config.verbose)
    check_config(config, model)
    return model


def check_config(config: EngineConfig, model: Model) -> None:
    """Refuse, before anything is sized, a config the model or the step cannot serve."""
    if config.max_ctx > model.n_ctx_train:
        raise ValueError(f"max_ctx {config.max_ctx} exceeds the model's training context {model.n_ctx_train}")
    if config.n_slots > config.n_batch:
        raise ValueError(f"max_concurrency ({config.n_slots}) cannot exceed n_batch ({config.n_batch}): "
                         "every decoding slot needs one token of each step")


class StepChunks(NamedTuple):
    prefill: int | None  # SchedulerConfig.prefill_chunk
    preempt: int  # SchedulerConfig.preempt_chunk
    per_step: bool  # SchedulerConfig.chunk_per_step
    per_answer: int  # SchedulerConfig.prefill_per_answer


def step_chunks(prefill_chunk: int | None, on_gpu: bool, per_answer: int | None = None,
                per_step: bool | None = None) -> StepChunks:
    """The prefill a step gives while others decode, and the step's prefill past which a
    newcomer aborts it. On the CPU (2 cores) each prefill token's time adds to every decoding
    request's step: 128 for both, the cap on the step's prefill in all, however many prompts
    prefill (per prompt, a request decoding beside 3 long prompts had steps of 384 prefill tokens:
    step_policy.py). On a GPU 512 per prompt prefilling (a prompt prefilling alone takes the whole
    step). The online benchmark on an H100 (docs/online.md, 3 reps at 2 and 4 req/s, 8B model):
    goodput 1.07x and 1.24x the whole step's (2,048, llama-server's rule, the default before), ITL p99
    0.12-0.15 s against 0.21-0.36 s; closed bursts lose a little: on an H200 (issue 28,
    docs/concurrent_gpu.md) 512 left the seed's mix8, qa8 and cd4 1.03-1.06x behind llama-server,
    the whole step within 1.04x (128 made cd4 1.28x). A step prefilling past 512 tokens is cut short
    for a newcomer (a 512-token step costs little on a GPU); an explicit chunk below that is the
    threshold too. While few answers decode, a GPU's cap grows to 2,048 over their number
    (StepPolicy.prefill_cap): on an H200 (session 74, docs/online.md, 3 reps) TTFT p99 1.30 s
    against 1.36 at 2 req/s, goodput 1.01-1.03x. On the CPU it does not grow: there 512 over
    their number (online bench, 0.15-0.2 req/s) left goodput as it was and made steps of one
    ubatch ~2 s long (a 6-token request sent during one had its first token in 2.93 s against
    0.45; again after short_first, session 75: TTFT p99 not lower, ITL p99 1.34 s). `per_step`
    None: in all on the CPU, per prompt on a GPU, where several long prompts at 512 each made
    steps that cost answers beside them a 100 ms TPOT (H200 online load, session 74's data: 13-16
    of 96 requests at 4 req/s); in all is not measured there yet."""
    interactive = 512 if on_gpu else 128
    prefill = prefill_chunk or interactive
    grown = (2048 if on_gpu else 0) if per_answer is None else per_answer
    return StepChunks(prefill, min(prefill, interactive), not on_gpu if per_step is None else per_step, grown)


def build_engine(
    model: Model,
    config: EngineConfig,
    name: str = "engine",
    compressor: Compressor | None = None,
    pool: int | None = None,
    draft: DraftModel | None = None,
) -> Engine:
    """Context sized for the slots and a pool of `pool` tokens (None: the configured or automatic
    size; the server sizes it beside the drafter's reserve), scheduler, runner; the engine thread
    is started. `draft`: the speculative draft model where the server loaded it already (counted in
    its memory plan; None: loaded here from config.speculation)."""
    layout = kv_layout(config, pool_tokens(config, model.kv_bytes_per_token()) if pool is None else pool)
    spec = config.speculation
    on_device = device_sampling(config.backend_sampling, model)
    ctx = engine_context(model, config, layout)
    runner = LlamaRunner(model, ctx, seed=config.seed, penalty_last_n=config.penalty_last_n,
                         backend_sampling=on_device)
    chunks = step_chunks(config.prefill_chunk, on_gpu=model.layers_on_gpu, per_answer=config.prefill_per_answer,
                         per_step=config.prefill_chunk_per_step)
    limits = SchedulerConfig(n_slots=config.n_slots, max_batch_tokens=config.n_batch, max_ctx=config.max_ctx,
                             max_queue=config.max_queue, prefill_chunk=chunks.prefill, preempt_chunk=chunks.preempt,
                             chunk_per_step=chunks.per_step, prefill_per_answer=chunks.per_answer,
                             reuse_compressed=config.reuse_compressed,
                             min_copy_tokens=layout.slot_tokens // MIN_COPY_FRACTION if layout.per_slot else 0,
                             swa_window=0 if config.swa_full else model.n_swa,
                             can_compress=compressor is not None, schedule_policy=config.schedule_policy)
    host = HostCache(config.host_cache_bytes, config.host_cache_min_tokens) if config.host_cache_bytes else None
    scheduler = Scheduler(runner, layout.pools(config.n_slots, config.page_size), limits, model.piece, model.is_eog,
                          host=host)
    scheduler.steps.steady = layout.per_slot and config.steady_decode is not False
    scheduler.steps.filler_logits = runner.overlaps
    if spec:
        scheduler.steps.speculation = speculation(spec, model, runner.sampling.speculates, config.n_slots,
                                                  config.max_ctx, draft)
    try:
        media = media_encoder(model, config)
    except BaseException:
        runner.close()
        raise
    if media is not None:
        media.decode_counts = runner.media.counts  # /status's media block shows the decode calls
        media.ubatches = runner.ubatches  # and their ubatches
    engine = Engine(scheduler, runner, name=name, compressor=compressor, max_step_s=config.max_step_s, media=media)
    engine.start()
    return engine


def engine_context(model: Model, config: EngineConfig, layout: KVLayout) -> Context:
    """The llama.cpp context of the slots: a KV stream per slot (or one unified pool) and one logits
    row per slot a step (saves n_batch x n_vocab floats), plus one per speculative draft token."""
    spec = config.speculation
    return Context(model, ContextConfig(
        n_ctx=layout.slot_tokens * config.n_slots if layout.per_slot else layout.slot_tokens,
        kv_unified=not layout.per_slot,
        n_batch=config.n_batch,
        n_ubatch=config.n_ubatch,
        n_seq_max=config.n_slots,
        n_outputs_max=config.n_slots + (spec.max_step_drafts(config.n_slots) if spec else 0),
        n_threads=config.n_threads,
        n_threads_batch=config.n_threads_batch,
        flash_attn=config.flash_attn,
        offload_kqv=config.offload_kqv,
        swa_full=config.swa_full,
        type_k=config.type_k,
        type_v=config.type_v,
    ))


def media_encoder(model: Model, config: EngineConfig) -> MediaEncoder | None:
    """The projector of `config.mmproj` (on the GPU where the model has layers there) and its
    encoder; None without one. ValueError for a projector libmtmd or the engine cannot take."""
    if config.mmproj is None:
        return None
    mmproj = config.mmproj
    count = config.media_encoders or (MEDIA_ENCODERS_GPU if model.layers_on_gpu else 1)
    projectors: list[Projector] = []
    try:
        for _ in range(count):  # the context's n_ubatch, as Context sets it
            projectors.append(Projector(mmproj, model, n_threads=config.n_threads_batch,
                                        n_ubatch=min(config.n_ubatch, config.n_batch)))
    except BaseException:
        for projector in projectors:
            projector.close()
        raise
    return MediaEncoder(projectors, config.media_cache_bytes)


def load_engine(model_path: str | os.PathLike, config: EngineConfig, name: str = "engine") -> tuple[Model, Engine]:
    model = load_model(model_path, config)
    return model, build_engine(model, config, name)
