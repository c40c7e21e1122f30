"""cupti_trace.c through ctypes (Nsight Systems is not on the H200 machine, and ncu read no counters
there): every kernel, copy and CUDA runtime call of a stretch of time, summed per unit of work.
Build: see draft_profile.sh (nvcc -shared ... cupti_trace.c -lcupti)."""
from __future__ import annotations

import ctypes
from collections import defaultdict
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


class Tracer:
    """cupti_trace.c through ctypes: every kernel, copy and CUDA runtime call of a stretch of time."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.trace_now.restype = ctypes.c_ulonglong
        self.lib.trace_stop.restype = ctypes.c_long
        self.lib.trace_stop.argtypes = [ctypes.c_char_p]

    def record(self, run: Callable[[], T], ubatches: int | Callable[[T], int], out: Path) -> tuple[T, dict[str, object]]:
        """Trace one call of `run`: its result, and what it did per ubatch (a number, or one counted
        from the result: an engine's steps)."""
        status = self.lib.trace_start()
        if status != 0:
            raise RuntimeError(f"CUPTI refused to trace ({status})")
        start = self.lib.trace_now()
        result = run()
        end = self.lib.trace_now()
        self.lib.trace_stop(str(out).encode())
        units = ubatches(result) if callable(ubatches) else ubatches
        return result, trace_summary(out, start, end, units)


def trace_summary(path: Path, start: int, end: int, ubatches: int) -> dict[str, object]:
    """GPU busy time (the union of kernel intervals), kernels and host CUDA calls, per ubatch, ms."""
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        kind, first, last, name = line.split(" ", 3)
        if start <= int(first) and int(last) <= end:
            spans[kind].append((int(first), int(last), name.removeprefix("void ").split("(")[0].split("<")[0]))
    busy, reach = 0, 0
    for first, last, _ in sorted(spans["K"]):
        busy += max(0, last - max(first, reach))
        reach = max(reach, last)

    def per_name(kind: str) -> dict[str, list[float]]:
        total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for first, last, name in spans[kind]:
            total[name][0] += (last - first) / 1e6 / ubatches
            total[name][1] += 1 / ubatches
        top = sorted(total.items(), key=lambda item: -item[1][0])[:16]
        return {name: [round(ms, 4), round(n, 2)] for name, (ms, n) in top}

    return {"wall_ms_per_ubatch": round((end - start) / 1e6 / ubatches, 3),
            "gpu_busy_ms_per_ubatch": round(busy / 1e6 / ubatches, 3),
            "kernels_per_ubatch": round(len(spans["K"]) / ubatches, 1),
            "kernels [ms, launches] per ubatch": per_name("K"), "copies": per_name("M"),
            "runtime calls [ms, calls] per ubatch": per_name("R")}
