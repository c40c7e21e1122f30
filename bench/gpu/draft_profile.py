"""Where one windowed draft spends its time: the capture, llama.cpp's host work per ubatch, and the
GPU's kernels, taken apart by timing variants that each leave one part out.

    python bench/gpu/draft_profile.py --model D10.gguf --tiny T10.gguf --layers 9 --out profile.json \
        [--trace cupti_trace.so]

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
per ubatch (Nsight Systems is not on the H200 machine, and ncu read no counters there).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cupti import Tracer
from draft_forward import Windows, options
from pflash_plugin.llama import Model
from pflash_plugin.pflash.drafter import Drafter

import numpy as np  # after llama_cpp (see pflash_gpu.py)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the drafter, best cut to the draft's layers")
    parser.add_argument("--tiny", help="a model of the same layer count with tiny widths (the floor arm)")
    parser.add_argument("--layers", type=int, nargs="+", default=[9])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--trace", help="cupti_trace.so: trace the draft and the plain arms once more")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = Model(args.model, n_gpu_layers=-1)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(100, model.n_vocab, args.tokens)]
    drafter = Drafter(model, args.layers, args.tokens, options("W2048-ub512", 64))
    tiny = Model(args.tiny, n_gpu_layers=-1) if args.tiny else None
    arms = {"plain": (Windows(model, 512), False), "plain-synced": (Windows(model, 512), True),
            "plain-ub2048": (Windows(model, 2048), False)}
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
        traces["draft"] = tracer.record(lambda: drafter.run(tokens, len(tokens) - 8), ubatches, Path("/tmp/trace-draft.txt"))[1]
        for name in ["plain", "plain-ub2048"]:
            windows = arms[name][0]
            traces[name] = tracer.record(lambda w=windows: w.run(tokens), len(tokens) // windows.n_ubatch,
                                         Path(f"/tmp/trace-{name}.txt"))[1]
        print(json.dumps(traces, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "tiny": args.tiny, "tokens": args.tokens,
                                        "rows": rows, "summary": summary, "traces": traces}, indent=1))
    drafter.close()
    for windows, _ in arms.values():
        windows.close()


if __name__ == "__main__":
    main()
