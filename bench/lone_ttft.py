"""A lone prompt's TTFT on the CPU: ours (PFlash off) against the example server, the online
benchmark's servers and configs (bench/online.py), every server up at once and idle but for the one
request. At 0.15 req/s (docs/online.md, the full run) ours' TTFT was 5-13% above the example
server's for the same 150-900-token prompts, each alone on its server: this takes that apart from
the load. Each rep sends, per size, a fresh prompt (no prefix to reuse) to each arm in turn, in an
order that alternates per rep; max_tokens 1, streamed /v1/completions.

    PYTHONPATH=/tmp/peersite PFLASH_UPSTREAM_SITE=/tmp/peersite PFLASH_UPSTREAM_SERVER=/tmp/upstream/server.py \
        python bench/lone_ttft.py --sizes 150 300 600 900 --reps 5 --out bench/results/lone_ttft.json
"""
from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))  # as in bench/serving.py: bench/ must not shadow the standard library

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from harness import REPO, machine, uptime
from online import arms
from online_data import Item, demo_counter
from online_load import Outcome, one_request

from pflash_plugin.testing.haystack import fit_needle_prompt


async def ttft(url: str, body: bytes) -> float | None:
    outcome = Outcome("lone", 0, 1, 0.0)
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, body, outcome, time.perf_counter())
    return outcome.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[150, 300, 600, 900])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--arms", nargs="+", default=["ours", "upstream"])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lone_ttft.json")
    args = parser.parse_args()
    online_args = argparse.Namespace(ours_tree=None, ours_arms=[], base_tree=None, llama_server=None)
    the_arms = [a for a in arms(online_args, REPO / "bench" / "results" / "logs") if a.label in args.arms]
    count, rng = demo_counter(), random.Random(0)
    rows: list[dict[str, Any]] = []
    started = uptime()
    try:
        for arm in the_arms:
            arm.server.launch()
        for arm in the_arms:
            arm.server.wait_ready(600)
            asyncio.run(ttft(arm.server.url, arm.body(Item("Warm up.", 3, 1, "lone"))))
        for rep in range(args.reps):
            for size in args.sizes:
                prompt, _, n = fit_needle_prompt(count, size, "prose", rng.random(), rng.randrange(10**6))
                order = the_arms if rep % 2 == 0 else the_arms[::-1]
                for arm in order:
                    seconds = asyncio.run(ttft(arm.server.url, arm.body(Item(prompt, n, 1, "lone"))))
                    rows.append({"arm": arm.label, "rep": rep, "size": size, "prompt_tokens": n, "ttft_s": seconds})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for arm in the_arms:
            arm.server.stop()
    medians = {f"{a.label}/{size}": statistics.median(r["ttft_s"] for r in rows
                                                      if r["arm"] == a.label and r["size"] == size and r["ttft_s"])
               for a in the_arms for size in args.sizes}
    for size in args.sizes:
        print(size, {a.label: round(medians[f"{a.label}/{size}"], 4) for a in the_arms})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "lone_ttft", "machine": machine(), "uptime_at_start": started,
                                    "uptime_at_end": uptime(), "command": " ".join(["python", *sys.argv]),
                                    "medians": medians, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
