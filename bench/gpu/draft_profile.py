"""Where one windowed draft spends its time: the capture, llama.cpp's host work per ubatch, and the
GPU's kernels, taken apart by timing variants that each leave one part out.

    python bench/gpu/draft_profile.py --model D10.gguf --tiny T10.gguf --layers 9 --out profile.json
    ncu --clock-control none --cache-control none --print-units base --metrics gpu__time_duration.sum \
        --csv --log-file k.csv python bench/gpu/draft_profile.py --model D10.gguf --kernels_only
    python bench/gpu/draft_profile.py --kernel_table k.csv --out kernels.json

Arms, on the same random tokens, interleaved per repetition (W 2048, 64-token sink for the draft):
- `draft`: the drafter as the server runs it (capture callback, early stop, scoring).
- `plain`: the same windows decoded by a context without a callback (one wait at the end).
- `plain-synced`: the same, waiting for the GPU after every ubatch: `submit_ms` is the host's time
  inside llama_decode (graph build, inputs, kernel launches), `wait_ms` what the GPU still had to do.
- `plain-ub2048`: a window per ubatch.
- `floor`: the same windows on `--tiny`, a model of the same layer count and tiny widths: what
  the ubatches cost with almost no arithmetic (host work and launches).
With `--model` cut to the draft's layers, draft - plain is the capture's cost, plain - floor the
arithmetic the GPU could not hide. `--trace cupti_trace.so` then runs the draft and both plain arms
once more under CUPTI (cupti_trace.c): the GPU's busy time, the kernels and the host's CUDA calls
per ubatch. `--kernels_only` decodes KERNEL_WINDOWS windows for a kernel
profiler; `--kernel_table` sums its CSV per kernel name, per ubatch.
"""
from __future__ import annotations

import argparse
import ctypes
import csv
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from draft_forward import options
from pflash_plugin.llama import Batch, Context, ContextConfig, Model
from pflash_plugin.pflash.drafter import Drafter

import numpy as np  # after llama_cpp (see pflash_gpu.py)

WINDOW = 2048
KERNEL_WINDOWS = 3  # of 512-token ubatches, for --kernels_only and --kernel_table


class Windows:
    """Windows of WINDOW tokens decoded without a callback, each in an emptied sequence."""

    def __init__(self, model: Model, n_ubatch: int) -> None:
        self.n_ubatch = n_ubatch
        self.ctx = Context(model, ContextConfig(n_ctx=WINDOW, n_batch=n_ubatch, n_ubatch=n_ubatch,
                                                flash_attn=True, n_outputs_max=1))
        self.batch = Batch(n_ubatch, 1)

    def run(self, tokens: list[int], synced: bool = False) -> dict[str, float]:
        """Decode every window; synced: wait for the GPU after each ubatch and time both sides."""
        submit = wait = 0.0
        ubatches = 0
        start = time.perf_counter()
        for first in range(0, len(tokens), WINDOW):
            self.ctx.clear()
            window = tokens[first:first + WINDOW]
            for done in range(0, len(window), self.n_ubatch):
                self.batch.clear()
                self.batch.add_sequence(window[done:done + self.n_ubatch], first + done, 0, False)
                before = time.perf_counter()
                self.ctx.decode(self.batch)
                if synced:
                    submitted = time.perf_counter()
                    self.ctx.synchronize()
                    submit += submitted - before
                    wait += time.perf_counter() - submitted
                ubatches += 1
        self.ctx.synchronize()
        wall = time.perf_counter() - start
        row = {"wall_ms": wall * 1e3, "ubatches": ubatches, "ms_per_ubatch": wall * 1e3 / ubatches}
        if synced:
            row |= {"submit_ms_per_ubatch": submit * 1e3 / ubatches, "wait_ms_per_ubatch": wait * 1e3 / ubatches}
        return row

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def kernel_table(path: Path, ubatches: int) -> list[dict[str, float | str]]:
    """ncu's CSV (one row per kernel launch and metric) summed per kernel name, per ubatch."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    with path.open() as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines come first
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}.get(row.get("Metric Unit", "nsecond"), 1e-6)
        name = row["Kernel Name"].removeprefix("void ").split("(")[0].split("<")[0]
        total[name] += value * scale
        count[name] += 1
    rows = [{"kernel": name, "ms_per_ubatch": round(ms / ubatches, 4), "launches_per_ubatch": count[name] / ubatches}
            for name, ms in total.items()]
    rows.sort(key=lambda r: -float(r["ms_per_ubatch"]))
    rows.append({"kernel": "all", "ms_per_ubatch": round(sum(total.values()) / ubatches, 4),
                 "launches_per_ubatch": sum(count.values()) / ubatches})
    return rows


class Tracer:
    """cupti_trace.c through ctypes: every kernel, copy and CUDA runtime call of a stretch of time."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.trace_now.restype = ctypes.c_ulonglong
        self.lib.trace_stop.restype = ctypes.c_long
        self.lib.trace_stop.argtypes = [ctypes.c_char_p]

    def record(self, run: Callable[[], object], ubatches: int, out: Path) -> dict[str, object]:
        """Trace one call of `run` and sum what it did per ubatch."""
        status = self.lib.trace_start()
        if status != 0:
            raise RuntimeError(f"CUPTI refused to trace ({status})")
        start = self.lib.trace_now()
        run()
        end = self.lib.trace_now()
        self.lib.trace_stop(str(out).encode())
        return trace_summary(out, start, end, ubatches)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the drafter, best cut to the draft's layers")
    parser.add_argument("--tiny", help="a model of the same layer count with tiny widths (the floor arm)")
    parser.add_argument("--layers", type=int, nargs="+", default=[9])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kernels_only", action="store_true", help="decode a few windows for a kernel profiler")
    parser.add_argument("--kernel_table", type=Path, help="the kernel profiler's CSV of a --kernels_only run, to sum")
    parser.add_argument("--trace", help="cupti_trace.so: trace the draft and the plain arms once more")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.kernel_table:
        table = kernel_table(args.kernel_table, KERNEL_WINDOWS * WINDOW // 512)
        print(json.dumps(table, indent=1))
        if args.out:
            args.out.write_text(json.dumps(table, indent=1))
        return
    model = Model(args.model, n_gpu_layers=-1)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(100, model.n_vocab, args.tokens)]
    if args.kernels_only:
        Windows(model, 512).run(tokens[:KERNEL_WINDOWS * WINDOW])
        return
    drafter = Drafter(model, args.layers, args.tokens, options("W2048-ub512", 64))
    tiny = Model(args.tiny, n_gpu_layers=-1) if args.tiny else None
    arms = {"plain": (Windows(model, 512), False), "plain-synced": (Windows(model, 512), True),
            "plain-ub2048": (Windows(model, WINDOW), False)}
    if tiny:
        arms["floor"] = (Windows(tiny, 512), False)
        arms["floor-synced"] = (Windows(tiny, 512), True)
    rows = []
    for rep in range(-1, args.reps):  # rep -1 warms every arm up
        start = time.perf_counter()
        result = drafter.run(tokens, len(tokens) - 8)
        rows.append({"arm": "draft", "rep": rep, "wall_ms": (time.perf_counter() - start) * 1e3,
                     "ubatches": len(tokens) // 512, **result.timings})
        rows[-1]["ms_per_ubatch"] = rows[-1]["wall_ms"] / rows[-1]["ubatches"]
        for name, (windows, synced) in arms.items():
            rows.append({"arm": name, "rep": rep, **windows.run(tokens, synced)})
        for row in rows[-1 - len(arms):]:
            print(json.dumps(row), flush=True)
    measured = [r for r in rows if r["rep"] >= 0]
    summary = {}
    for arm in ["draft", *arms]:
        mine = [r for r in measured if r["arm"] == arm]
        summary[arm] = {key: round(statistics.median(r[key] for r in mine), 3) for key in mine[0]
                        if key not in ("arm", "rep") and isinstance(mine[0][key], (int, float))}
        summary[arm]["us_per_token"] = round(summary[arm]["wall_ms"] * 1e3 / args.tokens, 2)
    print(json.dumps(summary, indent=1))
    traces = {}
    if args.trace:
        tracer, ubatches = Tracer(args.trace), len(tokens) // 512
        traces["draft"] = tracer.record(lambda: drafter.run(tokens, len(tokens) - 8), ubatches, Path("/tmp/trace-draft.txt"))
        for name in ["plain", "plain-ub2048"]:
            windows = arms[name][0]
            traces[name] = tracer.record(lambda w=windows: w.run(tokens), len(tokens) // windows.n_ubatch,
                                         Path(f"/tmp/trace-{name}.txt"))
        print(json.dumps(traces, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "tiny": args.tiny, "tokens": args.tokens,
                                        "rows": rows, "summary": summary, "traces": traces}, indent=1))
    drafter.close()
    for windows, _ in arms.values():
        windows.close()


if __name__ == "__main__":
    main()
