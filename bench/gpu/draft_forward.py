"""The drafter's forward alone: seconds and microseconds per token, causal against windowed, per
prompt length and drafter ubatch. Linear cost shows as a flat per-token time.

    python bench/gpu/draft_forward.py --model D.gguf --layers 27 --out draft.json [--n_gpu_layers -1]

Configurations run interleaved per repetition (A, B, C, ... then again), on random tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pflash_plugin.llama import Model
from pflash_plugin.pflash.drafter import DraftOptions, Drafter
from pflash_plugin.pflash.windows import DraftWindows

import numpy as np  # after llama_cpp (see pflash_gpu.py)

# (label, window, sink, n_batch); every window is drafted for every length (causal_max 0)
CONFIGS = [("causal-ub512", 0, 64, 512), ("W2048-ub512", 2048, 64, 512), ("W2048-ub2048", 2048, 64, 2048),
           ("W4096-ub1024", 4096, 64, 1024), ("W1024-ub512", 1024, 64, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, nargs="+", required=True, help="scoring layers (the draft stops after the last)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--configs", nargs="+", default=[c[0] for c in CONFIGS])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--n_gpu_layers", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = Model(args.model, n_gpu_layers=args.n_gpu_layers)
    max_tokens = max(args.lengths)
    drafters = {label: Drafter(model, args.layers, max_tokens,
                               DraftOptions(n_batch=n_batch, windows=DraftWindows(window, sink, causal_max=0)))
                for label, window, sink, n_batch in CONFIGS if label in args.configs}
    rng = np.random.default_rng(0)
    rows = []
    for n in args.lengths:
        tokens = [int(t) for t in rng.integers(100, model.n_vocab, n)]
        for rep in range(args.reps):
            for label, drafter in drafters.items():
                start = time.perf_counter()
                result = drafter.run(tokens, n - 8)
                wall = time.perf_counter() - start
                rows.append({"config": label, "tokens": n, "rep": rep, "wall_s": round(wall, 4),
                             "windows": result.windows, **result.timings})
                print(json.dumps(rows[-1]), flush=True)
    summary = []
    for label in drafters:
        for n in args.lengths:
            walls = [r["wall_s"] for r in rows if r["config"] == label and r["tokens"] == n]
            forward = [r["forward_ms"] for r in rows if r["config"] == label and r["tokens"] == n]
            summary.append({"config": label, "tokens": n, "wall_s": statistics.median(walls),
                            "forward_us_per_token": round(1000 * statistics.median(forward) / n, 2)})
            print(json.dumps(summary[-1]), flush=True)
    args.out.write_text(json.dumps({"model": args.model, "layers": args.layers, "rows": rows, "summary": summary}, indent=1))
    for drafter in drafters.values():
        drafter.close()
    model.close()


if __name__ == "__main__":
    main()
