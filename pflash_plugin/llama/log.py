"""llama.cpp's and ggml's log through Python logging, as the logger `llama.cpp`: one record per
line, at llama.cpp's own level (llama_cpp's callback prints to stderr instead, and maps ggml's
levels off by one, so that its errors count as debug lines).

By default the logger passes warnings and errors; `verbose` passes everything (llama.cpp's load
log is about 2,000 debug and info lines).
"""
from __future__ import annotations

import ctypes
import logging
import threading

import llama_cpp

log = logging.getLogger("llama.cpp")

# enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the last line)
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5

_lock = threading.Lock()  # the engine and compression threads log concurrently
_partial: list[str] = []  # the current line's text so far
_level = logging.INFO


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    global _level
    try:
        with _lock:
            if level != _CONT:
                _level = _LEVELS.get(level, logging.INFO)
            if not log.isEnabledFor(_level):
                return
            _partial.append(text.decode("utf-8", errors="replace"))
            if not _partial[-1].endswith("\n"):
                return
            line = "".join(_partial).rstrip("\n")
            _partial.clear()
        if line:
            log.log(_level, "%s", line)
    except Exception:  # an exception must not cross into C
        pass


_installed = False


def route_llama_log(verbose: bool) -> None:
    """Send llama.cpp's log to the `llama.cpp` logger: every line when `verbose`, else warnings
    and errors. The callback is a module global, so it is never collected while C holds it."""
    global _installed
    log.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if verbose and not log.handlers and not logging.getLogger().handlers:
        # logging is not configured (a library user, stock's server): print the lines as llama_cpp does
        log.addHandler(logging.StreamHandler())
    if not _installed:
        llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
        _installed = True
