"""Ours against ours at another revision, on bench/serving.py's throughput trial (4 concurrent
/v1/completions of 64 tokens on the demo model), greedy and sampled, reps interleaved A, B, A, B.

    python bench/sampling_ab.py --baseline-tree /tmp/base [--this-tree /tmp/this] [--reps 7]

`--baseline-tree`, `--this-tree` (default: this checkout): checkouts of the revisions (`git archive
REV | tar -x -C DIR`); each server imports its own tree's code. Prints the medians and writes bench/results/sampling_ab.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))  # as in bench/serving.py: bench/ must not shadow the standard library

import httpx
from harness import REPO, ServerProcess, demo_model_path, machine
from serving import Settings, throughput_trial

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "seed": 7}


async def trial(server: ServerProcess, rep: int, sampled: bool) -> float:
    cfg = Settings(reps=1)
    async with httpx.AsyncClient(timeout=600) as client:
        if not sampled:
            return (await throughput_trial(client, server, rep, cfg))["tokens_per_s"]
        bodies = [{"prompt": f"Story {rep}.{i}: once upon a time", "max_tokens": cfg.max_tokens,
                   "min_tokens": cfg.max_tokens, **SAMPLED} for i in range(cfg.clients)]
        start = asyncio.get_running_loop().time()
        replies = await asyncio.gather(*(client.post(server.url + "/v1/completions", json=b) for b in bodies))
        wall = asyncio.get_running_loop().time() - start
        return sum(r.json()["usage"]["completion_tokens"] for r in replies) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", dest="baseline", type=Path, required=True)
    parser.add_argument("--this-tree", dest="this", type=Path, default=REPO)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sampling_ab.json")
    args = parser.parse_args()
    flags = ["--model", demo_model_path(), "--n_ctx", "8192", "--max_concurrency", "4", "--verbose", "false"]
    servers = {"this": ServerProcess("ab-this", flags, cwd=args.this), "baseline": ServerProcess("ab-baseline", flags, cwd=args.baseline)}
    rows = []
    try:
        for server in servers.values():
            server.start(300)
            asyncio.run(trial(server, -1, False))  # warm-up
        for rep in range(args.reps):
            for sampled in (False, True):
                for name, server in servers.items():
                    rows.append({"arm": name, "sampled": sampled, "rep": rep,
                                 "tok_s": round(asyncio.run(trial(server, rep, sampled)), 2),
                                 "load_1m": os.getloadavg()[0]})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    medians = {f"{name}, {'sampled' if sampled else 'greedy'}":
               statistics.median(r["tok_s"] for r in rows if r["arm"] == name and r["sampled"] == sampled)
               for name in servers for sampled in (False, True)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "medians": medians, "machine": machine()}, indent=1))
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
