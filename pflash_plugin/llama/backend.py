"""llama.cpp's process-wide state, set up exactly once.

Backend init and the log callback are global in llama.cpp; setting them from several threads (the
scheduler and the compression worker) races, so both go through this one guarded call.
"""
from __future__ import annotations

import threading

import llama_cpp
from llama_cpp import _logger

_lock = threading.Lock()
_done = False


def init_backend(verbose: bool = False) -> None:
    global _done
    with _lock:
        # llama_cpp._logger installed its (module-global, never collected) log callback on import
        _logger.set_verbose(verbose)
        if not _done:
            llama_cpp.llama_backend_init()
            _done = True
