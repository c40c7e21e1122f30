"""Would drafting in several lanes pay? L drafters (a context and a capture each, on one model) draft
L parts of a prompt on L threads at once, against one drafter drafting the whole prompt.

    python bench/gpu/draft_lanes_probe.py --model D10.gguf --layers 9 --lanes 1 2 3 --out lanes.json

On an H200 one 512-token ubatch of the windowed draft is ~2.2 ms of host work and ~1.7 ms of GPU
work that do not overlap (the capture callback synchronizes; docs/pflash_draft_profile.md). Lanes
would overlap one lane's host work with another's GPU work; this measures whether llama.cpp and the
GPU let them, before a drafter is built that way (the parts' scores are not combined here). Arms run
interleaved per rep, after one warm-up each; `us_per_token` is the wall time over the whole prompt.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draft_forward import options
from pflash_plugin.llama import Model
from pflash_plugin.pflash.drafter import Drafter

import numpy as np  # after llama_cpp (see pflash_gpu.py)


def draft_in_lanes(drafters: list[Drafter], pool: ThreadPoolExecutor, tokens: list[int]) -> float:
    """Seconds to draft `tokens` split into len(drafters) parts, each on its own drafter at once."""
    size = -(-len(tokens) // len(drafters))
    parts = [tokens[i:i + size] for i in range(0, len(tokens), size)]
    start = time.perf_counter()
    list(pool.map(lambda pair: pair[0].run(pair[1], len(pair[1]) - 8), zip(drafters, parts)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, nargs="+", required=True)
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--config", default="W2048-ub512", help="a draft_forward.py configuration")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n_gpu_layers", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = Model(args.model, n_gpu_layers=args.n_gpu_layers)
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, model.n_vocab, args.tokens)]
    arms = {lanes: [Drafter(model, args.layers, args.tokens, options(args.config, 64)) for _ in range(lanes)]
            for lanes in args.lanes}
    rows = []
    with ThreadPoolExecutor(max(args.lanes)) as pool:
        for drafters in arms.values():
            draft_in_lanes(drafters, pool, tokens[:8192 * len(drafters)])
        for rep in range(args.reps):
            for lanes, drafters in arms.items():
                wall = draft_in_lanes(drafters, pool, tokens)
                rows.append({"lanes": lanes, "rep": rep, "wall_s": round(wall, 4),
                             "us_per_token": round(wall * 1e6 / len(tokens), 2)})
                print(json.dumps(rows[-1]), flush=True)
    summary = [{"lanes": lanes, "us_per_token": statistics.median(r["us_per_token"] for r in rows if r["lanes"] == lanes)}
               for lanes in arms]
    print(json.dumps(summary), flush=True)
    args.out.write_text(json.dumps({"model": args.model, "config": args.config, "tokens": args.tokens,
                                    "rows": rows, "summary": summary}, indent=1))
    for drafters in arms.values():
        for drafter in drafters:
            drafter.close()
    model.close()


if __name__ == "__main__":
    main()
