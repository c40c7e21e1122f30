"""Builds a ready engine for one model: weights, context sized for the slots, pool, scheduler."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..llama import Context, ContextConfig, Model, ModelParams
from .engine import Engine
from .kv_pool import PagePool
from .runner import LlamaRunner
from .scheduler import Scheduler, SchedulerConfig
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


@dataclass
class EngineConfig:
    n_slots: int = 4
    max_ctx: int | None = None  # per-request limit on prompt + max_tokens; None: the model's
    kv_pool_tokens: int | None = None  # None: every slot can hold a full max_ctx request
    page_size: int = 32
    prefill_chunk: int = 128  # per-prompt prefill tokens per step while others are active
    reuse_compressed: bool = False  # SchedulerConfig.reuse_compressed
    n_batch: int = 512
    n_ubatch: int = 512
    max_queue: int = 64
    n_threads: int = field(default_factory=decode_threads)
    n_threads_batch: int = field(default_factory=physical_cores)
    model: ModelParams = field(default_factory=ModelParams)  # the target's load, rope and LoRA
    flash_attn: bool | None = None
    offload_kqv: bool = True
    type_k: int | None = None
    type_v: int | None = None
    seed: int | None = None  # requests without a seed draw one from an RNG seeded with this (None: random)
    penalty_last_n: int = 64  # the repeat-penalty window of every sampler chain
    max_step_s: float = 300.0  # a step running longer marks the engine stalled (/health 503); 0: never
    verbose: bool = False


class MemoryReserveError(ValueError):
    """The KV pool would not leave the drafter's reserve free."""


@dataclass(frozen=True)
class MemoryBudget:
    """What the KV pool must leave free on the device that also holds the PFlash drafter."""

    reserve_bytes: int  # the drafter's need up to max_ctx
    available_bytes: int  # free on that device once the weights are loaded
    kv_share: float = 1.0  # of each token's KV, the fraction on that device (a split by layers puts the rest on others)


def pool_tokens(config: EngineConfig, kv_per_token: int, budget: MemoryBudget | None = None) -> int:
    """KV pool size in tokens (whole pages). Without a budget: the configured or automatic size.
    With one: the automatic size shrinks to what leaves the reserve free, and an explicit size
    that does not leave it free is refused, saying how many tokens fit."""
    assert config.max_ctx is not None
    page = config.page_size
    wanted = config.kv_pool_tokens or config.n_slots * config.max_ctx
    if budget is None or budget.reserve_bytes <= 0:
        return -(-wanted // page) * page
    reserve_bytes, available = budget.reserve_bytes, budget.available_bytes
    kv_here = max(math.ceil(kv_per_token * budget.kv_share), 1)
    fit = max((available - reserve_bytes) // kv_here, 0) // page * page
    mib = reserve_bytes / 2**20
    if config.kv_pool_tokens and config.kv_pool_tokens > fit:
        raise MemoryReserveError(
            f"--kv_pool_tokens {config.kv_pool_tokens} does not leave the PFlash drafter's reserve "
            f"({mib:.0f} MiB) free: at most {fit} tokens fit in {available / 2**20:.0f} MiB available"
        )
    if fit < config.max_ctx:
        raise MemoryReserveError(
            f"with the PFlash drafter's reserve ({mib:.0f} MiB) only {fit} KV tokens fit, less than "
            f"max_ctx ({config.max_ctx}): lower --max_ctx or turn PFlash off"
        )
    return min(-(-wanted // page) * page, fit)


def load_model(path: str | os.PathLike, config: EngineConfig) -> Model:
    model = Model(path, config.model, verbose=config.verbose)
    if config.max_ctx is None:
        config.max_ctx = model.n_ctx_train
    if config.max_ctx > model.n_ctx_train:
        raise ValueError(f"max_ctx {config.max_ctx} exceeds the model's training context {model.n_ctx_train}")
    if config.n_slots > config.n_batch:
        raise ValueError(f"max_concurrency ({config.n_slots}) cannot exceed n_batch ({config.n_batch}): "
                         "every decoding slot needs one token of each step")
    return model


def build_engine(
    model: Model,
    config: EngineConfig,
    name: str = "engine",
    compressor: Compressor | None = None,
    budget: MemoryBudget | None = None,
) -> Engine:
    """Context sized for the slots (within `budget`, which leaves the drafter's reserve free),
    pool, scheduler, runner; the engine thread is started."""
    assert config.max_ctx is not None
    tokens = pool_tokens(config, model.kv_bytes_per_token(), budget)
    ctx = Context(
        model,
        ContextConfig(
            n_ctx=tokens,
            n_batch=config.n_batch,
            n_ubatch=config.n_ubatch,
            n_seq_max=config.n_slots,
            n_outputs_max=config.n_slots,  # one logits row per slot per step (saves n_batch x n_vocab floats)
            n_threads=config.n_threads,
            n_threads_batch=config.n_threads_batch,
            flash_attn=config.flash_attn,
            offload_kqv=config.offload_kqv,
            type_k=config.type_k,
            type_v=config.type_v,
        ),
    )
    runner = LlamaRunner(model, ctx, seed=config.seed, penalty_last_n=config.penalty_last_n)
    limits = SchedulerConfig(n_slots=config.n_slots, max_batch_tokens=config.n_batch, max_ctx=config.max_ctx,
                             max_queue=config.max_queue, prefill_chunk=config.prefill_chunk,
                             reuse_compressed=config.reuse_compressed,
                             can_compress=compressor is not None)
    scheduler = Scheduler(runner, PagePool(tokens // config.page_size, config.page_size), limits,
                          model.piece, model.is_eog)
    engine = Engine(scheduler, runner, name=name, compressor=compressor, max_step_s=config.max_step_s)
    engine.start()
    return engine


def load_engine(model_path: str | os.PathLike, config: EngineConfig, name: str = "engine") -> tuple[Model, Engine]:
    model = load_model(model_path, config)
    return model, build_engine(model, config, name)
