"""Foreign calls made holding the GIL. ctypes releases the GIL around every call of a CDLL's
function, and taking it back waits out the switch interval (5 ms) whenever another thread runs
Python (the engine thread, the event loop, other requests' preparation): a call of microseconds
can cost its thread milliseconds. So the short calls keep it (ctypes' PYFUNCTYPE), and only the
calls that run for ms and scale over cores release it."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any, Iterable


def holding_gil(function: Any) -> Any:
    """A ctypes function of a CDLL as one that keeps the GIL through the call (PYFUNCTYPE)."""
    prototype = ctypes.PYFUNCTYPE(function.restype, *(function.argtypes or ()))
    return prototype(ctypes.cast(function, ctypes.c_void_p).value or 0)


def holding_gil_all(library: Any, names: Iterable[str]) -> SimpleNamespace:
    """Those functions of a ctypes binding module, each as `holding_gil` makes it, by name."""
    return SimpleNamespace(**{name: holding_gil(getattr(library, name)) for name in names})
