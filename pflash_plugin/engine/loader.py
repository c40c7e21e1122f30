"""Builds a ready engine for one model: weights, context sized for the slots, pool, scheduler."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from ..llama import Context, ContextConfig, Model
from .engine import Engine
from .kv_pool import PagePool
from .runner import LlamaRunner
from .scheduler import Scheduler


@dataclass
class EngineConfig:
    n_slots: int = 4
    max_ctx: int | None = None  # per-request limit on prompt + max_tokens; None: the model's
    kv_pool_tokens: int | None = None  # None: every slot can hold a full max_ctx request
    page_size: int = 32
    prefill_chunk: int = 128  # per-prompt prefill tokens per step while others are active
    n_batch: int = 512
    n_ubatch: int = 512
    max_queue: int = 64
    n_threads: int = 0
    n_threads_batch: int = 0
    n_gpu_layers: int = 0
    flash_attn: bool | None = None
    offload_kqv: bool = True
    type_k: int | None = None
    type_v: int | None = None
    use_mmap: bool = True
    use_mlock: bool = False
    verbose: bool = False

    @property
    def pool_tokens(self) -> int:
        tokens = self.kv_pool_tokens or self.n_slots * self.max_ctx
        return -(-tokens // self.page_size) * self.page_size


def load_engine(
    model_path: str | os.PathLike,
    config: EngineConfig,
    name: str = "engine",
    compressor: Callable[[Model], Any] | None = None,
) -> tuple[Model, Engine]:
    """Load, build and start. `compressor(model)` may return the engine's compression service."""
    model = Model(
        model_path,
        n_gpu_layers=config.n_gpu_layers,
        use_mmap=config.use_mmap,
        use_mlock=config.use_mlock,
        verbose=config.verbose,
    )
    if config.n_slots > config.n_batch:
        raise ValueError(f"max_concurrency ({config.n_slots}) cannot exceed n_batch ({config.n_batch}): "
                         "every decoding slot needs one token of each step")
    if config.max_ctx is None:
        config.max_ctx = model.n_ctx_train
    if config.max_ctx > model.n_ctx_train:
        raise ValueError(
            f"max_ctx {config.max_ctx} exceeds the model's training context {model.n_ctx_train}"
        )
    ctx = Context(
        model,
        ContextConfig(
            n_ctx=config.pool_tokens,
            n_batch=config.n_batch,
            n_ubatch=config.n_ubatch,
            n_seq_max=config.n_slots,
            n_threads=config.n_threads,
            n_threads_batch=config.n_threads_batch,
            flash_attn=config.flash_attn,
            offload_kqv=config.offload_kqv,
            type_k=config.type_k,
            type_v=config.type_v,
        ),
    )
    runner = LlamaRunner(model, ctx)
    scheduler = Scheduler(
        runner,
        PagePool(config.pool_tokens // config.page_size, config.page_size),
        n_slots=config.n_slots,
        max_batch_tokens=config.n_batch,
        max_ctx=config.max_ctx,
        max_queue=config.max_queue,
        piece=model.piece,
        is_eog=model.is_eog,
        prefill_chunk=config.prefill_chunk,
    )
    engine = Engine(scheduler, runner, name=name, compressor=compressor(model) if compressor else None)
    engine.start()
    return model, engine
