"""Prefix reuse across the cache's tiers: where a request's prefix comes from, and what it saves.

One server of ours on the demo model, 2 slots (a KV stream each), `--cache true` (the host-RAM
tier). Per rep, a fresh prose prefix P (about `--tokens` tokens) and, in this order:
  full      P + question 1, nothing cached: the full prefill;
  in place  P + question 2, P still in the idle slot that served question 1;
  copied    P + question 4 while P + question 3 decodes in that slot: the prefix is copied from
            its stream into the other slot's;
  restored  P + question 5 after two unrelated prompts took both slots: the prefix comes back
            from host RAM.
Each request is non-streamed with max_tokens 1 (question 3: 48, so that it holds its slot); the
server's own `ttft_ms` and `cached_tokens` are reported, medians over reps, as a share of the full
prefill's TTFT.

Usage: python bench/prefix_reuse.py [--tokens 2048] [--reps 3]
Writes bench/results/prefix_reuse.json and docs/prefix_reuse.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path

import httpx

from harness import REPO, ServerProcess, demo_model_path, machine
from pflash_plugin.testing.haystack import prose

ARMS = ("full", "in place", "copied", "restored")
NOTES = """- `full` shares one token (BOS) with what the slots hold; every other arm reuses all of the prefix.
- `copied` pays for a copy of the whole stream (llama.cpp copies streams whole), and runs beside the
  request that holds the prefix, which decodes in the same steps: its extra time over `in place` is an
  upper bound of the copy's cost. With streams of 5,120 cells it is 25-45 ms, about what 12-22
  prompt tokens cost to prefill here: the engine copies a prefix only when it is at least
  1/256 of a stream longer than what the chosen slot reuses in place (`MIN_COPY_FRACTION`).
- `restored` reads the saved state back from host RAM (`llama_state_seq_set_data`); the state was
  saved when the unrelated prompts took the slots (`--cache true`, stock's flag; `--cache_size`
  bounds the bytes).
- One decode thread (`--threads 1`): on 2 shared cores with other work, 2 threads made single steps
  vary from 15 to 500 ms."""


def prefix_text(rng: random.Random, tokens: int) -> str:
    return " ".join(prose(rng, max(tokens // 14, 1)))  # about 14 tokens a sentence on the demo model


async def ask(http: httpx.AsyncClient, prompt: str, max_tokens: int = 1) -> dict:
    reply = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "min_tokens": max_tokens})
    reply.raise_for_status()
    usage = reply.json()["usage"]
    return {"ttft_ms": usage["timings"]["ttft_ms"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


async def rep(url: str, tokens: int, seed: int) -> dict[str, dict]:
    rng = random.Random(seed)
    prefix = prefix_text(rng, tokens)

    def question(i: int) -> str:
        return f"{prefix}\n\nQuestion {i}: what happened next?\nAnswer:"

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        rows = {"full": await ask(http, question(1)), "in place": await ask(http, question(2))}
        holder = asyncio.create_task(ask(http, question(3), max_tokens=48))
        await asyncio.sleep(0.5)  # question 3 holds P's slot, decoding
        rows["copied"] = await ask(http, question(4))
        await holder
        await asyncio.gather(*(ask(http, prefix_text(rng, 400)) for _ in range(2)))  # both slots taken
        rows["restored"] = await ask(http, question(5))
    return rows


def write_page(results: dict, command: str) -> None:
    reps = results["reps"]
    full = statistics.median(r["full"]["ttft_ms"] for r in reps)
    lines = [
        "# Prefix reuse: in place, copied from another slot's stream, restored from host RAM",
        "",
        f"Demo model (gemma-3 270M Q4_K_M), 2 slots with a KV stream each, `--cache true`; machine: "
        f"{results['machine']['cpu']}, {results['machine']['nproc']} cores, load at start "
        f"{', '.join(f'{x:.2f}' for x in results['machine']['load_at_start'])}. Medians of {len(reps)} reps.",
        f"Command: `{command}`",
        "",
        "| prefix from | TTFT (server) | share of the full prefill | cached tokens of the prompt |",
        "|---|---:|---:|---:|",
    ]
    for arm in ARMS:
        ttft = statistics.median(r[arm]["ttft_ms"] for r in reps)
        cached = statistics.median(r[arm]["cached_tokens"] for r in reps)
        prompt = statistics.median(r[arm]["prompt_tokens"] for r in reps)
        lines.append(f"| {arm} | {ttft:.0f} ms | {100 * ttft / full:.1f}% | {cached:.0f} of {prompt:.0f} |")
    lines += ["", "Per rep (TTFT ms): " + "; ".join(", ".join(f"{arm} {r[arm]['ttft_ms']:.0f}" for arm in ARMS)
                                                   for r in reps), "", NOTES]
    (REPO / "docs" / "prefix_reuse.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "prefix_reuse.json")
    args = parser.parse_args()
    server = ServerProcess("ours-prefix-reuse", [
        "--model", demo_model_path(), "--n_ctx", str(2 * args.tokens + 1024), "--max_concurrency", "2",
        "--cache", "true", "--cache_size", str(1 << 30), "--n_threads", str(args.threads),
        "--n_threads_batch", str(args.threads)])
    results: dict = {"machine": machine(), "tokens": args.tokens, "reps": []}
    try:
        server.start(300)
        for i in range(args.reps):
            results["reps"].append(asyncio.run(rep(server.url, args.tokens, seed=100 + i)))
            print(json.dumps(results["reps"][-1]), flush=True)
        results["status"] = httpx.get(server.url + "/status").json()
    finally:
        server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    write_page(results, f"python bench/prefix_reuse.py --tokens {args.tokens} --reps {args.reps} --threads {args.threads}")


if __name__ == "__main__":
    main()
