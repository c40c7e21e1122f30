"""Short requests sent together with long ones (mix8's shape on the CPU): 4 prompts of 1,500 token
ids and 4 of 4, all at once (the long ones first), 4 slots, full prefill, greedy, 8 tokens out;
each kind's mean TTFT (client's, streamed), this tree against another revision's, reps
interleaved with the order alternating. `--stagger_s S` sends the short ones S seconds after the
long ones: the race of mix8 on an H200, where the long prompts reached the engine a round ahead and
took every slot. `--longs 5` sends one long prompt more than the slots: it queues, and the short
ones queue behind it.

    python bench/admission_ab.py --baseline-tree /tmp/base [--reps 4] [--stagger_s 0.3] [--longs 5]

`--baseline-tree`: a checkout of the other revision (`git archive REV | tar -x -C DIR`); each server
imports its own tree's code. Prints the rows and the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from harness import REPO, ServerProcess, demo_model_path


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200000) for _ in range(1500)]


async def ttft(http: httpx.AsyncClient, url: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 8, "min_tokens": 8, "temperature": 0, "stream": True}
    async with http.stream("POST", url + "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: no streamed text")


async def workload(url: str, rep: int, stagger_s: float = 0.0, n_long: int = 4) -> tuple[float, float]:
    async def short(i: int) -> float:
        await asyncio.sleep(stagger_s)
        return await ttft(http, url, [2, 9000 + 10 * rep + i, 1234, 5678])

    async with httpx.AsyncClient(timeout=600) as http:
        longs = [ttft(http, url, long_prompt(10 * rep + i)) for i in range(n_long)]
        times = await asyncio.gather(*longs, *(short(i) for i in range(4)))
    return statistics.mean(times[:n_long]), statistics.mean(times[n_long:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", dest="baseline", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--stagger_s", type=float, default=0.0)
    parser.add_argument("--longs", type=int, default=4, help="long prompts (4 slots)")
    args = parser.parse_args()
    flags = ["--model", demo_model_path(), "--n_ctx", "2048", "--max_concurrency", "4", "--pflash", "off",
             "--cache", "false"]
    servers = {"before": ServerProcess("admission-before", flags, cwd=args.baseline),
               "this": ServerProcess("admission-this", flags, cwd=REPO)}
    rows = []
    try:
        for server in servers.values():
            server.start(300)
            asyncio.run(workload(server.url, 99))  # warm-up
        for rep in range(args.reps):
            order = list(servers.items()) if rep % 2 == 0 else list(reversed(servers.items()))
            for name, server in order:
                long_s, short_s = asyncio.run(workload(server.url, rep, args.stagger_s, args.longs))
                rows.append({"arm": name, "rep": rep, "long_ttft_s": round(long_s, 3), "short_ttft_s": round(short_s, 3)})
                print(rows[-1], flush=True)
    finally:
        for server in servers.values():
            server.stop()
    for name in servers:
        mine = [r for r in rows if r["arm"] == name]
        print(f"{name}: median short TTFT {statistics.median(r['short_ttft_s'] for r in mine)} s, "
              f"long {statistics.median(r['long_ttft_s'] for r in mine)} s")


if __name__ == "__main__":
    sys.exit(main())
