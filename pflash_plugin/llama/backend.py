"""llama.cpp's process-wide state, set up exactly once.

Backend init and the log callback are global in llama.cpp; setting them from several threads (the
scheduler and the compression worker) races, so both go through this one guarded call.
"""
from __future__ import annotations

import threading

import llama_cpp

from .log import route_llama_log

_lock = threading.Lock()
_done = False


def init_backend(verbose: bool = False) -> None:
    global _done
    with _lock:
        route_llama_log(verbose)
        if not _done:
            llama_cpp.llama_backend_init()
            _done = True


_numa: int | None = None


def init_numa(strategy: int) -> None:
    """llama.cpp's NUMA strategy (ggml_numa_strategy) is process-wide and set once, before the
    weights load; a second model asking for another one is refused rather than ignored."""
    global _numa
    if strategy == 0:  # GGML_NUMA_STRATEGY_DISABLED: nothing to set
        return
    with _lock:
        if _numa is None:
            llama_cpp.llama_numa_init(strategy)
            _numa = strategy
        elif _numa != strategy:
            raise ValueError(f"NUMA strategy {_numa} is already set in this process; {strategy} cannot replace it")
