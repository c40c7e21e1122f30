"""llama.cpp's and ggml's log through Python logging, as the logger `llama.cpp`: one record per
line, at llama.cpp's own level (llama_cpp's callback prints to stderr instead, and maps ggml's
levels off by one, so that its errors count as debug lines).

By default the logger passes warnings and errors; `verbose` passes everything (llama.cpp's load
log is about 2,000 debug and info lines). A decode aborted at our request (Context.set_abort: the
engine yielding to an arrival, the drafter to interactive work) makes llama.cpp log four warning and
error lines although nothing failed: those count as debug lines (`hush`).

Where the native library is built (native.py), a line below the logger's level never reaches Python:
the library's filter drops it in C (pfx_log_filter). The Python callback takes the GIL for each line,
and a thread inside llama.cpp (the engine's decode, libmtmd reading an image: 5 debug lines each)
waits for it, on a busy process up to the switch interval (5 ms) a line.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any, Callable

import llama_cpp

from . import native

log = logging.getLogger("llama.cpp")

# enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the last line)
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5

class _Line(threading.local):
    """The line a thread is writing (the engine and compression threads log concurrently)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.level = logging.INFO
        self.hushed: Callable[[], bool] | None = None  # see `hush`


_line = _Line()


def hush(aborted_on_request: Callable[[], bool] | None) -> None:
    """Until the next call, this thread's llama.cpp messages count as debug lines whenever
    `aborted_on_request()` is True (None: never): set around a decode whose abort we may ask for."""
    _line.hushed = aborted_on_request


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    try:
        line = _line
        if level != _CONT:  # a new message: whatever the last one left unfinished is dropped
            line.parts.clear()
            hushed = line.hushed is not None and line.hushed()
            line.level = logging.DEBUG if hushed else _LEVELS.get(level, logging.INFO)
        if not log.isEnabledFor(line.level):
            return
        line.parts.append(text.decode("utf-8", errors="replace"))
        if not line.parts[-1].endswith("\n"):
            return
        whole = "".join(line.parts).rstrip("\n")
        line.parts.clear()
        if whole:
            log.log(line.level, "%s", whole)
    except Exception:  # an exception must not cross into C
        pass


_installed = False
_DEBUG, _WARN = 1, 3  # ggml_log_level


@functools.cache
def _native_filter() -> Any:
    """The native library's filter as a log callback, where the library is built with one."""
    lib = native.load()
    if lib is None or not hasattr(lib, "pfx_log_filter"):  # not built, or built before it had one
        return None
    lib.pfx_log_forward.argtypes, lib.pfx_log_forward.restype = [llama_cpp.llama_log_callback, ctypes.c_int32], None
    return ctypes.cast(lib.pfx_log_filter, llama_cpp.llama_log_callback)


def sink() -> Any:
    """The log callback to hand llama.cpp, ggml and libmtmd (their *_log_set): the native filter in
    front of `_callback`, or `_callback` itself where the library is not built."""
    return _native_filter() or _callback


def route_llama_log(verbose: bool) -> None:
    """Send llama.cpp's log to the `llama.cpp` logger: every line when `verbose`, else warnings
    and errors (the log is process-wide: the model loaded last sets it). The callback is a module
    global, so it is never collected while C holds it."""
    global _installed
    log.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if verbose and not log.handlers and not logging.getLogger().handlers:
        # logging is not configured (a library user, stock's server): print the lines as llama_cpp does
        log.addHandler(logging.StreamHandler())
    lib = native.load() if _native_filter() is not None else None
    if lib is not None:
        lib.pfx_log_forward(_callback, _DEBUG if verbose else _WARN)
    if not _installed:
        llama_cpp.llama_log_set(sink(), ctypes.c_void_p(0))
        _installed = True
